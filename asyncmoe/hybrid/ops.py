"""The hybrid's custom ops with their fakes: `hybrid_send` (split a call's misses by the cost model
and send the CPU's share to the worker) and `hybrid_receive` (take the CPU's outputs back, and weight
and sum every token's pairs). Between them the layer's `ensure` copies the GPU's misses and the GPU
computes its pairs, while the CPU computes: the ops order by data (`cpu_ids` flows from one to the
other, and `hybrid_receive` reads the GPU's outputs), so a compiled graph keeps that overlap.

Dims: T tokens, k experts a token, P = T*k pairs, H hidden, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.expert_cache import ExpertCache
from ..cache.ops import check_state
from ..cache.state import CacheState
from ..cache.streams import SIDE
from ..compute.cpu.executor import CpuExecutor, executor
from . import split
from .split import Cost


@dataclass(frozen=True)
class Hybrid:
    """A cached layer's link to the CPU: the model's `executor`, this layer's number in its
    requests, and the model's costs as the split reads them, `cost` [len(Cost)] int64 ns (on the
    model's device; `calibrate.costs_of` reads them back)."""

    executor: CpuExecutor
    layer: int
    cost: Tensor


@torch.library.custom_op("asyncmoe::hybrid_send", mutates_args=("state",))
def _hybrid_send(
    x: Tensor, top_k_index: Tensor, wait: bool, waves: bool, state: list[Tensor], cost: Tensor,
    executor_id: int, layer: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Split this call's misses between the link and the CPU (hybrid/split.py) and send the CPU's
    pairs of rows `x` to the worker, on CUDA in one kernel; returns (elsewhere [E] bool: the CPU's
    experts, which `ensure` counts as routed but does not copy; cpu_ids [T, k]: the pairs the CPU
    computes, -1 the GPU's). `wait`: a prefetch into this layer was issued earlier in the forward,
    so decide once it has decided (its experts count as resident). `waves`: the GPU may serve its
    share in waves (an eager call); else it must fit the slots."""
    s, ex = CacheState._make(state), executor(executor_id)
    if ex.device.type == "cuda":
        if wait:
            torch.cuda.current_stream().wait_event(SIDE.planned(s.expert_to_slot))
        return split.split_and_send(x, top_k_index, s, cost, ex, layer, waves)
    elsewhere, cpu_ids = split.split(top_k_index, s, cost, waves=waves)
    ex.send(x, cpu_ids, layer)
    return elsewhere, cpu_ids


@_hybrid_send.register_fake
def _(x, top_k_index, wait, waves, state, cost, executor_id, layer):
    s = check_state(state)
    torch._check(
        top_k_index.dim() == 2 and x.dim() == 2 and x.shape[0] == top_k_index.shape[0],
        lambda: (
            f"x [T, H] and top_k_index [T, k] must agree, got {tuple(x.shape)} and "
            f"{tuple(top_k_index.shape)}"
        ),
    )
    torch._check(cost.shape == (len(Cost),), lambda: f"cost must be [{len(Cost)}]")
    E = s.expert_to_slot.shape[0] - 1
    ids = torch.empty(top_k_index.shape, dtype=torch.int64, device=top_k_index.device)
    return torch.empty(E, dtype=torch.bool, device=top_k_index.device), ids


@torch.library.custom_op("asyncmoe::hybrid_receive", mutates_args=())
def _hybrid_receive(
    gpu_out: Tensor, cpu_ids: Tensor, top_k_weights: Tensor, dtype: torch.dtype, executor_id: int,
    layer: int,
) -> Tensor:  # fmt: skip
    """Each token's output [T, H] in `dtype`, its pairs weighted and summed as
    `compute.experts.combine` does: the CPU's outputs where `cpu_ids` [T, k] names an expert
    (waiting for them; on CUDA a wait past the executor's timeout fails loudly), `gpu_out`'s
    [T*k, H] rows elsewhere. On CUDA one kernel, in place of the GPU-only path's combine."""
    return executor(executor_id).combine(gpu_out, cpu_ids, top_k_weights, layer, dtype)


@_hybrid_receive.register_fake
def _(gpu_out, cpu_ids, top_k_weights, dtype, executor_id, layer):
    torch._check(
        gpu_out.dim() == 2 and gpu_out.shape[0] == cpu_ids.numel(),
        lambda: f"gpu_out must be [P={cpu_ids.numel()}, H], got {tuple(gpu_out.shape)}",
    )
    torch._check(
        top_k_weights.shape == cpu_ids.shape,
        lambda: f"top_k_weights must be {tuple(cpu_ids.shape)}, got {tuple(top_k_weights.shape)}",
    )
    T = cpu_ids.shape[0]
    return torch.empty(T, gpu_out.shape[1], dtype=dtype, device=gpu_out.device)


def hybrid_send(
    x: Tensor, top_k_index: Tensor, wait: bool, waves: bool, cache: ExpertCache, hybrid: Hybrid
) -> tuple[Tensor, Tensor]:
    return torch.ops.asyncmoe.hybrid_send(
        x, top_k_index, wait, waves, list(cache.state), hybrid.cost, hybrid.executor.id,
        hybrid.layer,
    )  # fmt: skip


def hybrid_receive(
    gpu_out: Tensor, cpu_ids: Tensor, top_k_weights: Tensor, dtype: torch.dtype, hybrid: Hybrid
) -> Tensor:
    return torch.ops.asyncmoe.hybrid_receive(
        gpu_out, cpu_ids, top_k_weights, dtype, hybrid.executor.id, hybrid.layer
    )
