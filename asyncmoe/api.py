"""The public entry points: `compile`, `from_pretrained`, `stats`, `record`, `demo_model_path`."""

from __future__ import annotations

import os
import pathlib

import torch
from torch import nn

from .cache.policies import DEFAULT_POLICY
from .integrations.install import install
from .integrations.loading import load
from .integrations.record import TraceRecorder
from .integrations.transformers import PROVIDER, check_model, find_experts
from .layer_stats import Stats, cpu_layer_stats, read_stats
from .prefetch import Prefetch
from .providers import CachedProvider, CpuProvider, ResidentProvider
from .settings import AutoCache, HybridCosts, Settings
from .trace import Trace


def compile(
    model: nn.Module,
    cache: int | str | AutoCache = 16,
    policy: str = DEFAULT_POLICY,
    device: torch.device | str | None = None,
    prefetch: bool | Prefetch | None = None,
    replay: Trace | str | os.PathLike | None = None,
    time_stalls: bool = False,
    quantize: str | None = None,
    cpu_threads: int | None = None,
    hybrid: bool | None = None,
    hybrid_costs: HybridCosts | None = None,
) -> nn.Module:
    """Prepare a transformers MoE model in place: experts to (pinned) host memory, `cache` GPU slots
    per MoE layer.

    `cache` is slots per MoE layer, or a GPU-memory budget for all layers' slots together ("6GiB",
    "6GB", "512MiB"), which gives every layer the slots that fit for the experts' format, or "auto":
    the slots that fit in the GPU memory free now, leaving a share for the KV cache and activations
    (`asyncmoe.AutoCache(max_length=, batch_size=)` leaves what a Decoder of that size needs
    instead). `cache >= num_experts` keeps every expert resident and runs the model's own
    implementation. `cache=0` computes every routed expert on the host's CPU from the host store,
    with `cpu_threads` threads (default: all but one core, two for a model on CUDA; the models of a
    process share them); the rest of the model runs on `device` (on a CUDA device, inside the same
    graphs: the GPU sends each layer's pairs to a CPU worker through pinned memory and waits for its
    outputs). `hybrid`: a cached
    layer's misses split between the link (copied into slots) and the host's CPU (computed from the
    host store, while the GPU copies and computes the rest), by a cost model timed on this host at
    compile, or `hybrid_costs` (an `asyncmoe.HybridCosts`, for reproducible runs); the default, None,
    turns it on where the model runs on CUDA and the CPU would take any of a decode call's misses,
    and off, with a warning, where this host is too noisy to time them; compile prints the costs and
    the misses' predicted time a decode token. Calls of more distinct experts than slots (waves) stay
    on the GPU.
    `quantize="fp8"`: store the experts as block-wise fp8 (transformers' fine-grained FP8 layout,
    128x128 blocks), quantized layer by layer on the way to host memory: a miss copies about half of
    bf16's bytes and the same GPU memory holds twice the experts. None keeps the model's dtype (or
    its fp8 experts). `device` is where the model runs (default: where its experts are now); a model
    loaded on the CPU can be compiled straight onto the GPU without its experts ever going there.
    `policy`: eviction policy, one of "markov" (the default: LFRU behind a prediction of the next
    call from the experts that followed the current ones; an [E, E] table a layer), "lfru", "lru",
    "lfu", "fifo". `prefetch`: predict the next layers' experts and copy them on a side stream while
    a layer computes (True: `Prefetch()`, the gate predictor for the next layer; a `Prefetch` to
    choose). The default, None, turns it on where the model runs on a CUDA device and off elsewhere:
    on the CPU nothing runs beside the copies, so prefetch can only cost. `replay`: a routing trace
    (or its .npz path) to route by instead of the routers, whose work still runs: realistic routing
    for random-weight models of real shapes (docs/traces.md). `time_stalls`: time, on the GPU clock,
    how long each layer waits for its prefetch and for its own decision and copies (`stats` reports
    them); three one-thread kernels per layer call, so off by default
    (docs/decisions.md#stall-timing-off).
    Returns the same model.
    """
    check_model(model)
    if isinstance(replay, (str, os.PathLike)):
        replay = Trace.load(replay, what="replay=")
    settings = Settings(
        cache, policy, device, prefetch, replay, time_stalls, quantize, cpu_threads, hybrid,
        hybrid_costs,
    )  # fmt: skip
    return install(model, settings)


