"""The latency suite: asyncmoe against the alternatives, same model, same prompt, side by side.

    pytest benchmarks/                                                    # CPU (CI): the smoke
    profile
    pytest benchmarks/test_latency.py --benchmark-only --profile full-1   # GPU: one run of the full
    profile
    python benchmarks/report.py --profile full-1                          # the same, with its table
    and plots

Profiles (`--profile`; benchmarks/README.md lists the full profile's cases, what each answers and
takes): `smoke` the tiny shape, every system, a few steps (the only profile on the CPU); `quick`
(`--quick`) the OLMoE shape, batch 1, trace routing, 25% of the experts cached and all of them, ~150
s on the H200; `full-1`, `full-2`, `full-3` the full profile, one run of under 10 minutes each;
`full` all three in one process (the default on a GPU); `link` (`link-fp8`: fp8 experts) oracle and
noisy gate arrays; `formats-1`, `formats-2` quantized experts against bf16; `cpu` every routed expert
on the host's CPU; `hybrid` the GPU cache's misses split with the CPU, beside GPU-only and all-CPU.

Systems: `unmodified` the transformers model fully resident (CUDA graph on the GPU); `accelerate`
experts offloaded to the CPU by accelerate's hooks (GPU only); `seed` a host-side LRU of GPU slots
(benchmarks/baselines/seed_lru.py, eager); `asyncmoe-eager`; `asyncmoe-graph` and
`asyncmoe-graph-prefetch` (GPU only; the latter is what `asyncmoe.compile` gives by default); an
asyncmoe system with a format's suffix (`asyncmoe-graph-prefetch-fp8`) quantizes its experts so
(`quantize=`); `asyncmoe-graph-cpu` has the CPU compute every routed expert (`cache=0`); a system
ending in `-hybrid` has it compute some of the cache's misses (`hybrid=True`; every other cached
system runs with `hybrid=False`). Each decode case times greedy steps after the same prompt (prefill excluded); each
prefill case one prompt. `extra_info` holds tokens/s, hit rate, prefetch recall, bytes moved per
token, `setup_s`, the seconds the case's model took to build and install (near 0 where the last
case's model was reused: `make`), and `wall_s`, the whole case's. In fp32 (the CPU) every system's
tokens must equal the unmodified model's; in bf16 the agreement is recorded, not asserted (logits
are close, not bit-equal, so a near-tie may go either way).

Routing: `router` (the random-weight model's own router, widened so tokens spread; smoke profile
only) or `trace` (every system routes by a recorded trace through the same pre-hook,
`replay_routing`: the embedded model's held-out routing, benchmarks/traces/demo_val.npz, MoE layer i
by trace layer i mod 6, or a synthetic trace with its statistics where the shape's experts differ:
`harness.trace_for`). For trace cases `extra_info` also holds the Belady floor: the fewest expert
copies per token any cache of that size must make.
"""

from __future__ import annotations

import functools
import gc
import itertools
import statistics
import time

import pytest
import torch

import asyncmoe
from asyncmoe.integrations.replay import replay_routing, rewind_replay
from asyncmoe.integrations.transformers import PROVIDER, find_experts
from asyncmoe.providers import CachedProvider

from baselines import accelerate_offload, seed_lru
from harness import (
    CUDA,
    DEVICE,
    DTYPE,
    FORMATS,
    HYBRID,
    PROMPT,
    belady_misses_per_step,
    build,
    decoder_for,
    h2d_bandwidth,
    prompt,
    split_format,
    trace_for,
)
from shapes import dense_experts, routing_shape

GPU_ONLY = {"accelerate", "asyncmoe-graph", "asyncmoe-graph-prefetch"}

