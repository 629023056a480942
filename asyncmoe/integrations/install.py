"""Installing asyncmoe into a transformers model: checks, the experts moved to the host store, providers.

After `install`, an offloaded expert tensor is a plain attribute of its module holding the host copy:
`model.to()` leaves it where it is, `state_dict()` still returns it (a state-dict hook), and the cache
refuses to be moved or cast.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils.logging import tqdm

from ..cache.expert_cache import ExpertCache
from ..cache.host import PinnedBlock, block_bytes, carve, check_host_memory, human_bytes, uva_view
from ..formats import FP8, QUANTIZE_METHODS, SCALE, Format, Fp8, parse_quantize, weight_names
from ..predict.predictors import Prefetch
from ..providers import CachedProvider, ExpertWeightProvider, QuantizedResidentProvider, ResidentProvider, link
from ..trace.format import Trace
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
BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class CacheSpec:
    """How every cached layer is built."""

    num_slots: int
    policy: str
    device: torch.device
    time_stalls: bool
    fmt: Format | None  # the experts' format in host memory and the slots; None: the model's dtype


def parse_budget(cache: str) -> int:
    """`cache="6GiB"` (also "6GB", "512MiB", ...) -> bytes."""
    match = BUDGET.match(cache)
    if not match:
        raise ValueError(
            f"cache={cache!r}: give slots per MoE layer as an int (cache=16) or a GPU-memory budget for every "
            "layer's slots together, such as cache='6GiB', '6GB' or '512MiB'"
        )
    return int(float(match[1]) * UNITS[match[2].lower()])


def budget_text(nbytes: int) -> str:
    """A budget string of at least `nbytes` (rounded up in the largest binary unit that keeps it >= 1)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if nbytes >= UNITS[unit.lower()]:
            return f"{math.ceil(nbytes / UNITS[unit.lower()] * 100) / 100:g}{unit}"
    return f"{nbytes}B"


def _check(model: nn.Module, experts: list[tuple[str, nn.Module]], cache) -> None:
    if isinstance(cache, bool) or not isinstance(cache, (int, str)):
        raise TypeError(
            f"cache must be an int (GPU slots per MoE layer) or a GPU-memory budget such as '6GiB', "
            f"got {type(cache).__name__} {cache!r}"
        )
    if isinstance(cache, int) and cache <= 0:
        raise ValueError(f"cache={cache}: must be at least the model's top_k (slots per MoE layer)")
    method = quant_method(model)
    if method is not None and method != "fp8":
        raise ValueError(
            f"this model is quantized ({method}); asyncmoe keeps experts in "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            f" or in {', '.join(QUANTIZE_METHODS)}. Load it dequantized (dtype=torch.bfloat16 and the quantization "
            "method's dequantize option, or no quantization_config); asyncmoe.compile(model, quantize='fp8') then "
            "keeps "
            "its experts in fp8."
        )
    if not experts:
        moe = looks_like_moe(model)
        if moe:
            raise ValueError(
                f"{type(model).__name__} has MoE layers ({', '.join(moe)}) that do not use transformers' experts "
                f"interface (@use_experts_implementation), so asyncmoe cannot cache them; {families_hint()}."
            )
        raise ValueError(f"{type(model).__name__} has no MoE layer for asyncmoe to offload; {families_hint()}.")
    for name, m in experts:
        if isinstance(getattr(m, PROVIDER, None), ExpertWeightProvider):
            raise RuntimeError(f"{name} is already asyncmoe-compiled: call asyncmoe.compile once per model")
        params = expert_params(m)
        E = num_experts(m)
        for pname, p in params.items():
            if p.dtype not in SUPPORTED_DTYPES and not _stored_quantized(pname, params):
                raise TypeError(
                    f"{name}.{pname} is {p.dtype}; asyncmoe caches experts in "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}, or quantized with their scales "
                    f"({', '.join(QUANTIZE_METHODS)}). Load the model in one of those dtypes."
                )
            if p.dim() == 0 or p.shape[0] != E:
                raise ValueError(f"{name}.{pname} has shape {tuple(p.shape)}, not [num_experts={E}, ...]")


SUFFIXES = (SCALE, "_scales")  # of the scales beside a weight a checkpoint stores quantized (fp8; 4-bit)


def _stored_quantized(name: str, params: dict) -> bool:
    """Whether `name` is a quantized weight that a checkpoint stored with its scales, or those scales."""
    return any(name + sfx in params or name.endswith(sfx) and name[: -len(sfx)] in params for sfx in SUFFIXES)