def record(model: nn.Module, gate: bool = False) -> TraceRecorder:
    """`with asyncmoe.record(model) as r: model.generate(...)`, then `r.trace.save("out.npz")`
    (eager forwards only). `gate=True` also records the gate predictor's nominations, which a replay
    of the trace feeds to it."""
    check_model(model)
    return TraceRecorder(model, gate)


def from_pretrained(
    path,
    cache: int | str | AutoCache = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    policy: str = DEFAULT_POLICY,
    prefetch: bool | Prefetch | None = None,
    time_stalls: bool = False,
    quantize: str | None = None,
    cpu_threads: int | None = None,
    hybrid: bool | None = None,
    hybrid_costs: HybridCosts | None = None,
    **kwargs,
) -> nn.Module:
    """Load a MoE checkpoint (local directory or hub id) straight into an asyncmoe model.

    Non-expert weights go to `device` (default: cuda when available), every expert to pinned host
    memory; the full set of experts is never on the GPU. Checkpoint layouts are transformers' own
    (per-expert tensors fused on load by its conversion rules, or already fused, sharded or not);
    `kwargs` go to `AutoModelForCausalLM.from_pretrained`; the rest is as in `compile`. A checkpoint
    with fine-grained fp8 experts (`quantization_config.quant_method == "fp8"`, as DeepSeek-V3/R1
    and the Qwen3 FP8 releases ship) keeps them fp8 from the safetensors files to the slots; its
    other weights are dequantized to `dtype`. `quantize="fp8"` quantizes a bf16/fp16 checkpoint's
    experts on the way in; `quantize="dequantize"` loads an fp8 checkpoint's experts in `dtype`
    instead. Under `torchrun`, `distributed_config=asyncmoe.expert_parallel()` has transformers
    split every MoE layer's experts over the ranks: each rank loads only its own experts, and caches
    them (`cache` slots of its own).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(
        cache, policy, device, prefetch, None, time_stalls, quantize, cpu_threads, hybrid,
        hybrid_costs,
    )  # fmt: skip
    return load(
        path,
        settings,
        dtype,
        **kwargs,
    )


def stats(model: nn.Module, reset: bool = False, group=None) -> Stats:
    """Per-layer hits, misses, evictions and bytes moved, read from the device now (one sync). Under
    expert parallelism each rank counts its own experts; `group` (a torch.distributed process group,
    such as `torch.distributed.group.WORLD`) sums them over its ranks, every one of which must
    call."""
    check_model(model)
    providers = [
        (name, getattr(m, PROVIDER)) for name, m in find_experts(model) if hasattr(m, PROVIDER)
    ]
    if not providers:
        raise ValueError(
            "this model is not asyncmoe-compiled: call asyncmoe.compile(model, cache=...) first"
        )
    caches = [(name, p.cache) for name, p in providers if isinstance(p, CachedProvider)]
    resident = sum(isinstance(p, ResidentProvider) for _, p in providers)
    cpu = [(name, p) for name, p in providers if isinstance(p, CpuProvider)]
    if cpu:  # cache=0: every MoE layer on the CPU
        return Stats(cpu_layer_stats(cpu, reset), resident)
    hybrids = [p.hybrid for _, p in providers if isinstance(p, CachedProvider)]
    return read_stats(caches, resident, reset, group, hybrids)


def demo_model_path() -> pathlib.Path:
    """The small MoE model asyncmoe ships (OLMoE routing shape: 64 experts, top-8; trained on
    Python's stdlib).

    A transformers checkpoint directory:
    `AutoModelForCausalLM.from_pretrained(asyncmoe.demo_model_path())`. How it was made:
    scripts/train_demo_model.py and the `training.json` beside it.
    """
    path = pathlib.Path(__file__).parent / "data" / "demo_model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded demo model is missing from {path}: reinstall asyncmoe from a full "
            "checkout, "
            "or remake it with `python scripts/train_demo_model.py --out asyncmoe/data/demo_model`"
        )
    return path
