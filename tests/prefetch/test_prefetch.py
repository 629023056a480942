"""One prefetch into a target layer (prefetch/prefetch.py), the reference end to end: the predictors' scores
combined into `predicted` and `nominated`, gated, the likeliest non-resident experts admitted and copied, tagged
with their nominators, and their hits counted by them."""

import pytest
import torch

from asyncmoe.cache import algorithm
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.state import COUNTERS, GATE, TEMPORAL, TRANSITION, Counter
from asyncmoe.prefetch.predictors import combine, temporal_scores, transition_scores
from asyncmoe.prefetch.prefetch import Request, predict_and_prefetch
from asyncmoe.prefetch.state import PrefetchBuffers

E, E_BEFORE, C = 8, 4, 5


def target() -> tuple[ExpertCache, PrefetchBuffers]:
    """A target with experts 0 and 1 resident (routed last call), and transitions 0 -> 6, 1 -> 7 before it."""
    cache = ExpertCache(
        {"w": torch.randn(E, 3, generator=torch.Generator().manual_seed(0))}, C, "lru"
    )
    p = PrefetchBuffers(E, cache.expert_to_slot.device, E_BEFORE)
    algorithm.ensure(torch.tensor([[0, 1]]), 0, "lru", cache.state, cache.hosts, cache.slots)
    p.transitions[0, 6] = p.transitions[1, 7] = 5.0
    p.gate.copy_(torch.tensor([0, 0, 0, 0.6, 0, 0.3, 0, 0]))
    return cache, p


def resident(cache) -> set[int]:
    return {e for e in cache.slot_to_expert.tolist() if e >= 0}


@pytest.mark.parametrize(
    "bits, budget, admitted",
    [
        (GATE, 1, {3}),
        (GATE, 4, {3, 5}),
        (GATE | TRANSITION, 2, {3, 5}),
        (GATE | TRANSITION, 3, {3, 5, 6}),
        (TRANSITION, 2, {6}),
        (TEMPORAL, 2, set()),
        (GATE | TEMPORAL | TRANSITION, 3, {3, 5, 6}),
    ],
)
def test_the_combined_prediction_decides_what_is_admitted(bits, budget, admitted):
    """The gate's nominations (3, then 5) come first; transition backs 6 (expert 0 was routed before, and all of
    its transitions lead to 6); temporal backs 0 and 1, resident already: nothing to copy. Beside temporal,
    transition's 6 has a mean support of 0.5, above MIN_SUPPORT: still admitted."""
    cache, p = target()
    before = torch.tensor([True, False, False, False])
    routed_before = before if bits & TRANSITION else None
    predict_and_prefetch(
        Request(bits, budget, "lru"), cache.state, p.state, routed_before, cache.hosts, cache.slots
    )
    parts = [(GATE, p.gate)] if bits & GATE else []
    if bits & TEMPORAL:
        parts.append((TEMPORAL, temporal_scores(cache.routed)))
    if bits & TRANSITION:
        parts.append((TRANSITION, transition_scores(before, p.transitions, budget)))
    score, nominated = combine(parts)
    # the gate is open (no evidence yet): the prediction is the combination's, for the resident experts (kept from
    # eviction) and the `budget` likeliest others; the rest are not admitted
    kept = torch.zeros_like(score, dtype=torch.bool)
    kept[list({0, 1} | admitted)] = True
    assert torch.equal(p.predicted, score * kept) and torch.equal(p.nominated, nominated)
    assert resident(cache) == {0, 1} | admitted
    for e in admitted:  # copied, and tagged with its nominators
        slot = cache.expert_to_slot[e]
        assert (
            torch.equal(cache.slot_w[slot], cache.host_w[e])
            and cache.source[slot] == nominated[e] != 0
        )
    assert cache.counters[Counter.PREFETCHED] == len(admitted)


def test_hits_of_a_prefetch_are_counted_by_its_nominators():
    cache, p = target()
    before = torch.tensor([True, False, False, False])
    predict_and_prefetch(
        Request(GATE | TRANSITION, 3, "lru"), cache.state, p.state, before, cache.hosts, cache.slots
    )
    algorithm.ensure(torch.tensor([[3, 6]]), 0, "lru", cache.state, cache.hosts, cache.slots)
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    counted = [
        c[n] for n in ("prefetch_hits", "hits_gate", "hits_transition", "prefetch_timely", "misses")
    ]
    assert counted == [2, 1, 1, 2, 2]


def test_a_closed_gate_admits_nothing():
    """Wasted prefetches on record, a stride-1 pace, a non-exploring call: the prediction is zeroed, no copy."""
    cache, p = target()
    cache.counters[Counter.PREFETCHED] = 50  # none of them saved a miss
    predict_and_prefetch(
        Request(GATE, 2, "lru"), cache.state, p.state, None, cache.hosts, cache.slots
    )
    assert not (p.predicted > 0).any() and resident(cache) == {0, 1}
    assert cache.counters[Counter.PREFETCHED] == 50
    assert p.nominated.tolist() == [0, 0, 0, GATE, 0, GATE, 0, 0]  # what was nominated is kept
