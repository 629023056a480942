"""A prefetch's scores and its gate in one Triton program: the temporal and transition scores, their
combination with the gate predictor's, and the prefetch gate, ~35 kernels of the torch code
(docs/decisions.md#fused-predictors). Runs on the side stream before the decision
(cache/cache_step.py).

Reference: `prefetch.scores_reference` (predictors.py, prefetch_gate.py); the kernel agrees with it
to rounding (row sums accumulate in another order, and an update may fuse its multiply-add).
Constants: the reference's own. Dims: E experts (target layer), E' experts (previous layer).
"""

from __future__ import annotations

import torch

from ..cache.state import GATE, PACE_COPY, PACE_WINDOW, TEMPORAL, TRANSITION, CacheState, Counter
from ..gpu import pointers
from .predictors import MIN_SUPPORT
from .prefetch_gate import EXPLORE_EVERY, LOG2_DECAY, MIN_PRECISION
from .state import N_OUTCOMES, PAID, SEEN_PAID, SEEN_WASTED, WASTED, PrefetchState

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

# what `_prefetch_scores` reads and writes of the target's `CacheState` (and all of its
# `PrefetchState`): its parameters `<field>_ptr`, bound by name
CACHE_STATE = ("routed", "expert_to_slot", "counters", "explored", "runners_up", "pace")

# `_opens` reads each pair as one [2] vector
assert (PAID == WASTED + 1) and (SEEN_PAID == SEEN_WASTED + 1)

