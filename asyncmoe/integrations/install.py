"""Installing asyncmoe into a transformers model: the checks that need the model, the slots (given,
from a budget, or what fits in free GPU memory), then the walk that gives every experts module its
provider."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils.logging import tqdm

from ..cache.host import block_bytes, check_host_memory, human_bytes
from ..compute.cpu.executor import CpuExecutor, CpuSettings
from ..compute.cpu.kernels import CpuExperts, PoolSizeError
from ..formats import FP8, QUANTIZE_METHODS, Format, Fp8, parse_quantize
from ..hybrid.calibrate import CalibrationError, calibrate, cost_tensor, decode_miss_ns, pays
from ..hybrid.ops import Hybrid
from ..prefetch.predictors import Prefetch
from ..providers import CachedProvider, CpuProvider, ExpertWeightProvider, ResidentProvider, link
from ..settings import AutoCache, HybridCosts, Settings, budget_text
from .offload import (
    CacheSpec,
    expert_size,
    host_store,
    host_tensors,
    offload,
    resident,
    stored_quantized,
)
from .replay import feed_replayed_gate, install_replay
from .transformers import (
    PROVIDER,
    expert_params,
    families_hint,
    find_experts,
    find_router,
    is_expert_parallel,
    looks_like_moe,
    num_experts,
    top_k_of,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(model: nn.Module, experts: list[tuple[str, nn.Module]]) -> None:
    method = quant_method(model)
    if method is not None and method != "fp8":
        raise ValueError(
            f"this model is quantized ({method}); asyncmoe keeps experts in "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            f" or in {', '.join(QUANTIZE_METHODS)}. Load it dequantized (dtype=torch.bfloat16 and "
            "the quantization "
            "method's dequantize option, or no quantization_config); asyncmoe.compile(model, "
            "quantize='fp8') then "
            "keeps "
            "its experts in fp8."
        )
    if not experts:
        moe = looks_like_moe(model)
        if moe:
            raise ValueError(
                f"{type(model).__name__} has MoE layers ({', '.join(moe)}) that do not use "
                "transformers' experts "
                "interface (@use_experts_implementation), so asyncmoe cannot cache them; "
                f"{families_hint()}."
            )
        raise ValueError(
            f"{type(model).__name__} has no MoE layer for asyncmoe to offload; {families_hint()}."
        )
    for name, m in experts:
        if isinstance(getattr(m, PROVIDER, None), ExpertWeightProvider):
            raise RuntimeError(
                f"{name} is already asyncmoe-compiled: call asyncmoe.compile once per model"
            )
        params = expert_params(m)
        E = num_experts(m)
        for pname, p in params.items():
            if p.dtype not in SUPPORTED_DTYPES and not stored_quantized(pname, params):
                raise TypeError(
                    f"{name}.{pname} is {p.dtype}; asyncmoe caches experts in "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}, or quantized with their "
                    "scales "
                    f"({', '.join(QUANTIZE_METHODS)}). Load the model in one of those dtypes."
                )
            if p.dim() == 0 or p.shape[0] != E:
                raise ValueError(
                    f"{name}.{pname} has shape {tuple(p.shape)}, not [num_experts={E}, ...]"
                )


def quant_method(model: nn.Module) -> str | None:
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is None:
        return None
    return getattr(quant, "quant_method", None) or (
        quant.get("quant_method") if isinstance(quant, dict) else str(quant)
    )


def _format(model: nn.Module, experts: list[tuple[str, nn.Module]], quantize) -> Format | None:
    """The experts' format: `quantize`'s, or fp8 where the model's experts already are (a
    fine-grained FP8 model)."""
    fmt = parse_quantize(quantize)
    stored = [p.dtype == FP8 for _, m in experts for p in expert_params(m).values()]
    if any(stored) and fmt is None:
        quant = getattr(model.config, "quantization_config", None)
        block = (
            quant.get("weight_block_size")
            if isinstance(quant, dict)
            else getattr(quant, "weight_block_size", None)
        )
        if block is None:
            raise ValueError(
                "this fp8 model has no weight_block_size in its quantization_config: asyncmoe "
                "keeps "
                "block-wise fp8 experts (transformers' fine-grained FP8)"
            )
        fmt = Fp8(tuple(block))
    return fmt


def _check_device(fmt: Format, device: torch.device) -> None:
    if (
        device.type == "cuda"
        and isinstance(fmt, Fp8)
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            "fp8 experts need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) "
            "for asyncmoe's fp8 "
            f"kernels; {torch.cuda.get_device_name(device)} is {major}.{minor}. Keep the experts "
            "in bf16 instead: "
            "quantize=None for a bf16 model, or for an fp8 checkpoint "
            "asyncmoe.from_pretrained(path, "
            "quantize='dequantize'); or quantize='int4', whose kernels run on any CUDA GPU (the "
            "CPU runs every "
            "format by dequantizing, device='cpu')."
        )


def _slots(
    settings: Settings, model: nn.Module, experts, fmt: Format | None, device: torch.device
) -> int:
    """Slots per MoE layer: `cache` itself, or the most that every layer gets within a budget
    (given, or what fits in free GPU memory for `cache="auto"`); at least top_k."""
    top_k = max(min(top_k_of(m.config) or 1, num_experts(m)) for _, m in experts)
    cache = settings.cache
    if cache == 0:  # the CPU computes every routed expert
        return 0
    if settings.slots is not None:
        if cache < top_k:
            raise ValueError(
                f"cache={cache} is below top_k={top_k}: every token needs its {top_k} experts "
                "resident at once; "
                f"use cache>={top_k}"
            )
        return cache
    sizes = [(num_experts(m), expert_size(m, fmt)) for _, m in experts]

    def need(slots: int) -> int:
        return sum(min(slots, E) * size for E, size in sizes)

    budget, why = settings.budget, ""
    # one slot dequantized: a call of more pairs a slot than the GEMV takes dequantizes a layer's
    # slots at once (compute/experts.py), room a Decoder's prompt needs
    dense = 0
    if settings.auto is not None:
        budget, why = auto_budget(settings.auto, model, experts, device)
        if fmt is not None and settings.auto.max_length is not None:  # the Decoder's room
            dense = max(expert_size(m, None) for _, m in experts)

    def room(slots: int) -> int:  # the slots, and one layer's dequantized for a prompt
        return need(slots) + max(min(slots, E) for E, _ in sizes) * dense

    slots = max((s for s in range(1, max(E for E, _ in sizes) + 1) if room(s) <= budget), default=0)
    if dense and slots:
        why += f", and {human_bytes(room(slots) - need(slots))} to dequantize one layer's slots"
    what = f"{len(sizes)} MoE layers, {fmt.name if fmt else 'dense'} experts of {human_bytes(sizes[0][1])}"
    if slots < top_k:
        raise ValueError(
            f"cache={cache!r} holds {slots} experts per MoE layer ({what}{why}), below "
            f"top_k={top_k}: every token "
            f"needs its {top_k} experts resident at once; the smallest budget that works is "
            f"cache={budget_text(need(top_k))!r}"
        )
    print(
        f"asyncmoe: cache={cache!r} gives {slots} slots per MoE layer ({what}; "
        f"{human_bytes(need(slots))} of slots"
        f"{why})"
    )
    return slots


def kv_cache_bytes(config, max_length: int, batch_size: int, itemsize: int) -> int:
    """A static KV cache's bytes: keys and values of every attention layer, `max_length` positions a
    sequence."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    k_dim = getattr(text, "qk_head_dim", None) or head_dim
    v_dim = getattr(text, "v_head_dim", None) or head_dim
    return text.num_hidden_layers * batch_size * max_length * kv_heads * (k_dim + v_dim) * itemsize


