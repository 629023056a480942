"""The cache's custom op, `asyncmoe::ensure`, with its fake: what torch.compile sees of a layer's
decision.

The op is opaque to Dynamo and Inductor, so a compiled graph stays whole around a decision whose
insides (sorts, scatters, a Triton copy, a side stream's events) need not be traced. It takes a
layer's `CacheState` as one flat tensor list (`state`), named again here; `mutates_args` names every
tensor it may write, so functionalization orders the expert compute after the copies it reads, and a
layer's `ensure` after the `prefetch` into the same layer (both write its tables). The fake's
`torch._check`s state the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import algorithm, clock
from .expert_cache import ExpertCache
from .state import COUNTERS, TIMER_SIZE, TIMER_START, TIMER_WAIT_FROM, TIMER_WAITED, CacheState
from .streams import SIDE


def check_state(state: list[Tensor]) -> CacheState:
    torch._check(
        len(state) == len(CacheState._fields),
        lambda: (
            f"state must hold the {len(CacheState._fields)} "
            f"CacheState tensors ({', '.join(CacheState._fields)}), got {len(state)}"
        ),
    )
    s = CacheState._make(state)
    torch._check(s.expert_to_slot.dtype == torch.int64, lambda: "expert_to_slot must be int64")
    torch._check(
        s.counters.shape == (len(COUNTERS),), lambda: f"counters must be [{len(COUNTERS)}]"
    )
    torch._check(
        s.timer.numel() in (0, TIMER_SIZE),
        lambda: f"timer must be empty (not timed) or [{TIMER_SIZE}], got {tuple(s.timer.shape)}",
    )
    torch._check(s.pace.shape == (3,), lambda: f"pace must be [3], got {tuple(s.pace.shape)}")
    return s


@torch.library.custom_op("asyncmoe::ensure", mutates_args=("state", "slots"))
def _ensure(
    top_k_index: Tensor,
    wave: int,
    wait: bool,
    lap: bool,
    policy: str,
    state: list[Tensor],
    hosts: list[Tensor],
    slots: list[Tensor],
    elsewhere: Tensor | None = None,
) -> Tensor:
    """Make this call's wave of routed experts resident in the slots; return their slot ids.

    Decided on the device with fixed-shape ops (`cache.algorithm`); misses are copied host -> slot
    by the gather-copy kernel, whose count stays in device memory. `wait`: the prefetch into this
    layer issued earlier in the forward: decide once it has decided, copy once its copies are made
    (they may fill a slot this decision evicts). A non-empty `timer` (CUDA) times the wait for those
    copies and the rest on the GPU clock (cache/clock.py). `lap`: first fold the time since the
    prefetch op stamped `pace` into its window (the compute that prefetch had to hide behind; see
    `providers.link`). `elsewhere` [E] bool: experts another executor computes this call (the
    hybrid's CPU), routed but neither copied nor given a slot.
    """
    s = CacheState._make(state)
    cuda, timed = s.expert_to_slot.is_cuda, s.timer.numel() > 0
    if lap and cuda:
        clock.window(s.pace)
    if timed:
        clock.stamp(s.timer, TIMER_START)
    if wait and cuda:
        torch.cuda.current_stream().wait_event(SIDE.planned(s.expert_to_slot))
    out, copies = algorithm.ensure_plan(top_k_index, wave, policy, s, slots, elsewhere=elsewhere)
    if cuda:
        SIDE.mark("decided", s.routed)
    if timed:
        clock.stamp(s.timer, TIMER_WAIT_FROM)
    if wait and cuda:
        torch.cuda.current_stream().wait_event(SIDE.ready(s.expert_to_slot))
    if timed:
        clock.stamp(s.timer, TIMER_WAITED)
    algorithm.copy_in(hosts, slots, copies)
    if cuda:
        SIDE.mark("copied", s.routed)
    if timed:
        clock.lap(s.timer, copies[2])
    return out


@_ensure.register_fake
def _(top_k_index, wave, wait, lap, policy, state, hosts, slots, elsewhere=None):
    s = check_state(state)
    C, E = s.slot_to_expert.shape[0], s.expert_to_slot.shape[0] - 1
    torch._check(
        elsewhere is None or (elsewhere.shape == (E,) and elsewhere.dtype == torch.bool),
        lambda: f"elsewhere must be [E={E}] bool",
    )
    torch._check(
        top_k_index.dim() == 2,
        lambda: f"top_k_index must be [tokens, top_k], got {top_k_index.dim()}D",
    )
    torch._check(
        top_k_index.shape[1] <= C,
        lambda: (
            f"top_k={top_k_index.shape[1]} exceeds the cache's {C} slots: every token needs its "
            "top_k experts "
            f"resident at once; use cache>={top_k_index.shape[1]}"
        ),
    )
    torch._check(len(hosts) == len(slots), lambda: "hosts and slots must pair up")
    return torch.empty(top_k_index.shape, dtype=torch.int64, device=top_k_index.device)


def ensure(
    cache: ExpertCache,
    top_k_index: Tensor,
    wave: int,
    wait: bool = False,
    lap: bool = False,
    elsewhere: Tensor | None = None,
) -> Tensor:
    """`asyncmoe::ensure` on one layer's cache; slot ids [T, k], -1 for pairs of other waves and of
    the experts `elsewhere` computes."""
    state = list(cache.state)
    return torch.ops.asyncmoe.ensure(
        top_k_index, wave, wait, lap, cache.policy, state, cache.hosts, cache.slots, elsewhere
    )