if triton is not None:
    _ID_BITS = tl.constexpr(12)
    _ID_MASK = tl.constexpr(4095)
    _GATE = tl.constexpr(GATE)
    _TEMPORAL = tl.constexpr(TEMPORAL)
    _TRANSITION = tl.constexpr(TRANSITION)
    _CALLS = tl.constexpr(Counter.CALLS)
    _PREFETCHED = tl.constexpr(Counter.PREFETCHED)
    _TIMELY = tl.constexpr(Counter.PREFETCH_TIMELY)
    _VICTIMS = tl.constexpr(Counter.PREFETCH_VICTIMS)
    _EXPLORED = tl.constexpr(Counter.EXPLORED)
    _EXPLORED_PAID = tl.constexpr(Counter.EXPLORED_PAID)
    _RUNNERS_UP = tl.constexpr(Counter.RUNNERS_UP)
    _RUNNERS_UP_PAID = tl.constexpr(Counter.RUNNERS_UP_PAID)
    _WASTED = tl.constexpr(WASTED)
    _SEEN_WASTED = tl.constexpr(SEEN_WASTED)
    _N_OUTCOMES = tl.constexpr(N_OUTCOMES)
    _PACE_WINDOW = tl.constexpr(PACE_WINDOW)
    _PACE_COPY = tl.constexpr(PACE_COPY)
    _MIN_SUPPORT = tl.constexpr(MIN_SUPPORT)
    _MIN_PRECISION = tl.constexpr(MIN_PRECISION)
    _LOG2_DECAY = tl.constexpr(LOG2_DECAY)
    _EXPLORE_EVERY = tl.constexpr(EXPLORE_EVERY)

    @triton.jit
    def _transition_share(
        transitions_ptr, before_ptr, e, emask, E, E_before, keep, BE: tl.constexpr, BR: tl.constexpr
    ):
        """transition_scores: the share of the previous layer's routed experts' transitions that
        lead to each expert, kept for the `keep` likeliest (ties to the lower id)."""
        share = tl.zeros([BE], dtype=tl.float32)
        n_before = 0.0
        for r0 in range(0, E_before, BR):
            r = r0 + tl.arange(0, BR)
            rmask = r < E_before
            counts = tl.load(
                transitions_ptr + r[:, None] * E + e[None, :],
                mask=rmask[:, None] & emask[None, :],
                other=0.0,
            )
            before = tl.load(before_ptr + r, mask=rmask, other=0).to(tl.float32)
            rows = counts / tl.maximum(tl.sum(counts, axis=1), 1e-6)[:, None]
            share += tl.sum(rows * before[:, None], axis=0)
            n_before += tl.sum(before, axis=0)
        share = share / tl.maximum(n_before, 1.0)
        # share >= 0: its bits
        key = (share.to(tl.int32, bitcast=True).to(tl.int64) << _ID_BITS) | (_ID_MASK - e)
        key = tl.where(emask, key, -1)
        kth = tl.min(tl.where(e < keep, tl.sort(key, descending=True), 1 << 62))
        return tl.where(key >= kth, share, 0.0)

    @triton.jit
    def _combine(
        gate_ptr,
        routed_ptr,
        transitions_ptr,
        before_ptr,
        e,
        emask,
        E,
        E_before,
        keep,
        USE_GATE: tl.constexpr,
        USE_TEMPORAL: tl.constexpr,
        USE_TRANSITION: tl.constexpr,
        BE: tl.constexpr,
        BR: tl.constexpr,
    ):
        """predictors.combine: the gate's nominations first, then what the others back with enough
        support."""
        support = tl.zeros([BE], dtype=tl.float32)
        if USE_TEMPORAL:  # the experts this layer routed to last call
            temporal = tl.load(routed_ptr + e, mask=emask, other=0).to(tl.float32)
            support += temporal
        if USE_TRANSITION:
            transition = _transition_share(
                transitions_ptr, before_ptr, e, emask, E, E_before, keep, BE, BR
            )
            support += transition
        sources = tl.zeros([BE], dtype=tl.int32)
        score = tl.zeros([BE], dtype=tl.float32)
        if USE_TEMPORAL + USE_TRANSITION > 0:
            support = support / (USE_TEMPORAL + USE_TRANSITION)
            confident = support >= _MIN_SUPPORT
            score = tl.where(confident, support, 0.0)
            if USE_TEMPORAL:  # the bits differ, so + is |
                sources += tl.where(confident & (temporal > 0), _TEMPORAL, 0).to(tl.int32)
            if USE_TRANSITION:
                sources += tl.where(confident & (transition > 0), _TRANSITION, 0).to(tl.int32)
        if USE_GATE:
            gate = tl.load(gate_ptr + e, mask=emask, other=0.0)
            score = tl.where(gate > 0, 1 + gate, score)
            sources += tl.where(gate > 0, _GATE, 0).to(tl.int32)
        return score, sources

    @triton.jit
    def _opens(outcomes_ptr, tried, saved, decay, precision):
        """prefetch_gate.opens: the decayed (wasted, paid) estimate updated from the totals, and
        whether it opens."""
        k = tl.arange(0, 2)  # 0: wasted, 1: paid
        seen = tl.where(k == 0, tried - saved, saved).to(tl.float32)
        fresh_outcomes = tl.maximum(seen - tl.load(outcomes_ptr + _SEEN_WASTED + k), 0.0)
        estimate = tl.load(outcomes_ptr + _WASTED + k) * decay + fresh_outcomes
        tl.store(outcomes_ptr + _WASTED + k, estimate)
        tl.store(outcomes_ptr + _SEEN_WASTED + k, seen)
        wasted = tl.sum(tl.where(k == 0, estimate, 0.0), axis=0)
        used = tl.sum(tl.where(k == 1, estimate, 0.0), axis=0)
        return ((used + 1) >= precision * (used + wasted + 2)).to(tl.int32)

    @triton.jit
    def _gate(counters_ptr, outcomes_ptr, visited, calls, precision):
        """prefetch_gate.gate_prefetch's two decisions: whether prefetches, and runners-up, save
        enough misses."""
        # per call since the last
        decay = tl.exp2(tl.maximum(calls - visited, 1).to(tl.float32) * _LOG2_DECAY)
        # misses the prefetches saved: used by their call, less the hits they cost, and the
        # explorations that would have saved one
        saved = tl.load(counters_ptr + _TIMELY) - tl.load(counters_ptr + _VICTIMS)
        saved += tl.load(counters_ptr + _EXPLORED_PAID)
        tried = tl.load(counters_ptr + _PREFETCHED) + tl.load(counters_ptr + _EXPLORED)
        on = _opens(outcomes_ptr, tried, saved, decay, precision)
        tried_r, saved_r = (
            tl.load(counters_ptr + _RUNNERS_UP),
            tl.load(counters_ptr + _RUNNERS_UP_PAID),
        )
        runners_on = _opens(outcomes_ptr + _N_OUTCOMES, tried_r, saved_r, decay, precision)
        return on, runners_on

    @triton.jit
    def _prefetch_scores(
        before_ptr, E, E_before, keep,
        # the prefetch's state (PrefetchState, by name)
        gate_ptr, predicted_ptr, nominated_ptr, outcomes_ptr, visited_ptr, gate_open_ptr, transitions_ptr,
        # the target cache's (CACHE_STATE, by name)
        routed_ptr, expert_to_slot_ptr, counters_ptr, explored_ptr, runners_up_ptr, pace_ptr,
        USE_GATE: tl.constexpr, USE_TEMPORAL: tl.constexpr, USE_TRANSITION: tl.constexpr,
        BE: tl.constexpr, BR: tl.constexpr,
    ):  # fmt: skip
        e = tl.arange(0, BE)
        emask = e < E
        score, sources = _combine(
            gate_ptr, routed_ptr, transitions_ptr, before_ptr, e, emask, E, E_before, keep,
            USE_GATE, USE_TEMPORAL, USE_TRANSITION, BE, BR,
        )  # fmt: skip
        # the prefetch gate: off while most recent prefetches were wasted; a closed one's explorer
        # is scored, not copied
        calls, visited = tl.load(counters_ptr + _CALLS), tl.load(visited_ptr)
        # int64
        copy_ns, window_ns = tl.load(pace_ptr + _PACE_COPY), tl.load(pace_ptr + _PACE_WINDOW)
        copy, window = copy_ns.to(tl.float32), window_ns.to(tl.float32)
        measured = (copy > 0) & (window > 0)
        precision = tl.where(
            measured, tl.maximum(copy / (copy + window), _MIN_PRECISION), _MIN_PRECISION
        )
        on, runners_on = _gate(counters_ptr, outcomes_ptr, visited, calls, precision)
        resident = tl.load(expert_to_slot_ptr + e, mask=emask, other=0) >= 0
        fresh = tl.where(resident, 0.0, score)
        fresh = tl.where(emask, fresh, -1.0)
        # first of the maxima
        likeliest = e == tl.min(tl.where(fresh == tl.max(fresh, axis=0), e, BE), axis=0)
        # the likeliest whose copies start within the window (fresh >= 0 sorts as its bits; ties to
        # the lower id), past the first: the runners-up ranks_in_window
        fit = tl.where(measured, (window_ns + copy_ns - 1) // tl.maximum(copy_ns, 1), keep)
        fit = tl.minimum(tl.maximum(fit, 1), keep)
        key = tl.where(
            emask, (fresh.to(tl.int32, bitcast=True).to(tl.int64) << _ID_BITS) | (_ID_MASK - e), -1
        )
        kth = tl.min(tl.where(e < fit, tl.sort(key, descending=True), 1 << 62))
        runners_up = (key >= kth) & (fresh > 0) & ~likeliest
        tl.store(runners_up_ptr + e, runners_up, mask=emask)
        # explore_period's
        stride = tl.where(measured, tl.maximum(copy_ns // tl.maximum(window_ns, 1), 1), 1)
        period = _EXPLORE_EVERY * stride
        explore = (
            (on == 0)
            & (calls > 0)
            & (calls // period != visited // period)
            & (tl.max(fresh, axis=0) > 0)
        )
        tl.store(explored_ptr, tl.sum(tl.where(likeliest, e, 0), axis=0).to(tl.int64), mask=explore)
        # runners-up while they pay
        admit = (resident | likeliest).to(tl.int32) + runners_up.to(tl.int32) * runners_on
        score = tl.where((admit * on) > 0, score, 0.0)
        tl.store(predicted_ptr + e, score, mask=emask)
        tl.store(nominated_ptr + e, sources.to(tl.int8), mask=emask)
        tl.store(visited_ptr, calls)
        tl.store(gate_open_ptr, on)


def prefetch_scores_triton(
    sources: int, routed_before: torch.Tensor | None, keep: int, s: CacheState, p: PrefetchState
) -> None:
    """The target layer's combined and gated scores into `p.predicted` [E] and their sources into
    `p.nominated` [E], for the predictors in the bits `sources` (GATE, TEMPORAL, TRANSITION): the
    gate's scores from `p.gate`, temporal from the target's `s.routed`, transition from
    `routed_before` [E'] and `p.transitions` [E', E]."""
    E = p.predicted.shape[0]
    transition = bool(sources & TRANSITION)
    _prefetch_scores[(1,)](
        routed_before if transition else s.routed, E, routed_before.shape[0] if transition else 0, keep,
        **pointers(p, PrefetchState._fields), **pointers(s, CACHE_STATE),
        USE_GATE=bool(sources & GATE), USE_TEMPORAL=bool(sources & TEMPORAL), USE_TRANSITION=transition,
        BE=triton.next_power_of_2(E), BR=16, num_warps=4,
    )  # fmt: skip