# A profile is groups of cases: (shapes, routings, batches `b8` or prompts `prompt2048`, {system:
# cache fractions}). A fraction of a layer's experts is cached in GPU slots (`slots`); 1.0 holds
# them all, the unmodified model's.
ACCELERATE_AT = 0.25  # accelerate keeps every expert on the CPU whatever the cache: one run per case, filed here
RESIDENT = {"unmodified": [1.0]}
EVERY_B1 = {
    **RESIDENT,
    "accelerate": [ACCELERATE_AT],
    "seed": [0.25],
    "asyncmoe-eager": [0.25],
    "asyncmoe-graph": [0.25, 1.0],
    "asyncmoe-graph-prefetch": [0.25],
}
EVERY_PROMPT = {
    **RESIDENT,
    "accelerate": [ACCELERATE_AT],
    "seed": [0.25],
    "asyncmoe-eager": [0.25, 1.0],
}

# The full profile (benchmarks/README.md says why these cases): two cache sizes with distinct slot
# counts on every shape (12.5% of Mixtral's 8 experts is its top-2, as 25% is); above batch 1 the
# seed raises below min(E, batch * top-k) slots, and accelerate's step is its batch-1 step (it
# copies every expert at every step).
CACHES = [0.25, 0.5]
BATCHED = {**RESIDENT, "asyncmoe-graph-prefetch": CACHES}
B1 = {
    **RESIDENT,
    "accelerate": [ACCELERATE_AT],
    "seed": [0.25],
    "asyncmoe-graph": CACHES,
    "asyncmoe-graph-prefetch": CACHES,
}
PROMPT_2048 = {**RESIDENT, "accelerate": [ACCELERATE_AT], "asyncmoe-eager": CACHES}
# Qwen3 and Mixtral (57 and 68 GB of experts): accelerate's build and steps alone take 150-190 s of
# a run; their synthetic traces record no gate, so prefetch has nothing to predict from and no
# prefetch-off rows either
B1_LARGE = {**RESIDENT, "seed": [0.25], "asyncmoe-graph-prefetch": CACHES}
PROMPT_LARGE = {**RESIDENT, "asyncmoe-eager": CACHES}
SHAPES_1 = ["olmoe-1b-7b", "deepseek-v2-lite"]
FULL_RUNS = {  # each shape in one run: its rows compare within one process, and each model is built once
    "full-1": [
        (SHAPES_1, ["trace"], ["b1"], B1),
        (SHAPES_1, ["trace"], ["b8", "b32"], BATCHED),
        (SHAPES_1, ["trace"], ["prompt2048"], PROMPT_2048),
        (["olmoe-1b-7b"], ["trace"], ["prompt2048"], {"seed": [0.25]}),
    ],
    "full-2": [
        (["qwen3-30b-a3b"], ["trace"], ["b1"], B1_LARGE),
        (["qwen3-30b-a3b"], ["trace"], ["b8", "b32"], BATCHED),
        (["qwen3-30b-a3b"], ["trace"], ["prompt2048"], PROMPT_LARGE),
    ],
    "full-3": [
        (["mixtral-8x7b-24l"], ["trace"], ["b1"], B1_LARGE),
        (["mixtral-8x7b-24l"], ["trace"], ["b8", "b32"], BATCHED),
        (["mixtral-8x7b-24l"], ["trace"], ["prompt2048"], PROMPT_LARGE),
    ],
}


# Overlap apart from prediction (oracle.py): the shapes whose trace records a gate, every prefetch's
# nominations right (`oracle`) or right with probability q, against the recorded gate and no
# prefetch, in one run. The gate arrays change only what prefetch nominates: the resident model and
# the graph without prefetch run once a shape. The random router too, which nothing predicts: there
# prefetch must cost nothing. `link` in bf16, `link-fp8` with fp8 experts at the same 16 of 64
# slots, beside the fp8 model fully resident (its compute).
def link(suffix: str = "") -> list[tuple]:
    graph, prefetch = f"asyncmoe-graph{suffix}", f"asyncmoe-graph-prefetch{suffix}"
    return [
        (
            SHAPES_1,
            ["trace"],
            ["b1"],
            {**RESIDENT, graph: [0.25, 1.0] if suffix else [0.25], prefetch: [0.25]},
        ),
        (
            SHAPES_1,
            ["oracle", "oracle-q0.9", "oracle-q0.8", "oracle-q0.7"],
            ["b1"],
            {prefetch: [0.25]},
        ),
        (SHAPES_1, ["router"], ["b1"], {graph: [0.25], prefetch: [0.25]}),
    ]


