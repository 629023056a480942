"""The prefetch gate: per target layer, stop prefetching while its prefetches do not save misses.

A copy that is never used still holds the link and the SMs, and the layer's `ensure` waits for it,
so a layer whose predictions miss (a random-weight router, routing replayed from a trace the gate
predictor cannot see) must stop. The evidence is a decayed count of the prefetches that saved a miss
(used by the very call they were fetched for, less any expert they evicted that the same call
needed) against the rest, fed by the growth of the layer's counters. The gate opens while the share
that saved a miss is at least copy / (copy + window): a used prefetch hides at most the compute
beside it (the window), a wasted one holds the link for a whole copy; never below MIN_PRECISION. A
closed layer still explores: every `explore_period` calls it nominates its likeliest prediction, and
the call's `ensure` scores it as a prefetch that was never copied
(docs/decisions.md#exploring-without-a-copy), so the estimate can recover at no cost to the link.
With a budget above one, the nominations past the likeliest (the runners-up) are gated apart on
their own evidence, which every call scores whether they were copied or not: a second guess is often
much worse than the first, and while it is it must not close the gate on the first. And only as many
copies as start within the window are made (`ranks_in_window`): one that starts after the compute it
would hide behind has ended delays the target layer's own misses, right or wrong. Why each number:
docs/decisions.md#prefetch-gate (the anchors below are in that file).

`gate_prefetch` is the reference; the fused kernel (`prefetch/prefetch_scores.py`) runs the same
rule.
"""

from __future__ import annotations

import math

import torch

from ..cache.state import PACE_COPY, PACE_WINDOW, CacheState, Counter
from .state import PAID, PREFETCHES, RUNNERS_UP, SEEN_PAID, SEEN_WASTED, WASTED, PrefetchState

# a wasted copy costs about what a used one saves where a copy fits the window (#gate-precision)
MIN_PRECISION = 0.5
OUTCOME_DECAY = 0.98  # per call: the estimate follows the last ~50 calls (#gate-precision)
LOG2_DECAY = math.log2(OUTCOME_DECAY)
# a gated layer still scores its likeliest expert every 32nd call, times the stride (#exploring)
EXPLORE_EVERY = 32


def gate_precision(pace: torch.Tensor) -> torch.Tensor:
    """The share of prefetches that must save a miss for the gate to stay open: copy / (copy +
    window) from `pace`, never below MIN_PRECISION, which is also the answer while the pace is
    unmeasured (the CPU)."""
    copy, window = pace[PACE_COPY].float(), pace[PACE_WINDOW].float()
    measured = (copy > 0) & (window > 0)
    return torch.where(measured, (copy / (copy + window)).clamp(min=MIN_PRECISION), MIN_PRECISION)


def explore_period(pace: torch.Tensor) -> torch.Tensor:
    """Every how many calls a gated layer explores: EXPLORE_EVERY, times copy // window where a copy
    outlasts the compute it hides behind, so that exploring costs at most ~1/EXPLORE_EVERY of the
    compute however long a copy. Unmeasured (the CPU): a stride of 1."""
    copy, window = pace[PACE_COPY], pace[PACE_WINDOW]
    stride = torch.where((copy > 0) & (window > 0), (copy // window.clamp(min=1)).clamp(min=1), 1)
    return EXPLORE_EVERY * stride


def ranks_in_window(pace: torch.Tensor, budget: int) -> torch.Tensor:
    """How many of a prefetch's copies, made one after another, start before the window ends: the
    ranks r with (r - 1) * copy < window, ceil(window / copy), at least one and at most `budget`.
    Unmeasured (the CPU): `budget`."""
    copy, window = pace[PACE_COPY], pace[PACE_WINDOW]
    fit = torch.where((copy > 0) & (window > 0), (window + copy - 1) // copy.clamp(min=1), budget)
    return fit.clamp(1, budget)


def gate_prefetch(s: CacheState, p: PrefetchState, keep: int) -> None:
    """Zero the target's predictions `p.predicted` (so nothing is admitted) while its prefetches are
    mostly wasted, and write the decision to `p.gate_open`. A closed gate explores: on an exploring
    call its likeliest non-resident expert goes to `s.explored`, which the call's `ensure` scores
    (would it have saved a miss?) with no copy. Calls are counted by the `calls` counter (the clock
    counts waves) and the evidence decays by the calls since the last prefetch (`p.visited`), so a
    step that skipped prefetch leaves both as they would be; a closed gate explores on its first
    prefetch since `calls` passed a multiple of the period. A call with none counted yet (after a
    stats reset) does not explore. Of the `keep` likeliest non-resident experts, those past the
    first whose copies start within the window (`ranks_in_window`) go to `s.runners_up` for `ensure`
    to score, and are admitted only while their own evidence holds the gate open too; the others are
    not admitted."""
    c = s.counters
    calls, visited = c[Counter.CALLS], p.visited[0]
    # used by their call, less the hits they cost
    saved = c[Counter.PREFETCH_TIMELY] - c[Counter.PREFETCH_VICTIMS]
    saved = saved + c[Counter.EXPLORED_PAID]  # and the explorations that would have saved a miss
    precision = gate_precision(s.pace)
    on = opens(
        p.outcomes[PREFETCHES],
        c[Counter.PREFETCHED] + c[Counter.EXPLORED],
        saved,
        calls - visited,
        precision,
    )
    runners_on = opens(
        p.outcomes[RUNNERS_UP],
        c[Counter.RUNNERS_UP],
        c[Counter.RUNNERS_UP_PAID],
        calls - visited,
        precision,
    )
    resident = s.expert_to_slot[:-1] >= 0
    fresh = p.predicted.masked_fill(resident, 0)
    # ties: lower expert id first, as admission breaks them
    order = torch.argsort(-fresh, stable=True)
    rank = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )
    runners_up = (rank > 0) & (rank < ranks_in_window(s.pace, keep)) & (fresh > 0)
    period = explore_period(s.pace)
    explore = ~on & (calls > 0) & (calls // period != visited // period) & (fresh.max() > 0)
    s.explored.copy_(torch.where(explore, order[0], s.explored))
    s.runners_up.copy_(runners_up)
    p.predicted.mul_((on & (resident | (rank == 0) | (runners_up & runners_on))).float())
    p.visited.copy_(calls)
    p.gate_open.copy_(on)


def opens(outcomes: torch.Tensor, tried, saved, calls, precision) -> torch.Tensor:
    """Whether the share of `tried` (a counter's total) that `saved` a miss, decayed over the
    `calls` since the last update, reaches `precision`; `outcomes` [4] (WASTED .. SEEN_PAID) keeps
    the estimate and the totals it last read. With no evidence yet: open."""
    seen = torch.stack([tried - saved, saved]).float()  # (wasted, paid)
    fresh = (seen - outcomes[SEEN_WASTED : SEEN_PAID + 1]).clamp(min=0)
    outcomes[WASTED : PAID + 1].mul_(decay(calls)).add_(fresh)
    outcomes[SEEN_WASTED : SEEN_PAID + 1].copy_(seen)
    wasted, used = outcomes[WASTED], outcomes[PAID]
    return (used + 1) >= precision * (used + wasted + 2)


def decay(calls: torch.Tensor) -> torch.Tensor:
    """OUTCOME_DECAY per call over `calls` calls, at least one (a stats reset sets `calls` back)."""
    return torch.exp2(calls.clamp(min=1).float() * LOG2_DECAY)
