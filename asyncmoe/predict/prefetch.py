"""One prefetch into a target layer: score its experts by the chosen predictors, gate, admit and copy.

What the `asyncmoe::prefetch` op runs on its side stream, and the simulator inline. On CUDA the scoring,
combining and gating are one Triton launch (`kernels/scores.py`), the decision another
(`kernels/cache_step.py`), then the copy; `scores_reference` is the first launch's reference. Why the
prediction runs on the side stream, and fused: docs/decisions.md#side-stream-prediction.
Dims: E experts of the target, E' of the layer before it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..cache import algorithm
from ..cache.state import (
    COUNTER_CONSTANTS,
    GATE,
    N_OUTCOMES,
    PACE_CONSTANTS,
    PAID,
    SEEN_PAID,
    SEEN_WASTED,
    TEMPORAL,
    TRANSITION,
    WASTED,
    CacheState,
)
from ..kernels import scores as score_kernels
from . import prefetch_gate
from .predictors import MIN_SUPPORT, combine, temporal_scores, transition_scores

# what kernels/scores.py's prefetch kernel shares with the reference, by name
KERNEL_CONSTANTS = dict(
    GATE=GATE,
    TEMPORAL=TEMPORAL,
    TRANSITION=TRANSITION,
    **{
        n: COUNTER_CONSTANTS[n]
        for n in (
            "CALLS",
            "PREFETCHED",
            "PREFETCH_TIMELY",
            "PREFETCH_VICTIMS",
            "EXPLORED",
            "EXPLORED_PAID",
            "RUNNERS_UP",
            "RUNNERS_UP_PAID",
        )
    },
    WASTED=WASTED,
    PAID=PAID,
    SEEN_WASTED=SEEN_WASTED,
    SEEN_PAID=SEEN_PAID,
    N_OUTCOMES=N_OUTCOMES,
    PACE_WINDOW=PACE_CONSTANTS["PACE_WINDOW"],
    PACE_COPY=PACE_CONSTANTS["PACE_COPY"],
    MIN_SUPPORT=MIN_SUPPORT,
    MIN_PRECISION=prefetch_gate.MIN_PRECISION,
    LOG2_DECAY=prefetch_gate.LOG2_DECAY,
    EXPLORE_EVERY=prefetch_gate.EXPLORE_EVERY,
)


class Request(NamedTuple):
    """What one prefetch asks of its target layer."""

    sources: int  # bits of the predictors to use (GATE, TEMPORAL, TRANSITION); the gate's scores are in `gate`
    budget: int  # most experts to admit
    policy: str  # the target cache's eviction policy
    copy_programs: int | None = None  # cap on the copy kernel's grid (None: one program per block)


def predict_and_prefetch(
    r: Request,
    s: CacheState,  # the target's
    routed_before: torch.Tensor | None,  # [E'] the previous layer's routing, for the transition predictor
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    use_kernel: bool | None = None,
) -> None:
    """Score the target's experts into `s.predicted` / `s.nominated`, apply the prefetch gate, and prefetch."""
    algorithm.copy_in(hosts, slots, predict_and_plan(r, s, routed_before, slots, use_kernel), r.copy_programs)


def predict_and_plan(
    r: Request,
    s: CacheState,
    routed_before: torch.Tensor | None,
    slots: list[torch.Tensor],
    use_kernel: bool | None = None,
) -> algorithm.Copies:
    """`predict_and_prefetch`'s scores and decision, tables updated: the copies still to make."""
    use_kernel = kernels.available(s.expert_to_slot) if use_kernel is None else use_kernel
    if use_kernel:
        score_kernels.prefetch_scores_triton(r.sources, routed_before, r.budget, s, KERNEL_CONSTANTS)
    else:
        scores_reference(r.sources, routed_before, r.budget, s)
    return algorithm.prefetch_plan(r.budget, r.policy, s, slots, use_kernel)


def scores_reference(sources: int, routed_before: torch.Tensor | None, keep: int, s: CacheState) -> None:
    """The combined prediction and its sources into `s.predicted` and `s.nominated`, gated."""
    parts = [(GATE, s.gate)] if sources & GATE else []
    if sources & TEMPORAL:
        parts.append((TEMPORAL, temporal_scores(s.routed)))
    if sources & TRANSITION:
        parts.append((TRANSITION, transition_scores(routed_before, s.transitions, keep)))
    score, nominated = combine(parts)
    s.predicted.copy_(score)
    s.nominated.copy_(nominated)
    prefetch_gate.gate_prefetch(s, keep)