# cuBLAS workspaces, CUDA graphs' pools and Triton's launches, beside the activations
WORKSPACE = 512 * 2**20


def activation_bytes(config, max_length: int, batch_size: int, itemsize: int) -> int:
    """A generous bound on a prefill's peak activations: float32 logits over the vocabulary for
    every position, a few hidden-sized temporaries a token, each routed pair's expert intermediates,
    eager attention's scores."""
    text = config.get_text_config()
    tokens = batch_size * max_length
    k = top_k_of(text) or 1
    inner = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    per_token = 8 * text.hidden_size * itemsize + 3 * k * inner * itemsize + text.vocab_size * 4
    scores = batch_size * text.num_attention_heads * max_length**2 * 4
    eager = getattr(config, "_attn_implementation", None) in (None, "eager")
    return tokens * per_token + (scores if eager else 0) + WORKSPACE


def auto_budget(
    auto: AutoCache, model: nn.Module, experts, device: torch.device
) -> tuple[int, str]:
    """Bytes for the slots out of the GPU memory free now, once the model's other weights are on
    `device` and its experts off it; and the reason, for the message."""
    if device.type != "cuda":
        raise ValueError(
            "cache='auto' sizes the slots from the GPU memory free at compile time, but this "
            f"model runs on {device}: "
            "give slots per MoE layer (cache=16) or a budget (cache='6GiB'), or compile onto the "
            "GPU (device='cuda')"
        )
    free, _ = torch.cuda.mem_get_info(device)
    expert_ids = {id(p) for _, m in experts for p in expert_params(m).values()}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    arriving = sum(t.nbytes for t in tensors if id(t) not in expert_ids and t.device != device)
    leaving = sum(t.nbytes for t in tensors if id(t) in expert_ids and t.device == device)
    free += leaving - arriving
    if auto.max_length is None:
        budget = int(auto.share * free)
        return (
            budget,
            f": {auto.share:.0%} of the {human_bytes(free)} free on {device} once the other "
            "weights are there",
        )
    itemsize = next(iter(expert_params(experts[0][1]).values())).element_size()
    reserve = kv_cache_bytes(model.config, auto.max_length, auto.batch_size, itemsize)
    reserve += activation_bytes(model.config, auto.max_length, auto.batch_size, itemsize)
    why = (
        f": {human_bytes(free)} free on {device} once the other weights are there, less "
        f"{human_bytes(reserve)} for the KV cache and activations of max_length={auto.max_length}, "
        f"batch_size={auto.batch_size}"
    )
    return max(free - reserve, 0), why


