"""What the latency suite and the diagnostics share: each system's model, the routing a case replays, prompts, and
the timers (the copy engine's bandwidth, CUDA-event medians, the profiler's GPU events).

    from harness import build, prompt, trace_for
    model = build("asyncmoe-prefetch", "olmoe-1b-7b", 16)
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pathlib
import statistics
import tempfile

import numpy as np
import torch

import asyncmoe
from asyncmoe.trace import Trace
from asyncmoe.trace.simulate import belady_misses

from baselines import accelerate_offload, seed_lru
from oracle import oracle
from oracle import parse as parse_oracle
from shapes import SHAPES, random_model, routing_shape
from synthetic import synthetic

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = (
    torch.bfloat16 if CUDA else torch.float32
)  # fp32 on the CPU: every system's tokens equal the resident model's

DEMO_TRACE = pathlib.Path(__file__).parent / "traces" / "demo_val.npz"
FORMATS = (
    "fp8",
    "mxfp4",
    "int4",
)  # an asyncmoe system's experts in host memory and the slots: `asyncmoe-graph-fp8`
PROMPT = 16  # tokens of a decode case's prompt


HYBRID = "-hybrid"  # a system's last suffix: compile(hybrid=True)


def split_format(system: str) -> tuple[str, str | None]:
    """`asyncmoe-graph-prefetch-fp8` -> ("asyncmoe-graph-prefetch", "fp8"); a system without one -> (system, None)."""
    base, _, fmt = system.rpartition("-")
    return (base, fmt) if fmt in FORMATS else (system, None)


def prompt(shape: str, batch: int, length: int = PROMPT, seed: int | None = None) -> torch.Tensor:
    """Random token ids [batch, length] on DEVICE, the same for every system: seeded by `seed`, else by the batch."""
    vocab = SHAPES[shape][1]["vocab_size"]
    g = torch.Generator().manual_seed(batch if seed is None else seed)
    return torch.randint(1, vocab, (batch, length), generator=g).to(DEVICE)


@functools.cache
def trace_for(shape: str, routing: str = "trace") -> Trace:
    """The routing a `trace` case replays, mapped onto the shape so:
    64 experts, top-8 (OLMoE): the embedded model's held-out routing as recorded, with what its gate predictor
    predicted (so the prefetch systems' gate predicts as it did on the trained model, not from the random router);
    64 experts, top-k < 8 (DeepSeek-V2-Lite): the same, each token's first k ids (router order: its top-k);
    other shapes: a synthetic trace with the embedded model's reuse, skew and cross-layer lift
    (benchmarks/synthetic.py), no gate. `oracle` and `oracle-q0.8` routings: the same routing with the oracle's
    gate arrays (oracle.py)."""
    q = parse_oracle(routing)
    if q is not None:
        return oracle(trace_for(shape), q)
    experts, k = routing_shape(shape)
    if experts == 64 and k <= 8:
        demo = Trace.load(DEMO_TRACE)
        return Trace(
            demo.ids[:, :, :k],
            demo.num_experts,
            starts=demo.starts,
            gate_ids=demo.gate_ids,
            gate_probs=demo.gate_probs,
        )
    return synthetic(experts, k, layers=6, tokens=4096)


def build(kind: str, shape: str, cache: int | str) -> torch.nn.Module:
    """A fresh model of `kind` (a system, or the latency suite's `model_kind`), the same weights every time: one at
    a time in memory. The last model is freed first: transformers models hold reference cycles, and on the
    Qwen3-30B-A3B shape a run was killed for host memory: 57 GB of host experts waiting for the cycle collector
    beside the seed's 57 GB of pinned ones exceed the GPU host's 125 GB. The seed's experts are pinned by torch's
    caching host allocator, which keeps freed blocks (72 GB for Qwen3's 57 GB: it rounds to powers of two) until
    told to let go: the next Qwen3 case then found 50 of the 54 GiB it pins (docs/decisions.md#pinned-in-place)."""
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()  # torch has no public name for it (2.11)
    model = random_model(shape, DTYPE, DEVICE)
    if kind == "unmodified":
        return model
    if kind == "accelerate":
        return accelerate_offload.install(model, DEVICE)
    if kind == "seed":
        return seed_lru.install(model, cache, DEVICE)
    hybrid = kind.endswith(HYBRID)  # the CPU computes some misses; every other system: none
    base, fmt = split_format(kind.removesuffix(HYBRID))
    return asyncmoe.compile(
        model, cache=cache, device=DEVICE, prefetch=base.endswith("prefetch"), quantize=fmt,
        hybrid=hybrid if cache else None,
    )  # fmt: skip


class ChunkedPrefill(asyncmoe.Decoder):
    """The seed raises when a call routes to more distinct experts than it has slots. Its user caps the tokens per
    call (vLLM's --max-num-batched-tokens) at the most that can never overflow, `seed_chunk`, so the prompt goes in
    chunks of that many tokens per sequence."""

    def __init__(self, model, batch_size: int, max_length: int, chunk: int | None, **kwargs):
        super().__init__(model, batch_size, max_length, **kwargs)
        self.chunk = chunk

    def _forward(self, ids, model=None):
        chunk = self.chunk or ids.shape[1]
        for t in range(0, ids.shape[1], chunk):
            logits = super()._forward(ids[:, t : t + chunk], model)
        return logits


def seed_chunk(shape: str, batch: int, cache: int) -> int | None:
    """Tokens per sequence the seed takes in one call: cache // (batch * top-k), so that no call can route to
    more experts than slots, at least 1 (fewer slots than batch * top-k: it raises in decode too); None, the whole
    prompt at once, when every expert has a slot."""
    experts, k = routing_shape(shape)
    return None if cache >= experts else max(1, cache // (batch * k))


def decoder_for(system: str, shape: str, batch: int, cache: int):
    """What a system decodes with: `asyncmoe.Decoder`, or for the seed one that takes the prompt in chunks."""
    return (
        functools.partial(ChunkedPrefill, chunk=seed_chunk(shape, batch, cache))
        if system == "seed"
        else asyncmoe.Decoder
    )


def h2d_bandwidths(
    devices: list[int], nbytes: int = 512 * 2**20, reps: int = 10
) -> dict[int, float]:
    """GB/s of a pinned host -> GPU copy_ (the copy engine) on each of `devices`, median of `reps`. Every copy
    is queued before any is waited for, so with several devices their copies are in flight together."""
    src = {d: torch.empty(nbytes, dtype=torch.uint8).pin_memory() for d in devices}
    dst = {d: torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices}
    events = {d: [] for d in devices}
    for _ in range(reps + 2):
        for d in devices:
            with torch.cuda.device(d):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst[d].copy_(src[d], non_blocking=True)
                b.record()
                events[d].append((a, b))
    for d in devices:
        torch.cuda.synchronize(d)
    return {
        d: nbytes / 1e9 / (statistics.median(a.elapsed_time(b) for a, b in events[d][2:]) / 1e3)
        for d in devices
    }


def h2d_bandwidth() -> float:
    """GB/s of a pinned 512 MB host -> GPU copy_ on the current device, median of 10."""
    device = torch.cuda.current_device()
    return h2d_bandwidths([device])[device]


def cuda_ms(fn, reps: int) -> float:
    """Median ms of `fn()` on the current stream by CUDA events, after one untimed call (compiles, warms caches)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gpu_events(prof) -> list[dict]:
    """A torch profiler's GPU kernels, copies and memsets, each as name, category, stream, start and end (us),
    sorted by start."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = [
        {
            "name": e["name"],
            "cat": e["cat"],
            "stream": e["args"].get("stream"),
            "start": e["ts"],
            "end": e["ts"] + e["dur"],
        }
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(gpu, key=lambda e: e["start"])


def belady_hit_rate(trace: Trace, batch: int, cache: int, routed: int, steps: int) -> float:
    """The Belady bound's hit rate over a run's last `steps` decode steps of `batch` tokens each, the run having
    replayed the trace's first `routed` tokens (wrapping): the tokens before those steps warm the bound's cache, as
    they warmed the run's."""
    ids = trace.ids[np.arange(routed) % trace.tokens]  # [routed, L, k]
    warm, last = ids[: routed - steps * batch], ids[routed - steps * batch :]
    last = last.reshape(steps, batch, trace.layers, trace.top_k).transpose(0, 2, 1, 3)
    last = last.reshape(steps, trace.layers, batch * trace.top_k)
    misses = lookups = 0
    for layer in range(trace.layers):
        rows = [
            *(list(r) + [r[0]] * (batch - 1) * trace.top_k for r in warm[:, layer]),
            *last[:, layer],
        ]
        misses += belady_misses(np.array(rows), cache, from_row=len(warm))
        lookups += sum(len(set(r)) for r in last[:, layer].tolist())
    return 1 - misses / lookups


def belady_misses_per_step(trace: Trace, batch: int, cache: int) -> float:
    """The fewest expert copies per decode step and MoE layer any `cache`-slot cache makes on the
    replayed trace: a step routes `batch` consecutive trace tokens (`Replay`), so their experts form
    one request."""
    k, steps = trace.top_k, trace.tokens // batch
    ids = trace.ids[: steps * batch].reshape(steps, batch, trace.layers, k)  # [steps, B, L, k]
    step_ids = ids.transpose(0, 2, 1, 3).reshape(steps, trace.layers, batch * k)
    return (
        sum(belady_misses(step_ids[:, layer], cache) for layer in range(trace.layers))
        / trace.layers
        / steps
    )