# Quantized experts against bf16, in two runs: batch-1 decode with every format given the GPU memory
# of 16 of 64 bf16 slots (`mem0.25`), and each fully resident; a 2048-token prompt in fp8 and bf16
# at the same 16 slots, and a GPT-OSS-20B-shaped model in MXFP4 (the format it ships in) at 8 of its
# 32 experts beside it unmodified in bf16
MEM = "mem0.25"
FORMAT_RUNS = {
    "formats-1": [
        (
            SHAPES_1,
            ["trace"],
            ["b1"],
            {
                **RESIDENT,
                "asyncmoe-graph-prefetch": [0.25],
                **{f"asyncmoe-graph-prefetch-{f}": [MEM] for f in FORMATS},
                **{f"asyncmoe-graph-{f}": [1.0] for f in FORMATS},
            },
        )
    ],
    "formats-2": [
        (
            SHAPES_1,
            ["trace"],
            ["prompt2048"],
            {**RESIDENT, "asyncmoe-eager": [0.25], "asyncmoe-eager-fp8": [0.25]},
        ),
        (["gpt-oss-20b"], ["trace"], ["b1"], {**RESIDENT, "asyncmoe-graph-prefetch-mxfp4": [0.25]}),
    ],
}
# The host's CPU as the executor of every routed expert (`cache=0`, the llama.cpp --cpu-moe
# strategy) against GPU-only at a quarter of the experts cached and fully resident, batch-1 decode
CPU = "asyncmoe-graph-cpu"
CPU_RUNS = [
    (SHAPES_1, ["trace"], ["b1"], {**RESIDENT, "asyncmoe-graph-prefetch": [0.25], CPU: [0.0]}),
]
# Hybrid execution: the same cases with the CPU computing some of the GPU cache's misses
HYBRID_RUNS = [
    (
        SHAPES_1,
        ["trace"],
        ["b1"],
        {
            **RESIDENT,
            "asyncmoe-graph-prefetch": [0.25],
            "asyncmoe-graph-prefetch" + HYBRID: [0.25],
            CPU: [0.0],
        },
    ),
]
# decode (steps, rounds) by batch: above batch 1 a step copies most of each layer's experts (0.1-1.1
# s a step here)
FULL_TIMING = {1: (32, 5), 8: (8, 3), 32: (8, 3)}


def size_name(prefill: bool, n: int) -> str:
    """A case's batch or prompt as ids and profiles name it: `b8`, `prompt512` (`parse_size` reads
    it)."""
    return f"prompt{n}" if prefill else f"b{n}"


def parse_size(size: str) -> tuple[bool, int]:
    """`b8` or `prompt512` (`size_name`): (whether a prompt, the batch or prompt length)."""
    is_prompt = size.startswith("prompt")
    return is_prompt, int(size.removeprefix("prompt") if is_prompt else size.removeprefix("b"))


def expand(groups: list[tuple], timing: dict[int, tuple[int, int]], prompt_rounds: int) -> dict:
    """A profile: its decode and prefill cases, (shape, routing, system, cache fraction, batch or
    prompt length), and how many steps and rounds they time."""
    decode, prefill = [], []
    for shapes, routings, sizes, systems in groups:
        for shape, routing, size in itertools.product(shapes, routings, sizes):
            is_prompt, n = parse_size(size)
            cases = [
                (shape, routing, system, f, n)
                for system, fractions in systems.items()
                for f in fractions
            ]
            (prefill if is_prompt else decode).extend(cases)
    return {"decode": decode, "prefill": prefill, "timing": timing, "prompt_rounds": prompt_rounds}


