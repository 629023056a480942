"""One prefetch into a target layer: score its experts by the chosen predictors, gate, admit and
copy.

What the `asyncmoe::prefetch` op runs on its side stream, and the simulator inline. On CUDA the
scoring, combining and gating are one Triton launch (`prefetch/prefetch_scores.py`), the decision
another (`cache/cache_step.py`), then the copy; `scores_reference` is the first launch's reference.
Why the prediction runs on the side stream, and fused: docs/decisions.md#side-stream-prediction.
Dims: E experts of the target, E' of the layer before it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import gpu
from ..cache import algorithm
from ..cache.state import GATE, TEMPORAL, TRANSITION, CacheState
from . import prefetch_gate
from .predictors import combine, temporal_scores, transition_scores
from .prefetch_scores import prefetch_scores_triton
from .state import PrefetchState


class Request(NamedTuple):
    """What one prefetch asks of its target layer."""

    # bits of the predictors to use (GATE, TEMPORAL, TRANSITION); the gate's scores are in `gate`
    sources: int
    budget: int  # most experts to admit
    policy: str  # the target cache's eviction policy
    copy_programs: int | None = None  # cap on the copy kernel's grid (None: one program per block)


def predict_and_prefetch(
    r: Request,
    s: CacheState,  # the target's cache
    p: PrefetchState,  # the target's prefetch buffers
    # [E'] the previous layer's routing, for the transition predictor
    routed_before: torch.Tensor | None,
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    use_kernel: bool | None = None,
) -> None:
    """Score the target's experts into `p.predicted` / `p.nominated`, apply the prefetch gate, and
    prefetch."""
    algorithm.copy_in(
        hosts, slots, predict_and_plan(r, s, p, routed_before, slots, use_kernel), r.copy_programs
    )


def predict_and_plan(
    r: Request,
    s: CacheState,
    p: PrefetchState,
    routed_before: torch.Tensor | None,
    slots: list[torch.Tensor],
    use_kernel: bool | None = None,
) -> algorithm.Copies:
    """`predict_and_prefetch`'s scores and decision, tables updated: the copies still to make."""
    use_kernel = gpu.available(s.expert_to_slot) if use_kernel is None else use_kernel
    if use_kernel:
        prefetch_scores_triton(r.sources, routed_before, r.budget, s, p)
    else:
        scores_reference(r.sources, routed_before, r.budget, s, p)
    return algorithm.prefetch_plan(
        p.predicted, p.nominated, r.budget, r.policy, s, slots, use_kernel
    )


def scores_reference(
    sources: int, routed_before, keep: int, s: CacheState, p: PrefetchState
) -> None:
    """The combined prediction and its sources into `p.predicted` and `p.nominated`, gated."""
    parts = [(GATE, p.gate)] if sources & GATE else []
    if sources & TEMPORAL:
        parts.append((TEMPORAL, temporal_scores(s.routed)))
    if sources & TRANSITION:
        parts.append((TRANSITION, transition_scores(routed_before, p.transitions, keep)))
    score, nominated = combine(parts)
    p.predicted.copy_(score)
    p.nominated.copy_(nominated)
    prefetch_gate.gate_prefetch(s, p, keep)