def _device(device, experts: list[tuple[str, nn.Module]]) -> torch.device:
    """Where the model will run: `device`, or where its experts are now."""
    if device is None:
        device = next(iter(expert_params(experts[0][1]).values())).device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device={device!r} is not a torch device ({e}); use 'cuda', 'cuda:0' or 'cpu'"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}, but torch sees no CUDA GPU here "
                "(torch.cuda.is_available() is False): "
                "use device='cpu', or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: asyncmoe runs on 'cuda' or 'cpu'")
    return device


def _plan(prefetch, device: torch.device, expert_parallel: bool = False) -> Prefetch | None:
    """The prefetch settings: None turns it on where a CUDA side stream can copy beside the compute
    (and the experts are not split over ranks: the gate predictor scores every expert, each rank's
    cache holds its own)."""
    if expert_parallel and prefetch not in (None, False):
        raise ValueError(
            "prefetch under expert parallelism is not supported: the gate predictor scores all of "
            "a layer's "
            "experts, each rank caches only its own; pass prefetch=None or False"
        )
    if prefetch is None:
        prefetch = device.type == "cuda" and not expert_parallel
    if isinstance(prefetch, bool):
        return Prefetch() if prefetch else None
    return prefetch


def _own_config(model: nn.Module) -> None:
    """Give `model` a private copy of its config (sub-configs included), so that switching it to the
    "asyncmoe" implementation leaves other models built from the same config object
    (`from_config(cfg)` twice) as they were."""
    config = getattr(model, "config", None)
    if config is None:
        return
    memo: dict[int, object] = {}
    copy.deepcopy(config, memo)
    for module in model.modules():
        shared = getattr(module, "config", None)
        if shared is not None and id(shared) in memo:
            module.config = memo[id(shared)]