PROFILES = {
    "smoke": expand(
        [
            (["tiny"], ["router", "trace"], ["b1"], EVERY_B1),
            (["tiny"], ["router", "trace"], ["prompt32"], EVERY_PROMPT),
            (["tiny"], ["oracle-q0.8"], ["b1"], {**RESIDENT, "asyncmoe-eager": [0.25]}),
            (
                ["tiny"],
                ["trace"],
                ["b1"],
                {"asyncmoe-eager-fp8": [MEM], "asyncmoe-eager-mxfp4": [1.0]},
            ),
            (["tiny"], ["trace"], ["prompt32"], {"asyncmoe-eager-int4": [0.25]}),
            (["tiny"], ["trace"], ["b1"], {CPU: [0.0], f"{CPU}-int4": [0.0]}),
            (["tiny"], ["trace"], ["b1"], {"asyncmoe-eager" + HYBRID: [0.25]}),
        ],
        {1: (4, 2)},
        2,
    ),
    "quick": expand(
        [
            (["olmoe-1b-7b"], ["trace"], ["b1"], EVERY_B1),
            (["olmoe-1b-7b"], ["trace"], ["prompt512"], EVERY_PROMPT),
        ],
        {1: (32, 5)},
        5,
    ),
    **{name: expand(groups, FULL_TIMING, 5) for name, groups in FULL_RUNS.items()},
    **{name: expand(groups, {1: (32, 5)}, 3) for name, groups in FORMAT_RUNS.items()},
    "full": expand([group for groups in FULL_RUNS.values() for group in groups], FULL_TIMING, 5),
    "cpu": expand(CPU_RUNS, {1: (32, 5)}, 3),
    "hybrid": expand(HYBRID_RUNS, {1: (32, 5)}, 3),
    "link": expand(link(), FULL_TIMING, 5),
    "link-fp8": expand(link("-fp8"), FULL_TIMING, 5),
}


def profile(config) -> dict:
    """The profile `--profile` (or `--quick`) names; without either, `full` on a GPU and `smoke` on
    the CPU."""
    name = config.getoption("--profile")
    if config.getoption("--quick"):
        if name not in (None, "quick"):
            raise pytest.UsageError(
                f"--quick is --profile quick: drop one of --quick and --profile {name}"
            )
        name = "quick"
    name = name or ("full" if CUDA else "smoke")
    if name not in PROFILES:
        raise pytest.UsageError(f"--profile {name}: no such profile; one of {', '.join(PROFILES)}")
    if name != "smoke" and not CUDA:
        raise pytest.UsageError(
            f"--profile {name} needs a CUDA GPU; on the CPU run the smoke profile (no --profile)"
        )
    return PROFILES[name]


def decode_timing(p: dict, system: str, batch: int) -> tuple[int, int]:
    """(steps, rounds) a decode case times: the profile's at its batch. Accelerate moves every
    expert over PCIe from pageable memory at every step, seconds a token and the same copies each
    step: one step, two rounds."""
    return (1, 2) if system == "accelerate" else p["timing"][batch]


def prompt_rounds(p: dict, system: str) -> int:
    """Timed rounds of a prefill case. The seed takes the prompt in calls of `seed_chunk` tokens
    (1024 calls for 2048 tokens at 16 of 64 slots, top-8: ~72 s a round): one; accelerate's prompt
    copies every expert once: two."""
    return {"seed": 1, "accelerate": 2}.get(system, p["prompt_rounds"])


def slots(shape: str, fraction: float | str) -> int:
    """Slots per layer of a cache `fraction` of the experts; for `mem<f>`, the bf16 slots whose
    memory it gets."""
    experts, k = routing_shape(shape)
    f = float(fraction.removeprefix("mem")) if isinstance(fraction, str) else fraction
    return 0 if f == 0 else max(k, round(f * experts))  # 0: every routed expert on the CPU


def cache_arg(shape: str, fraction: float | str) -> int | str:
    """`asyncmoe.compile`'s cache for a case: slots per layer, or for `mem<f>` the GPU-memory budget
    of that fraction of the experts in bf16 (`cache="...B"`), which a quantized format fills with
    more slots."""
    if not isinstance(fraction, str):
        return slots(shape, fraction)
    layers, expert_bytes = dense_experts(shape)
    return f"{slots(shape, fraction) * expert_bytes * layers}B"