def quant_method(model: nn.Module) -> str | None:
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is None:
        return None
    return getattr(quant, "quant_method", None) or (
        quant.get("quant_method") if isinstance(quant, dict) else str(quant)
    )


def _format(model: nn.Module, experts: list[tuple[str, nn.Module]], quantize) -> Format | None:
    """The experts' format: `quantize`'s, or fp8 where the model's experts already are (a fine-grained FP8 model)."""
    fmt = parse_quantize(quantize)
    stored = [p.dtype == FP8 for _, m in experts for p in expert_params(m).values()]
    if any(stored) and fmt is None:
        quant = getattr(model.config, "quantization_config", None)
        block = quant.get("weight_block_size") if isinstance(quant, dict) else getattr(quant, "weight_block_size", None)
        if block is None:
            raise ValueError(
                "this fp8 model has no weight_block_size in its quantization_config: asyncmoe keeps "
                "block-wise fp8 experts (transformers' fine-grained FP8)"
            )
        fmt = Fp8(tuple(block))
    return fmt


def _check_device(fmt: Format, device: torch.device) -> None:
    if device.type == "cuda" and isinstance(fmt, Fp8) and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fp8 experts need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) for asyncmoe's fp8 "
            f"kernels; {torch.cuda.get_device_name(device)} is {major}.{minor}. Keep the experts in bf16 instead: "
            "quantize=None for a bf16 model, or for an fp8 checkpoint asyncmoe.from_pretrained(path, "
            "quantize='dequantize'); or quantize='int4', whose kernels run on any CUDA GPU (the CPU runs every "
            "format by dequantizing, device='cpu')."
        )


def host_specs(m: nn.Module, fmt: Format | None) -> list[tuple[str, torch.Size, torch.dtype]]:
    """The expert tensors the host store holds for module `m`, in `fmt`: (name, shape [E, ...], dtype). Weights a
    checkpoint already stores quantized (with their scales beside them) are taken as they are."""
    params = expert_params(m)
    quantized = weight_names(m) if fmt is not None else ()
    specs = []
    for name, p in params.items():
        if any(name.endswith(sfx) and name[: -len(sfx)] in quantized for sfx in SUFFIXES):
            continue  # listed with its weight
        if name in quantized and name + fmt.suffix in params:  # stored quantized: as it is
            specs += [
                (name, p.shape, p.dtype),
                (name + fmt.suffix, params[name + fmt.suffix].shape, params[name + fmt.suffix].dtype),
            ]
        elif name in quantized:
            specs += fmt.stored(name, p.shape, m.is_transposed)
        else:
            specs.append((name, p.shape, p.dtype))
    return specs


def _store(m: nn.Module, fmt: Format | None, out: dict[str, torch.Tensor]) -> None:
    """Write the module's expert tensors into `out` (host_specs' tensors) in `fmt`, one expert at a time, so a
    quantized copy never needs more than one expert's float32 temporaries."""
    params = expert_params(m)
    for name, dst in out.items():
        src = params.get(name)
        if src is None:
            continue  # a scale, written with its weight
        if fmt is not None and name + fmt.suffix in out and name + fmt.suffix not in params:  # quantize
            scales = out[name + fmt.suffix]
            for e in range(src.shape[0]):
                q, s = fmt.quantize(src[e].detach(), m.is_transposed)
                dst[e].copy_(q)
                scales[e].copy_(s)
        else:
            dst.copy_(src.detach())


def _slots(cache, experts: list[tuple[str, nn.Module]], fmt: Format | None) -> int:
    """Slots per MoE layer: `cache` itself, or the most that every layer gets within a budget; at least top_k."""
    top_k = max(min(top_k_of(m.config) or 1, num_experts(m)) for _, m in experts)
    if isinstance(cache, int):
        if cache < top_k:
            raise ValueError(
                f"cache={cache} is below top_k={top_k}: every token needs its {top_k} experts resident at once; "
                f"use cache>={top_k}"
            )
        return cache
    budget = parse_budget(cache)
    sizes = [(num_experts(m), expert_size(m, fmt)) for _, m in experts]

    def need(slots: int) -> int:
        return sum(min(slots, E) * size for E, size in sizes)

    slots = max((s for s in range(1, max(E for E, _ in sizes) + 1) if need(s) <= budget), default=0)
    what = f"{len(sizes)} MoE layers, {fmt.name if fmt else 'dense'} experts of {human_bytes(sizes[0][1])}"
    if slots < top_k:
        raise ValueError(
            f"cache={cache!r} holds {slots} experts per MoE layer ({what}), below top_k={top_k}: every token needs "
            f"its {top_k} experts resident at once; the smallest budget that works is "
            f"cache={budget_text(need(top_k))!r}"
        )
    print(f"asyncmoe: cache={cache!r} gives {slots} slots per MoE layer ({what}; {human_bytes(need(slots))} of slots)")
    return slots