def _check_pinning(experts, device: torch.device) -> None:
    """Whether the host has the memory that pinning the experts of a model on CUDA takes."""
    if device.type == "cuda":
        total = sum(
            block_bytes([(p.shape, p.dtype) for p in expert_params(m).values()]) for _, m in experts
        )
        on_gpu = sum(
            p.numel() * p.element_size()
            for _, m in experts
            for p in expert_params(m).values()
            if p.is_cuda
        )
        # Experts already on the GPU are copied out before their memory is freed: all of it is new
        # host memory.
        check_host_memory(
            on_gpu, f"pinning the experts of {len(experts)} MoE layers ({human_bytes(total)})"
        )


def install(model: nn.Module, settings: Settings) -> nn.Module:
    """Give every experts module of `model` a provider and switch it to the `"asyncmoe"`
    implementation."""
    experts = find_experts(model)
    _check(model, experts)
    fmt = _format(model, experts, settings.quantize)
    device = _device(settings.device, experts)
    if fmt is not None and settings.cache != 0:  # cache=0: the CPU computes every format
        _check_device(fmt, device)
    parallel = any(is_expert_parallel(m) for _, m in experts)
    if parallel and settings.cache == 0:
        raise ValueError(
            "cache=0 under expert parallelism is not supported: each rank would compute its own "
            "experts on a CPU its ranks share; give each rank slots (cache=16 or a budget)"
        )
    if parallel and settings.replay is not None:
        raise ValueError(
            "replay routes by a trace's expert ids, but under expert parallelism each rank holds "
            "only its own "
            "experts: replay a trace on a model that is not expert-parallel"
        )
    prefetch = _plan(settings.prefetch, device, parallel)
    if settings.time_stalls and device.type != "cuda":
        raise ValueError(
            "time_stalls reads the GPU's clock, so it needs a CUDA device; this model runs on "
            f"{device}. "
            "Pass device='cuda', or leave time_stalls off (on the CPU nothing waits: there are no "
            "streams)."
        )
    num_slots = _slots(settings, model, experts, fmt, device)
    _check_threads(settings, num_slots, experts, device)
    _check_pinning(experts, device)
    _own_config(model)

    spec = CacheSpec(num_slots, settings.policy, device, settings.time_stalls, fmt)
    top_k = max((top_k_of(m.config) or 1) for _, m in experts)
    if num_slots == 0:
        _install_cpu(model, experts, spec, top_k, CpuSettings(threads=settings.cpu_threads))
        return _switch(model, experts, settings, device)
    if (settings.hybrid or settings.hybrid_costs) and parallel:
        raise ValueError(
            "hybrid under expert parallelism is not supported: the ranks would share one CPU; "
            "leave hybrid and hybrid_costs out"
        )
    # one for every linked layer (providers.link)
    pace = torch.zeros(3, dtype=torch.int64, device=device)
    cached = []
    for name, m in tqdm(
        experts, desc="asyncmoe: experts to host memory", unit="layer", disable=len(experts) < 2
    ):
        _refuse_asyncmoe_config(name, m)
        implementation = m.config._experts_implementation or "eager"
        if num_slots >= num_experts(m) and fmt is not None:
            provider = resident(m, fmt, device)
            provider.expert_parallel = is_expert_parallel(m)
        elif num_slots >= num_experts(m):
            fn = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, type(m).forward.__wrapped__)
            provider = ResidentProvider(implementation, fn)
            m.to(device)
        else:
            # before _offload takes the DTensors off the module
            parallel_here = is_expert_parallel(m)
            provider = CachedProvider(offload(m, spec, pace), find_router(model, name, m), fmt)
            provider.expert_parallel = parallel_here
            cached.append((m, provider))
        setattr(m, PROVIDER, provider)
    model.to(device)
    link([p for _, p in cached], prefetch, top_k)
    if not parallel:
        _install_hybrid(model, cached, spec, top_k, settings)
    return _switch(model, experts, settings, device)


