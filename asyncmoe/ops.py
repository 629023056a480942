"""Every custom op asyncmoe adds: the only surface torch.compile sees.

Each op is opaque to Dynamo and Inductor, so a compiled graph stays whole around cache decisions
whose insides (sorts, scatters, a Triton copy) need not be traced; `mutates_args` names every
tensor an op writes, so functionalization orders the expert compute after the copies it reads.
Each op has its fake beside it, whose `torch._check`s state the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import expert_cache
from .cache.expert_cache import ExpertCache


@torch.library.custom_op(
    "asyncmoe::ensure",
    mutates_args=("expert_to_slot", "slot_to_expert", "state", "counters", "slots"),
)
def _ensure(
    top_k_index: Tensor,
    wave: int,
    policy: str,
    expert_to_slot: Tensor,
    slot_to_expert: Tensor,
    state: list[Tensor],
    counters: Tensor,
    hosts: list[Tensor],
    slots: list[Tensor],
) -> Tensor:
    """Make this call's wave of routed experts resident in the slots; return their slot ids.

    Decided on the device with fixed-shape ops (see `cache.expert_cache`); misses are copied
    host -> slot by the gather-copy kernel, whose count stays in device memory.
    """
    return expert_cache.ensure(
        top_k_index, wave, policy, expert_to_slot, slot_to_expert, state, counters, hosts, slots
    )


@_ensure.register_fake
def _(top_k_index, wave, policy, expert_to_slot, slot_to_expert, state, counters, hosts, slots):
    C = slot_to_expert.shape[0]
    torch._check(top_k_index.dim() == 2, lambda: f"top_k_index must be [tokens, top_k], got {top_k_index.dim()}D")
    torch._check(
        top_k_index.shape[1] <= C,
        lambda: f"top_k={top_k_index.shape[1]} exceeds the cache's {C} slots: every token needs its top_k experts "
        f"resident at once; use cache>={top_k_index.shape[1]}",
    )
    torch._check(len(hosts) == len(slots), lambda: "hosts and slots must pair up")
    torch._check(expert_to_slot.dtype == torch.int64, lambda: "expert_to_slot must be int64")
    return torch.empty(top_k_index.shape, dtype=torch.int64, device=top_k_index.device)


def ensure(cache: ExpertCache, top_k_index: Tensor, wave: int) -> Tensor:
    """`asyncmoe::ensure` on one layer's cache buffers; slot ids [T, k], -1 for pairs of other waves."""
    return torch.ops.asyncmoe.ensure(
        top_k_index,
        wave,
        cache.policy,
        cache.expert_to_slot,
        cache.slot_to_expert,
        cache.state,
        cache.counters,
        cache.hosts,
        cache.slots,
    )