def expert_size(m: nn.Module, fmt: Format | None) -> int:
    """Bytes of one expert of module `m` in `fmt`: what a miss copies."""
    return sum(torch.Size(shape[1:]).numel() * dtype.itemsize for _, shape, dtype in host_specs(m, fmt))


def _device(device, experts: list[tuple[str, nn.Module]]) -> torch.device:
    """Where the model will run: `device`, or where its experts are now."""
    if device is None:
        device = next(iter(expert_params(experts[0][1]).values())).device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e}); use 'cuda', 'cuda:0' or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}, but torch sees no CUDA GPU here (torch.cuda.is_available() is False): "
                "use device='cpu', or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: asyncmoe runs on 'cuda' or 'cpu'")
    return device


def _plan(prefetch, device: torch.device, expert_parallel: bool = False) -> Prefetch | None:
    """The prefetch settings: None turns it on where a CUDA side stream can copy beside the compute (and the
    experts are not split over ranks: the gate predictor scores every expert, each rank's cache holds its own)."""
    if expert_parallel and prefetch not in (None, False):
        raise ValueError(
            "prefetch under expert parallelism is not supported: the gate predictor scores all of a layer's "
            "experts, each rank caches only its own; pass prefetch=None or False"
        )
    if prefetch is None:
        prefetch = device.type == "cuda" and not expert_parallel
    if isinstance(prefetch, bool):
        return Prefetch() if prefetch else None
    if not isinstance(prefetch, Prefetch):
        raise TypeError(
            f"prefetch must be True, False, None (on where the model runs on CUDA) or an asyncmoe.Prefetch, got "
            f"{prefetch!r}; to choose predictors use e.g. asyncmoe.Prefetch(sources=('gate', 'temporal'))"
        )
    return prefetch


def _offload(m: nn.Module, spec: CacheSpec, pace: torch.Tensor, transitions_from: int) -> ExpertCache:
    """Move the module's expert tensors to the host store, in `spec.fmt`, and give it a cache built as `spec` says."""
    specs = host_specs(m, spec.fmt)
    shapes = [(shape, dtype) for _, shape, dtype in specs]
    nbytes = block_bytes(shapes)
    block = None
    if spec.device.type == "cuda":
        check_host_memory(nbytes, "pinning this layer's experts")
        block = PinnedBlock(nbytes)
        hosts = carve(block.data, shapes)
        views = carve(uva_view(block, spec.device), shapes)
    elif spec.fmt is None:  # a CPU cache reads the parameters where they already are
        check_host_memory(block_bytes([(s[1:], d) for s, d in shapes]) * spec.num_slots, "the CPU expert slots")
        hosts = [p.detach() for p in expert_params(m).values()]
        views = hosts
    else:
        check_host_memory(nbytes, "this layer's quantized experts")
        hosts = carve(torch.empty(nbytes, dtype=torch.uint8), shapes)
        views = hosts
    names = [name for name, _, _ in specs]
    if block is not None or spec.fmt is not None:
        _store(m, spec.fmt, dict(zip(names, hosts)))
    sharded = _sharded(m)
    for name, host in zip(names, hosts):
        # A plain attribute, not a parameter: `model.to()` must not drag the host store to the GPU,
        # and nothing in the forward reads it. `state_dict` still returns it (see the hook below).
        m._parameters.pop(name, None)
        setattr(m, name, host)
    _keep_shard_mark(m, sharded)
    hosts = dict(zip(names, views))
    cache = ExpertCache(hosts, spec.num_slots, spec.policy, spec.time_stalls, pace, transitions_from)
    cache.pinned_block = block  # keeps the registration alive as long as the cache
    m._asyncmoe_offloaded = tuple(names)
    m._register_state_dict_hook(_add_offloaded_to_state_dict)
    return cache


def _resident(m: nn.Module, fmt: Format, device: torch.device) -> QuantizedResidentProvider:
    """Every expert of the module on `device` in `fmt`, quantized one expert at a time."""
    specs = host_specs(m, fmt)
    tensors = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in specs}
    _store(m, fmt, tensors)
    sharded = _sharded(m)
    for name, t in tensors.items():
        m._parameters.pop(name, None)
        setattr(m, name, t)
    _keep_shard_mark(m, sharded)
    m._asyncmoe_offloaded = tuple(tensors)
    m._register_state_dict_hook(_add_offloaded_to_state_dict)
    return QuantizedResidentProvider(tensors, fmt)


