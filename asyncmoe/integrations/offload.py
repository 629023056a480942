"""The host offload: an experts module's tensors moved to the host store (or kept quantized on the
GPU).

After it, an offloaded expert tensor is a plain attribute of its module holding the host copy:
`model.to()` leaves it where it is, `state_dict()` still returns it (a state-dict hook), and the
cache refuses to be moved or cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..cache.expert_cache import ExpertCache
from ..cache.host import PinnedBlock, block_bytes, carve, check_host_memory, uva_view
from ..formats import SCALE, Format, weight_names
from ..providers import QuantizedResidentProvider
from .transformers import expert_params


@dataclass(frozen=True)
class CacheSpec:
    """How every cached layer is built."""

    num_slots: int
    policy: str
    device: torch.device
    time_stalls: bool
    fmt: Format | None  # the experts' format in host memory and the slots; None: the model's dtype


# of the scales beside a weight a checkpoint stores quantized (fp8; 4-bit)
SUFFIXES = (SCALE, "_scales")


def stored_quantized(name: str, params: dict) -> bool:
    """Whether `name` is a quantized weight that a checkpoint stored with its scales, or those
    scales."""
    return any(
        name + sfx in params or name.endswith(sfx) and name[: -len(sfx)] in params
        for sfx in SUFFIXES
    )


def host_specs(m: nn.Module, fmt: Format | None) -> list[tuple[str, torch.Size, torch.dtype]]:
    """The expert tensors the host store holds for module `m`, in `fmt`: (name, shape [E, ...],
    dtype). Weights a checkpoint already stores quantized (with their scales beside them) are taken
    as they are."""
    params = expert_params(m)
    quantized = weight_names(m) if fmt is not None else ()
    specs = []
    for name, p in params.items():
        if any(name.endswith(sfx) and name[: -len(sfx)] in quantized for sfx in SUFFIXES):
            continue  # listed with its weight
        if name in quantized and name + fmt.suffix in params:  # stored quantized: as it is
            specs += [
                (name, p.shape, p.dtype),
                (
                    name + fmt.suffix,
                    params[name + fmt.suffix].shape,
                    params[name + fmt.suffix].dtype,
                ),
            ]
        elif name in quantized:
            specs += fmt.stored(name, p.shape, m.is_transposed)
        else:
            specs.append((name, p.shape, p.dtype))
    return specs


def store(m: nn.Module, fmt: Format | None, out: dict[str, torch.Tensor]) -> None:
    """Write the module's expert tensors into `out` (host_specs' tensors) in `fmt`, one expert at a
    time, so a quantized copy never needs more than one expert's float32 temporaries."""
    params = expert_params(m)
    for name, dst in out.items():
        src = params.get(name)
        if src is None:
            continue  # a scale, written with its weight
        # quantize
        if fmt is not None and name + fmt.suffix in out and name + fmt.suffix not in params:
            scales = out[name + fmt.suffix]
            for e in range(src.shape[0]):
                q, s = fmt.quantize(src[e].detach(), m.is_transposed)
                dst[e].copy_(q)
                scales[e].copy_(s)
        else:
            dst.copy_(src.detach())


def expert_size(m: nn.Module, fmt: Format | None) -> int:
    """Bytes of one expert of module `m` in `fmt`: what a miss copies."""
    return sum(
        torch.Size(shape[1:]).numel() * dtype.itemsize for _, shape, dtype in host_specs(m, fmt)
    )


def offload(m: nn.Module, spec: CacheSpec, pace: torch.Tensor) -> ExpertCache:
    """Move the module's expert tensors to the host store, in `spec.fmt`, and give it a cache built
    as `spec` says."""
    hosts, views, block = host_store(m, spec)
    cache = ExpertCache(views, spec.num_slots, spec.policy, spec.time_stalls, pace)
    cache.pinned_block = block  # keeps the registration alive as long as the cache
    return cache