def _check_threads(settings: Settings, num_slots: int, experts, device: torch.device) -> None:
    """Refuse `cpu_threads` where no CPU executor will run: every expert resident, or a cached
    model on the CPU without hybrid=True."""
    threads = settings.cpu_threads
    if threads is None or num_slots == 0:
        return
    if all(num_slots >= num_experts(m) for _, m in experts):
        raise ValueError(
            f"cpu_threads={threads} sets the threads of the CPU executor, and every MoE layer here "
            "keeps all its experts resident (cache >= num_experts): nothing runs on the CPU; "
            "leave cpu_threads out"
        )
    if settings.hybrid is None and device.type != "cuda":
        raise ValueError(
            f"cpu_threads={threads} sets the threads of the CPU executor, which a cached model on "
            "the CPU runs only with hybrid=True (hybrid's default turns it on for a model on "
            "CUDA): pass hybrid=True or cache=0, or leave cpu_threads out"
        )


def _install_hybrid(
    model: nn.Module, cached: list[tuple[nn.Module, CachedProvider]], spec: CacheSpec, top_k: int,
    settings: Settings,
) -> None:  # fmt: skip
    """Give the cached layers one CPU executor over their host stores and the cost model that
    splits their misses, where `settings.hybrid` asks for it, or (None) where the model runs on CUDA
    and the CPU would take any of a decode call's misses; print the costs and what they predict."""
    asked, given = settings.hybrid, settings.hybrid_costs
    what = "hybrid=True" if asked else "hybrid_costs"
    if (asked or given) and not cached:
        raise ValueError(
            f"{what} splits the misses of cached layers, and every MoE layer here keeps all "
            "its experts resident (cache >= num_experts): there are no misses; leave it out"
        )
    if asked is None and given and spec.device.type != "cuda":
        raise ValueError(
            "hybrid_costs are given, but the hybrid is off by default for a model on the CPU, "
            "whose slots and host store share one memory: pass hybrid=True to split its misses "
            "anyway, or leave hybrid_costs out"
        )
    threads = settings.cpu_threads
    if asked is False or not cached or (asked is None and spec.device.type != "cuda"):
        return
    try:
        layers = [CpuExperts.from_module(m, host_tensors(m), spec.fmt) for m, _ in cached]
        cpu = CpuSettings(threads=settings.cpu_threads)
        executor = CpuExecutor(layers, spec.device, _dtype(model), top_k, cpu)
    except PoolSizeError:
        raise
    except (ValueError, RuntimeError) as e:  # a layer the kernels cannot compute; no C compiler
        if asked or given:
            raise ValueError(f"{what} computes misses on the CPU, which cannot here: {e}") from None
        _threads_unused(threads, f"the CPU cannot compute these experts ({e})")
        return
    costs = given or _calibrated(executor, cached[0][1].cache, asked)
    if costs is None:
        _threads_unused(threads, "this host was too noisy to time the CPU")
        return
    on = bool(asked) or pays(costs, top_k)
    print(_hybrid_summary(costs, given is not None, on, cached, top_k))
    if not on:
        _threads_unused(threads, "the CPU, timed here, would take none of a decode call's misses")
    else:
        cost = cost_tensor(costs, spec.device)
        for i, (_, provider) in enumerate(cached):
            provider.hybrid = Hybrid(executor, i, cost)


def _calibrated(executor: CpuExecutor, cache, asked: bool | None) -> HybridCosts | None:
    """The costs timed on this host; where it is too noisy to time them, an error for
    `hybrid=True`, else a warning and None (the hybrid stays off)."""
    try:
        return calibrate(executor, cache)
    except CalibrationError as e:
        if asked:
            raise ValueError(
                f"hybrid=True splits misses by costs timed at compile, and this host was too "
                f"noisy to time them ({e}): pass hybrid_costs=asyncmoe.HybridCosts(round_trip=, "
                "per_expert=, per_pair=, copy=) in ns (a quiet run's compile prints them), or "
                "leave hybrid out"
            ) from None
        warnings.warn(
            f"asyncmoe: the hybrid stays off: this host was too noisy to time its costs ({e}). "
            "To split misses with the CPU, pass hybrid_costs=asyncmoe.HybridCosts(...) (a quiet "
            "run's compile prints them); hybrid=False skips the timing",
            stacklevel=2,
        )
        return None