def case_id(case: tuple, prefill: bool = False) -> str:
    """The case's pytest id: `olmoe-1b-7b-trace-seed-cache0.25-b1` (a decode case), `...-prompt512`
    (prefill), `...-asyncmoe-graph-prefetch-fp8-mem0.25-b1` (a quantized system given the memory of
    25% in bf16)."""
    shape, routing, system, fraction, size = case
    cache = fraction if isinstance(fraction, str) else f"cache{fraction:g}"
    return "-".join([shape, routing, system, cache, size_name(prefill, size)])


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = profile(metafunc.config)["decode"]
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])
    if "prefill_case" in metafunc.fixturenames:
        cases = profile(metafunc.config)["prefill"]
        metafunc.parametrize("prefill_case", cases, ids=[case_id(c, prefill=True) for c in cases])


def seed_raises(shape: str, batch: int, cache: int) -> bool:
    """Whether a decode step of `batch` tokens can route to more distinct experts than the seed's
    slots: it raises there, as the original does, so no profile holds such a case."""
    experts, k = routing_shape(shape)
    return cache < min(experts, batch * k)


def model_key(case: tuple) -> tuple:
    """What a case's model is built from: (kind, shape, routing, cache: slots or budget). asyncmoe's
    eager and graph systems run one model; the unmodified model and accelerate have no cache. Cases
    of one key share a build (`make`) and run one after another (conftest.py orders them so)."""
    shape, routing, system, fraction, _ = case
    kind = model_kind(system)
    return (
        kind,
        shape,
        routing,
        0 if kind in ("unmodified", "accelerate") else cache_arg(shape, fraction),
    )


def model_kind(system: str) -> str:
    """What a system's model is built as: asyncmoe's eager and graph systems run one model (per
    format)."""
    base, fmt = split_format(system.removesuffix(HYBRID))
    kind = (
        "asyncmoe-prefetch"
        if base.endswith("prefetch")
        else ("asyncmoe" if base.startswith("asyncmoe") else base)
    )
    kind = kind if fmt is None else f"{kind}-{fmt}"
    return kind + HYBRID if system.endswith(HYBRID) else kind


_held: dict[tuple, torch.nn.Module] = {}  # the one model in memory, by its key


def make(kind: str, shape: str, routing: str, cache: int | str) -> torch.nn.Module:
    """The model of `model_key`: built when the key changes, else the last one with its caches
    emptied and its trace rewound, so a case starts as on a fresh build. A build, mostly moving the
    experts into host memory, is 5-70 s at these shapes on the H200 (its `setup_s` in each
    result)."""
    key = (kind, shape, routing, cache)
    if key in _held:
        gc.collect()  # the last case's Decoder, graph and KV cache, before the peak memory is reset
        model = _held[key]
        for _, m in find_experts(model):
            provider = getattr(m, PROVIDER, None)
            if isinstance(provider, CachedProvider):
                provider.clear()
        if kind == "seed":
            seed_lru.clear(model)
        rewind_replay(model)
        return model
    _held.clear()  # one model in memory at a time
    model = build(kind, shape, cache)
    if routing != "router":
        replay_routing(model, trace_for(shape, routing), DEVICE)
    _held[key] = model
    return model


@functools.cache
def references(
    shape: str, routing: str, batches: tuple[tuple[int, int], ...], prompts: tuple[int, ...]
):
    """The unmodified model's greedy tokens after each (batch, steps)'s prompt, {batch: [B, PROMPT +
    steps + 1]}, and its first new token after each long prompt, {n: [1]}: one build for every case
    of (shape, routing) in this run (the unmodified system's cases then run on the same model)."""
    model = make("unmodified", shape, routing, 0)
    tokens, first = {}, {}
    for b, steps in batches:
        rewind_replay(model)
        dec = asyncmoe.Decoder(model, b, PROMPT + steps + 1, graph=False)
        tokens[b] = dec.generate(prompt(shape, b), steps + 1).tokens.cpu()
    for n in prompts:
        rewind_replay(model)
        first[n] = (
            asyncmoe.Decoder(model, 1, n + 1, graph=False)
            .prefill(prompt(shape, 1, n, seed=n))
            .cpu()
        )
    return tokens, first