def host_store(
    m: nn.Module, spec: CacheSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], PinnedBlock | None]:
    """Move the module's expert tensors to the host store, in `spec.fmt`: by name, the host tensors,
    the views a device reads them through (the same tensors on the CPU), and the pinned block that
    holds them (None on the CPU)."""
    specs = host_specs(m, spec.fmt)
    shapes = [(shape, dtype) for _, shape, dtype in specs]
    nbytes = block_bytes(shapes)
    block = None
    if spec.device.type == "cuda":
        check_host_memory(nbytes, "pinning this layer's experts")
        block = PinnedBlock(nbytes)
        hosts = carve(block.data, shapes)
        views = carve(uva_view(block, spec.device), shapes)
    elif spec.fmt is None:  # the CPU reads the parameters where they already are
        if spec.num_slots:
            check_host_memory(
                block_bytes([(s[1:], d) for s, d in shapes]) * spec.num_slots,
                "the CPU expert slots",
            )
        hosts = [p.detach() for p in expert_params(m).values()]
        views = hosts
    else:
        check_host_memory(nbytes, "this layer's quantized experts")
        hosts = carve(torch.empty(nbytes, dtype=torch.uint8), shapes)
        views = hosts
    names = [name for name, _, _ in specs]
    if block is not None or spec.fmt is not None:
        store(m, spec.fmt, dict(zip(names, hosts)))
    sharded = _sharded(m)
    for name, host in zip(names, hosts):
        # A plain attribute, not a parameter: `model.to()` must not drag the host store to the GPU,
        # and nothing in the forward reads it. `state_dict` still returns it (see the hook below).
        m._parameters.pop(name, None)
        setattr(m, name, host)
    _keep_shard_mark(m, sharded)
    m._asyncmoe_offloaded = tuple(names)
    m._register_state_dict_hook(_add_offloaded_to_state_dict)
    return dict(zip(names, hosts)), dict(zip(names, views)), block


def resident(m: nn.Module, fmt: Format, device: torch.device) -> QuantizedResidentProvider:
    """Every expert of the module on `device` in `fmt`, quantized one expert at a time."""
    specs = host_specs(m, fmt)
    tensors = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in specs}
    store(m, fmt, tensors)
    sharded = _sharded(m)
    for name, t in tensors.items():
        m._parameters.pop(name, None)
        setattr(m, name, t)
    _keep_shard_mark(m, sharded)
    m._asyncmoe_offloaded = tuple(tensors)
    m._register_state_dict_hook(_add_offloaded_to_state_dict)
    return QuantizedResidentProvider(tensors, fmt)


def host_tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    """An offloaded experts module's host store, by name (as `host_store` left it)."""
    return {name: getattr(m, name) for name in m._asyncmoe_offloaded}


def _add_offloaded_to_state_dict(module, state_dict, prefix, local_metadata):
    for name in module._asyncmoe_offloaded:
        state_dict[prefix + name] = getattr(module, name)
    state_dict.pop(prefix + SHARD_MARK, None)
    return state_dict


SHARD_MARK = "asyncmoe_expert_shard"


def _sharded(m: nn.Module) -> DTensor | None:
    """One of the module's parameters that expert parallelism split over ranks, if any."""
    params = m.parameters(recurse=False)
    return next(
        (
            p
            for p in params
            if isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements)
        ),
        None,
    )


def _keep_shard_mark(m: nn.Module, sharded: DTensor | None) -> None:
    """Leave an expert-parallel module an empty parameter sharded as its experts were: transformers
    5.17 sums the ranks' outputs only while the module holds a sharded parameter, and its experts
    now live in the cache."""
    if sharded is not None:
        empty = torch.empty(0, device=sharded.to_local().device, dtype=sharded.dtype)
        mark = DTensor.from_local(empty, sharded.device_mesh, sharded.placements, run_check=False)
        m.register_parameter(SHARD_MARK, nn.Parameter(mark, requires_grad=False))