def _hybrid_summary(
    costs: HybridCosts, given: bool, on: bool, cached: list[tuple[nn.Module, CachedProvider]],
    top_k: int,
) -> str:  # fmt: skip
    """One line: the costs, whether the hybrid is on, and a decode token's miss time that the
    costs predict under uniform routing, with and without the CPU."""
    shapes = [(p.cache.num_experts, p.cache.num_slots) for _, p in cached]

    def per_token(hybrid: bool) -> str:
        ns = sum(decode_miss_ns(costs, E, C, top_k, hybrid) for E, C in shapes)
        return f"{ns / 1e3:.3g} µs"

    E, C = shapes[0]
    predicted = f"{per_token(True)} hybrid, {per_token(False)} GPU-only" if on else per_token(False)
    return (
        f"asyncmoe: hybrid {'on' if on else 'off (the CPU would take no decode miss)'}, by "
        f"{costs} in ns ({'given' if given else 'timed on this host'}); a decode token's misses "
        f"{predicted} (uniform routing: top_k={top_k}, {C} of {E} experts resident, "
        f"{len(cached)} layers)"
    )


def _threads_unused(threads: int | None, why: str) -> None:
    """Warn where `cpu_threads` was given and hybrid's default leaves the CPU executor off."""
    if threads is not None:
        warnings.warn(
            f"hybrid stays off: {why}, so cpu_threads={threads} is unused; hybrid=True turns it "
            "on anyway",
            stacklevel=4,
        )


def _dtype(model: nn.Module) -> torch.dtype:
    return getattr(model, "dtype", None) or next(
        p.dtype for p in model.parameters() if p.is_floating_point()
    )


def _install_cpu(model: nn.Module, experts, spec: CacheSpec, top_k: int, cpu: CpuSettings) -> None:
    """`cache=0`: every experts module's tensors to the host store, one executor computing them all
    on the host's CPU, a `CpuProvider` per module."""
    layers, blocks = [], []
    for name, m in tqdm(
        experts, desc="asyncmoe: experts to host memory", unit="layer", disable=len(experts) < 2
    ):
        _refuse_asyncmoe_config(name, m)
        hosts, _, block = host_store(m, spec)
        try:
            layers.append(CpuExperts.from_module(m, hosts, spec.fmt))
        except ValueError as e:
            raise ValueError(f"cache=0 computes {name} on the CPU, which cannot: {e}") from None
        blocks.append(block)
    model.to(spec.device)
    executor = CpuExecutor(layers, spec.device, _dtype(model), top_k, cpu)
    for i, ((_, m), block) in enumerate(zip(experts, blocks)):
        provider = CpuProvider(executor, i)
        provider.pinned_block = block  # the host store stays pinned as long as the provider lives
        setattr(m, PROVIDER, provider)


def _refuse_asyncmoe_config(name: str, m: nn.Module) -> None:
    if m.config._experts_implementation == "asyncmoe":
        raise ValueError(
            f"{name}'s config names the 'asyncmoe' experts implementation, but the module was "
            "never compiled: build the model from a config that asyncmoe.compile has not switched "
            "(or set model.set_experts_implementation('eager') first)"
        )


def _switch(model: nn.Module, experts, settings: Settings, device: torch.device) -> nn.Module:
    """Replay's routers, then the experts modules switched to the "asyncmoe" implementation."""
    if settings.replay is not None:
        install_replay(experts, settings.replay, device)
    for _, m in experts:  # replayed before compile
        feed_replayed_gate(m)

    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("asyncmoe")
    # plain modules, and composite models whose config heuristics skipped a sub-config
    for _, m in experts:
        if m.config._experts_implementation != "asyncmoe":
            m.config._experts_implementation = "asyncmoe"
    return model