def case_of(item) -> tuple[tuple, bool] | None:
    """A collected item's case and whether it is a prefill case; None for the suite's other
    tests."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for name, prefill in (("case", False), ("prefill_case", True)):
        if isinstance(
            params.get(name), tuple
        ):  # a profile without such cases parametrizes with pytest's NOTSET
            return params[name], prefill
    return None


def collected(request) -> list[tuple[tuple, bool]]:
    """This run's selected cases, in the order they run: (case, whether it is a prefill case)."""
    return [case for case in map(case_of, request.session.items) if case]


def reference(request, shape: str, routing: str) -> tuple[dict, dict]:
    """`references` for the batches and prompts of this run's selected cases of (shape, routing)."""
    timing = profile(request.config)["timing"]
    ours = [(c[4], prefill) for c, prefill in collected(request) if c[:2] == (shape, routing)]
    batches = sorted({(size, timing[size][0]) for size, prefill in ours if not prefill})
    prompts = sorted({size for size, prefill in ours if prefill})
    return references(shape, routing, tuple(batches), tuple(prompts))


def host_bytes(system: str, model: torch.nn.Module) -> int:
    """Host memory holding experts: pinned for asyncmoe and the seed, pageable for accelerate."""
    if system == "unmodified":
        return 0
    if system == "seed":
        return sum(
            t.numel() * t.element_size()
            for _, m in find_experts(model)
            for t in seed_lru.provider(m).host.values()
        )
    if system == "accelerate":
        return sum(
            p.numel() * p.element_size()
            for _, m in find_experts(model)
            for p in accelerate_offload.weights(m)
        )
    return (
        asyncmoe.stats(model).totals["host_bytes"]
        if any(hasattr(m, "asyncmoe") for _, m in find_experts(model))
        else 0
    )


def expert_bytes(model: torch.nn.Module) -> int:
    _, m = find_experts(model)[0]
    tensors = [t for t in vars(m).values() if isinstance(t, torch.Tensor)] + list(
        m.parameters(recurse=False)
    )
    return sum(t[0].numel() * t.element_size() for t in tensors)


def slots_of(model: torch.nn.Module, shape: str, fraction: float | str) -> int:
    """Slots per layer of the built model: what its budget gave (`mem<f>`), else the fraction's."""
    cached = [
        p
        for _, m in find_experts(model)
        if isinstance(p := getattr(m, PROVIDER, None), CachedProvider)
    ]
    return (
        cached[0].cache.num_slots
        if cached and isinstance(fraction, str)
        else slots(shape, fraction)
    )


def format_info(system: str, shape: str, fraction: float | str) -> dict:
    """A case's expert format, and for a budget (`mem<f>`) the bf16 slots whose GPU memory its slots
    were given."""
    fmt = split_format(system)[1]
    info = {"format": fmt or str(DTYPE).removeprefix("torch.")}
    if isinstance(fraction, str):
        info["memory_of_bf16_slots"] = slots(shape, fraction)
    return info


def warmup_rounds(system: str, prefill: bool) -> int:
    """Untimed rounds before a case's timed ones: one, except the seed's prompts. The seed's prompt
    is n / chunk forwards, so its first round is warm after the first of them: a warm-up round would
    only add minutes (token by token, 2048 tokens at ~99 ms per DeepSeek-V2-Lite step: ~200 s)."""
    return 0 if prefill and system == "seed" else 1