def _add_offloaded_to_state_dict(module, state_dict, prefix, local_metadata):
    for name in module._asyncmoe_offloaded:
        state_dict[prefix + name] = getattr(module, name)
    state_dict.pop(prefix + SHARD_MARK, None)
    return state_dict


SHARD_MARK = "asyncmoe_expert_shard"


def _sharded(m: nn.Module) -> DTensor | None:
    """One of the module's parameters that expert parallelism split over ranks, if any."""
    params = m.parameters(recurse=False)
    return next((p for p in params if isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements)), None)


def _keep_shard_mark(m: nn.Module, sharded: DTensor | None) -> None:
    """Leave an expert-parallel module an empty parameter sharded as its experts were: transformers 5.17 sums
    the ranks' outputs only while the module holds a sharded parameter, and its experts now live in the cache."""
    if sharded is not None:
        empty = torch.empty(0, device=sharded.to_local().device, dtype=sharded.dtype)
        mark = DTensor.from_local(empty, sharded.device_mesh, sharded.placements, run_check=False)
        m.register_parameter(SHARD_MARK, nn.Parameter(mark, requires_grad=False))


def install(
    model: nn.Module,
    cache: int,
    policy: str,
    device: torch.device | str | None,
    prefetch: bool | Prefetch | None,
    replay: Trace | None = None,
    time_stalls: bool = False,
    quantize=None,
) -> nn.Module:
    """Give every experts module of `model` a provider and switch it to the `"asyncmoe"` implementation."""
    experts = find_experts(model)
    _check(model, experts, cache)
    fmt = _format(model, experts, quantize)
    device = _device(device, experts)
    if fmt is not None:
        _check_device(fmt, device)
    parallel = any(is_expert_parallel(m) for _, m in experts)
    if parallel and replay is not None:
        raise ValueError(
            "replay routes by a trace's expert ids, but under expert parallelism each rank holds only its own "
            "experts: replay a trace on a model that is not expert-parallel"
        )
    prefetch = _plan(prefetch, device, parallel)
    num_slots = _slots(cache, experts, fmt)
    if time_stalls and device.type != "cuda":
        raise ValueError(
            f"time_stalls reads the GPU's clock, so it needs a CUDA device; this model runs on {device}. "
            "Pass device='cuda', or leave time_stalls off (on the CPU nothing waits: there are no streams)."
        )
    if device.type == "cuda":
        total = sum(block_bytes([(p.shape, p.dtype) for p in expert_params(m).values()]) for _, m in experts)
        on_gpu = sum(p.numel() * p.element_size() for _, m in experts for p in expert_params(m).values() if p.is_cuda)
        # Experts already on the GPU are copied out before their memory is freed: all of it is new host memory.
        check_host_memory(on_gpu, f"pinning the experts of {len(experts)} MoE layers ({human_bytes(total)})")

    spec = CacheSpec(num_slots, policy, device, time_stalls, fmt)
    pace = torch.zeros(3, dtype=torch.int64, device=device)  # one for every linked layer (providers.link)
    transition = prefetch is not None and "transition" in prefetch.sources
    cached = []
    for name, m in tqdm(experts, desc="asyncmoe: experts to host memory", unit="layer", disable=len(experts) < 2):
        implementation = m.config._experts_implementation or "eager"
        if num_slots >= num_experts(m) and fmt is not None:
            provider = _resident(m, fmt, device)
            provider.expert_parallel = is_expert_parallel(m)
        elif num_slots >= num_experts(m):
            fn = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, type(m).forward.__wrapped__)
            provider = ResidentProvider(implementation, fn)
            m.to(device)
        else:
            before = cached[-1].cache.num_experts if transition and cached else 0
            parallel_here = is_expert_parallel(m)  # before _offload takes the DTensors off the module
            provider = CachedProvider(_offload(m, spec, pace, before), find_router(model, name, m), fmt)
            provider.expert_parallel = parallel_here
            cached.append(provider)
        setattr(m, PROVIDER, provider)
    model.to(device)
    top_k = max((top_k_of(m.config) or 1) for _, m in experts)
    link(cached, prefetch, top_k)
    if replay is not None:
        install_replay(experts, replay, device)
    for _, m in experts:  # replayed before compile
        feed_replayed_gate(m)

    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("asyncmoe")
    for _, m in experts:  # plain modules, and composite models whose config heuristics skipped a sub-config
        if m.config._experts_implementation != "asyncmoe":
            m.config._experts_implementation = "asyncmoe"
    return model