def test_decode(benchmark, case, request):
    shape, routing, system, fraction, batch = case
    if split_format(system)[0] in GPU_ONLY and not CUDA:
        pytest.skip(f"{system} needs a CUDA GPU")
    steps, rounds = decode_timing(profile(request.config), system, batch)
    experts, k = routing_shape(shape)
    want = reference(request, shape, routing)[0][batch][:, : PROMPT + steps + 1]
    start = time.perf_counter()
    model = make(*model_key(case))
    setup_s = time.perf_counter() - start
    cache = slots_of(model, shape, fraction)
    # the peak while it runs: the model is built whole on the GPU before the offloading systems move experts out
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    graph = CUDA and (system == "unmodified" or "graph" in system)
    # below min(E, batch*k) slots asyncmoe's captured step runs each layer's worst-case number of
    # waves
    dec = decoder_for(system, shape, batch, cache)(
        model, batch, PROMPT + steps + 1, graph=graph, waves=True
    )
    ids = prompt(shape, batch)
    cached = system.startswith("asyncmoe") and cache < experts
    sync = torch.cuda.synchronize if CUDA else (lambda: None)

    def setup():  # not timed: the prompt, and the counters (and the trace) start afresh
        rewind_replay(model)
        dec.prefill(ids)
        if cached:
            asyncmoe.stats(model, reset=True)
        if system == "seed":
            seed_lru.reset(model)
        sync()

    def decode():
        dec.decode(steps)
        sync()

    benchmark.pedantic(
        decode, setup=setup, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds(system, False)
    )
    tokens = dec.history[:, : PROMPT + steps + 1].cpu()
    agree = (tokens == want).all(0).cumprod(0).sum().item() - PROMPT
    info = dict(
        shape=shape,
        routing=routing,
        system=system,
        cache=cache,
        experts=experts,
        batch=batch,
        steps=steps,
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        dtype=str(DTYPE),
        **format_info(system, shape, fraction),
        ms_per_token=statistics.median(benchmark.stats.stats.data) * 1e3 / steps,
        tokens_agree=agree,
        setup_s=setup_s,
    )
    if CUDA:
        # the link measured right after each case: its floor and ratios use the link as it was
        # beside it
        info.update(h2d_GB_per_s=h2d_bandwidth(), peak_gpu_bytes=torch.cuda.max_memory_allocated())
    info["host_bytes"] = host_bytes(system, model)
    if cached:
        s = asyncmoe.stats(model)
        info.update(
            hit_rate=s.totals["hit_rate"],
            prefetch_recall=s.totals["prefetch_recall"],
            bytes_per_token=s.totals["bytes_h2d"] / steps,
            hit_rate_per_layer=[layer.hit_rate for layer in s.layers],
            prefetch_copy_ns=s.copy_ns,
            prefetch_window_ns=s.window_ns,
        )
        assert (
            s.totals["misses"] > 0 or cache >= batch * k
        )  # a cache smaller than one step's experts must miss
    if system == "seed":
        info["hit_rate"] = seed_lru.hit_rate(model)
    if cached and s.totals["cpu_experts"]:  # cache=0, or the hybrid's CPU took misses
        info.update(
            cpu_bytes_per_token=s.totals["cpu_bytes"] / steps,
            cpu_ms_per_token=s.totals["cpu_ns"] / 1e6 / steps,
            gpu_wait_ms_per_token=(s.totals["cpu_wait_ns"] or 0) / 1e6 / steps,
            cpu_GB_per_s=s.totals["cpu_alone_GB_per_s"],  # the hybrid's, at compile
        )
    if routing != "router" and 0 < cache < experts:
        info["belady_bytes_per_token"] = (
            belady_misses_per_step(trace_for(shape), batch, cache)
            * len(find_experts(model))
            * expert_bytes(model)
        )
    info["wall_s"] = time.perf_counter() - start  # the whole case, its build and warm-up included
    benchmark.extra_info.update(info)
    if (
        DTYPE == torch.float32 and split_format(system)[1] is None
    ):  # quantized weights: near, not equal
        assert agree == steps + 1, (
            f"{system}: tokens part from the unmodified model's after {agree}"
        )


def test_prefill(benchmark, prefill_case, request):
    """One prompt of `n` tokens. The seed cannot take more distinct experts than slots in one call,
    so it takes the prompt in chunks of `seed_chunk` tokens; everything else runs the prompt in one
    forward."""
    shape, routing, system, fraction, n = prefill_case
    if split_format(system)[0] in GPU_ONLY and not CUDA:
        pytest.skip(f"{system} needs a CUDA GPU")
    experts, k = routing_shape(shape)
    want = reference(request, shape, routing)[1][n]
    start = time.perf_counter()
    model = make(*model_key(prefill_case))
    setup_s = time.perf_counter() - start
    cache = slots_of(model, shape, fraction)
    dec = decoder_for(system, shape, 1, cache)(model, 1, n + 1, graph=False)
    ids = prompt(shape, 1, n, seed=n)
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    cached = system.startswith("asyncmoe") and cache < experts

    def setup():  # the counters start afresh: after the last round they hold one prefill's copies
        rewind_replay(model)
        if cached:
            asyncmoe.stats(model, reset=True)
        sync()

    def prefill():
        first = dec.prefill(ids)
        sync()
        return first

    rounds = prompt_rounds(profile(request.config), system)
    first = benchmark.pedantic(
        prefill, setup=setup, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds(system, True)
    )
    totals = asyncmoe.stats(model).totals if cached else None
    bytes_moved = totals and totals["bytes_h2d"]
    ms = statistics.median(benchmark.stats.stats.data) * 1e3
    benchmark.extra_info.update(
        shape=shape,
        routing=routing,
        system=system,
        cache=cache,
        experts=experts,
        prompt=n,
        ms_per_prefill=ms,
        tokens_per_s=n / ms * 1e3,
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        dtype=str(DTYPE),
        **format_info(system, shape, fraction),
        first_token_agrees=bool(torch.equal(first.cpu(), want)),
        setup_s=setup_s,
    )
    if system == "seed":
        benchmark.extra_info["tokens_per_call"] = dec.chunk or n
    if CUDA:
        benchmark.extra_info["h2d_GB_per_s"] = h2d_bandwidth()
    if cached:
        benchmark.extra_info["bytes_per_prefill"] = bytes_moved
        # the routed experts the slots lacked: what the prompt had to move, its floor's bytes
        benchmark.extra_info["bytes_to_cross"] = totals["miss_bytes"]
        if totals["cpu_experts"]:  # the hybrid's CPU took some of the prompt's experts
            benchmark.extra_info.update(
                cpu_bytes_per_prefill=totals["cpu_bytes"], cpu_GB_per_s=totals["cpu_alone_GB_per_s"]
            )
        # a prompt routes to more experts than the cache holds: they must cross
        assert bytes_moved + totals["cpu_bytes"] > 0
    benchmark.extra_info["wall_s"] = time.perf_counter() - start
    if DTYPE == torch.float32 and split_format(system)[1] is None:
        assert torch.equal(first.cpu(), want), (
            f"{system}: the first new token differs from the unmodified model's"
        )


@pytest.mark.parametrize("kind", ["asyncmoe-prefetch", "seed"])
def test_a_reused_model_starts_as_built(kind):
    """Cases of one `model_key` share a build: the second gets the same model, emptied and rewound,
    and its decode copies what the first's did (a warm cache would copy less)."""

    def run():
        model = make(kind, "tiny", "trace", 4)
        decoder_for(kind, "tiny", 1, 4)(model, 1, PROMPT + 9, graph=False).generate(
            prompt("tiny", 1), 8
        )
        if kind == "seed":
            return model, [
                (seed_lru.provider(m).hits, seed_lru.provider(m).misses)
                for _, m in find_experts(model)
            ]
        return model, [
            (layer.hits, layer.misses, layer.prefetched) for layer in asyncmoe.stats(model).layers
        ]

    (first, fresh), (second, reused) = run(), run()
    assert second is first
    assert reused == fresh and all(misses > 0 for _, misses, *_ in fresh)


def test_cases_of_one_model_run_one_after_another(request):
    """conftest.py orders the collected cases so that each `model_key`'s run together: `make` builds
    each once."""
    keys = [model_key(case) for case, _ in collected(request)]
    if len(set(keys)) == len(keys):
        pytest.skip(
            "no two selected cases share a model (run it with the suite's cases, not alone)"
        )
    runs = [key for i, key in enumerate(keys) if i == 0 or keys[i - 1] != key]
    assert len(runs) == len(set(runs))
