"""The cache's decisions (cache/algorithm.py) on their own: invariants after any sequence of `ensure` calls
(hypothesis), victims, counters, waves, and prefetched slots counted by the predictor that nominated them."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe.cache import algorithm
from asyncmoe.cache.expert_cache import ExpertCache, num_waves
from asyncmoe.cache.policies import POLICIES
from asyncmoe.cache.state import COUNTERS, GATE, TEMPORAL, TRANSITION, WAVE_ELSEWHERE, Counter


def make_cache(E: int, C: int, policy: str) -> ExpertCache:
    g = torch.Generator().manual_seed(E * 100 + C)
    hosts = {"w": torch.randn(E, 3, 2, generator=g), "b": torch.randn(E, 5, generator=g)}
    return ExpertCache(hosts, C, policy)


def ensure(cache: ExpertCache, ids: torch.Tensor, wave: int) -> torch.Tensor:
    return algorithm.ensure(ids, wave, cache.policy, cache.state, cache.hosts, cache.slots)


def check_invariants(cache: ExpertCache, ids: torch.Tensor, slots: torch.Tensor) -> None:
    E, C = cache.num_experts, cache.num_slots
    e2s, s2e = cache.expert_to_slot[:E], cache.slot_to_expert
    # the two tables are inverse on resident experts, and at most C experts are resident
    for c in range(C):
        if s2e[c] >= 0:
            assert e2s[s2e[c]] == c
    for e in range(E):
        if e2s[e] >= 0:
            assert s2e[e2s[e]] == e
    assert (e2s >= 0).sum() <= C
    # every resident expert's slots hold exactly its host weights
    for host, slot in zip(cache.hosts, cache.slots, strict=True):
        for c in range(C):
            if s2e[c] >= 0:
                assert torch.equal(slot[c], host[s2e[c]])
    # every pair served by this wave points at the slot holding its expert
    served = slots >= 0
    assert torch.equal(s2e[slots[served]], ids[served])


routing = st.integers(4, 24).flatmap(
    lambda E: st.tuples(
        st.just(E),
        st.integers(1, 4).flatmap(lambda k: st.tuples(st.just(k), st.integers(k, E))),
        st.sampled_from(sorted(POLICIES)),
        st.lists(st.integers(1, 6), min_size=1, max_size=6),  # tokens per call
        st.integers(0, 2**31 - 1),
    )
)


@settings(max_examples=60, deadline=None)
@given(routing)
def test_invariants_after_any_sequence_of_calls(case):
    E, (k, C), policy, calls, seed = case
    cache = make_cache(E, C, policy)
    g = torch.Generator().manual_seed(seed)
    for T in calls:
        # top-k routing: k distinct experts per token, skewed towards low ids like real routers
        scores = torch.rand(T, E, generator=g) * torch.linspace(2, 1, E)
        ids = scores.topk(k, dim=-1).indices
        before = cache.counters.clone()
        for wave in range(num_waves(T * k, C, E)):
            slots = ensure(cache, ids, wave)
            check_invariants(cache, ids, slots)
        served_once = cache.counters - before
        assert served_once[Counter.HITS] + served_once[Counter.MISSES] == ids.unique().numel()
        if num_waves(T * k, C, E) == 1:  # the single path serves every pair of the call
            assert (slots >= 0).all()


def test_victims_are_never_experts_needed_now():
    cache = make_cache(E=8, C=3, policy="lru")
    for ids in ([[0, 1, 2]], [[3, 4, 5]], [[0, 6, 7]], [[5, 6, 7]]):
        ids = torch.tensor(ids)
        slots = ensure(cache, ids, 0)
        assert torch.equal(cache.slot_to_expert[slots], ids)


def test_hits_misses_and_bytes():
    cache = make_cache(E=8, C=4, policy="lru")
    ensure(cache, torch.tensor([[0, 1], [1, 2]]), 0)  # 3 misses
    ensure(cache, torch.tensor([[1, 2]]), 0)  # 2 hits
    ensure(cache, torch.tensor([[3, 4]]), 0)  # 2 misses, 1 eviction (the LRU expert 0)
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    assert (c["calls"], c["hits"], c["misses"], c["evictions"]) == (3, 2, 5, 1)
    assert c["bytes_h2d"] == 5 * cache.expert_bytes
    assert cache.expert_to_slot[0] == -1


def test_another_ranks_experts_need_nothing_here():
    """Expert parallelism hands each rank its local expert ids and id E for pairs routed to another rank's experts
    (transformers' sentinel): those pairs get slot -1, copy nothing and count as neither hit nor miss."""
    cache = make_cache(E=8, C=4, policy="lru")
    slots = ensure(cache, torch.tensor([[0, 8], [8, 8], [8, 2]]), 0)
    assert (slots[:, :] >= 0).tolist() == [[True, False], [False, False], [False, True]]
    assert cache.slot_to_expert[slots[0, 0]] == 0 and cache.slot_to_expert[slots[2, 1]] == 2
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    assert (c["hits"], c["misses"], c["bytes_h2d"]) == (0, 2, 2 * cache.expert_bytes)
    assert cache.routed.tolist() == [True, False, True, False, False, False, False, False]
    assert (
        ensure(cache, torch.tensor([[8, 8]]), 0) == -1
    ).all()  # a call with none of this rank's experts


def test_experts_computed_elsewhere_are_routed_but_never_copied():
    """The hybrid's CPU computes experts 3 and 5 of this call: `routed` (the temporal predictor's input) and the
    nominations' outcomes count them, but they get slot -1, no copy, and count as neither hit nor miss here (the
    split counts them); the next call's temporal prefetch can then admit them."""
    cache = make_cache(E=8, C=4, policy="lru")
    ensure(cache, torch.tensor([[1, 2]]), 0)  # 1 and 2 resident
    cache.explored.fill_(5)  # a closed gate nominated 5 last call, with no copy
    elsewhere = torch.zeros(8, dtype=torch.bool)
    elsewhere[[3, 5]] = True
    ids = torch.tensor([[1, 3], [5, 6]])
    slots = algorithm.ensure(
        ids, 0, cache.policy, cache.state, cache.hosts, cache.slots, elsewhere=elsewhere
    )
    assert (slots >= 0).tolist() == [[True, False], [False, True]]
    check_invariants(cache, ids, slots)
    assert cache.routed.nonzero().flatten().tolist() == [1, 3, 5, 6]
    assert (cache.expert_to_slot[[3, 5]] == -1).all()
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    # 3 and 5: neither hit nor miss here
    assert (c["hits"], c["misses"], c["bytes_h2d"]) == (1, 2 + 1, 3 * cache.expert_bytes)
    assert (c["explored"], c["explored_paid"]) == (1, 1)  # 5 was routed: a copy would have paid
    temporal = cache.routed.float()
    algorithm.prefetch(temporal, temporal.to(torch.int8) * TEMPORAL, 2, "lru", cache.state, cache.hosts,
                       cache.slots)  # fmt: skip
    assert (cache.expert_to_slot[[3, 5]] >= 0).all()


def test_waves_cover_more_experts_than_slots():
    cache = make_cache(E=12, C=3, policy="lfru")
    ids = torch.arange(12).view(6, 2)  # 12 distinct experts, 3 slots: 4 waves
    seen = torch.zeros(6, 2, dtype=torch.bool)
    for wave in range(num_waves(12, 3, 12)):
        slots = ensure(cache, ids, wave)
        check_invariants(cache, ids, slots)
        assert not (seen & (slots >= 0)).any(), "a pair was served by two waves"
        seen |= slots >= 0
    assert seen.all(), "every pair is served by exactly one wave"


def test_waves_serve_resident_experts_first():
    """A call needing more experts than slots keeps what is resident: it is served in wave 0, without a copy,
    before later waves evict it (by expert id alone, the last call's last wave, 9-11, was evicted by waves 0-2
    and copied back by wave 3)."""
    cache = make_cache(E=12, C=3, policy="lru")
    ids = torch.arange(12).view(6, 2)  # 12 distinct experts, 3 slots: 4 waves
    for call in range(2):
        before = cache.counters.clone()
        for wave in range(num_waves(12, 3, 12)):
            slots = ensure(cache, ids, wave)
            check_invariants(cache, ids, slots)
            if call == 1 and wave == 0:
                assert torch.equal(ids[slots >= 0].sort().values, torch.tensor([9, 10, 11]))
        got = cache.counters - before
        assert (got[Counter.HITS].item(), got[Counter.MISSES].item()) == (
            (0, 12) if call == 0 else (3, 9)
        )


def test_wave_plan_ranks_resident_experts_first():
    """Wave 0 writes each needed expert's wave to `wave_of` (resident ones first, each group in id order, C a
    wave); a later wave reads it, whatever the cache holds by then."""
    resident = torch.tensor([False, False, True, False, True, False])
    wave_of = torch.full((6,), -1)
    ids = torch.tensor([5, 4, 1, 2, 0])
    need, now, later = algorithm.wave_plan(ids, 0, 2, resident, wave_of)
    assert wave_of.tolist() == [1, 1, 0, -1, 0, 2]
    assert need.tolist() == [True, True, True, False, True, True]
    assert now.tolist() == [False, False, True, False, True, False] and later.tolist() == [
        1,
        1,
        0,
        0,
        0,
        1,
    ]
    _, now, later = algorithm.wave_plan(ids, 1, 2, torch.zeros(6, dtype=torch.bool), wave_of)
    assert wave_of.tolist() == [1, 1, 0, -1, 0, 2]  # kept from wave 0
    assert now.tolist() == [True, True, False, False, False, False] and later.tolist() == [
        0,
        0,
        0,
        0,
        0,
        1,
    ]


def test_wave_plan_ranks_only_the_experts_computed_here():
    """The experts `elsewhere` computes are routed (`need`) but in no wave (WAVE_ELSEWHERE): the
    others fill the waves as if alone, so 2, 0 and 5 take waves 0, 0 and 1 of 2 slots."""
    resident = torch.tensor([False, False, True, False, True, False])
    wave_of = torch.full((6,), -1)
    ids = torch.tensor([5, 4, 1, 2, 0])
    elsewhere = torch.tensor([False, True, False, True, True, False])
    need, now, later = algorithm.wave_plan(ids, 0, 2, resident, wave_of, elsewhere)
    assert wave_of.tolist() == [0, WAVE_ELSEWHERE, 0, -1, WAVE_ELSEWHERE, 1]
    assert need.tolist() == [True, True, True, False, True, True]
    assert now.nonzero().flatten().tolist() == [0, 2] and later.nonzero().flatten().tolist() == [5]


def test_prefetch_hits_are_counted_by_nominator():
    cache = ExpertCache({"w": torch.randn(8, 3)}, 3, "lru")
    predicted = torch.tensor([0, 0.9, 0, 0, 0.2, 0.5, 0, 0])
    nominated = torch.tensor([0, GATE | TEMPORAL, 0, 0, TRANSITION, GATE, 0, 0], dtype=torch.int8)
    algorithm.prefetch(
        predicted, nominated, 2, "lru", cache.state, cache.hosts, cache.slots
    )  # admits 1 and 5
    assert sorted(e for e in cache.slot_to_expert.tolist() if e >= 0) == [1, 5]
    assert torch.equal(cache.slot_w[cache.expert_to_slot[[1, 5]]], cache.host_w[[1, 5]])
    assert cache.source[cache.expert_to_slot[[1, 5]]].tolist() == [
        GATE | TEMPORAL,
        GATE,
    ]  # tagged by their nominators
    ensure(cache, torch.tensor([[1, 2]]), 0)  # 1 was prefetched, 2 misses
    ensure(
        cache, torch.tensor([[1, 3]]), 0
    )  # 1 again: a plain hit now; 3 evicts the unused prefetch of 5
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    prefetched = [
        c[n]
        for n in ("prefetched", "prefetch_hits", "hits_gate", "hits_temporal", "hits_transition")
    ]
    assert prefetched == [2, 1, 1, 1, 0]
    assert (c["hits"], c["misses"], c["wasted"]) == (2, 2, 1)
    assert c["bytes_h2d"] == 4 * cache.expert_bytes


def test_prefetch_keeps_resident_predictions_and_spends_the_budget_elsewhere():
    """A resident expert the predictor wants needs no copy: the budget goes to the likeliest non-resident ones,
    and the resident one is not evicted for their sake while another slot can go."""
    cache = ExpertCache({"w": torch.randn(8, 3)}, 3, "lru")
    ensure(cache, torch.tensor([[0, 1, 2]]), 0)  # the slots full, all used by one call
    predicted = torch.tensor([0.9, 0, 0, 0.8, 0, 0, 0, 0])  # 0 is resident, 3 is not
    nominated = torch.full((8,), GATE, dtype=torch.int8)
    algorithm.prefetch(predicted, nominated, 2, "lru", cache.state, cache.hosts, cache.slots)
    resident = sorted(e for e in cache.slot_to_expert.tolist() if e >= 0)
    assert 0 in resident and 3 in resident and len(resident) == 3
    c = dict(zip(COUNTERS, cache.counters.tolist(), strict=True))
    assert (c["prefetched"], c["evictions"]) == (1, 1)
    assert (
        cache.evicted_at[({1, 2} - set(resident)).pop()] == cache.clock
    )  # the victim, for the victims counter


def test_admit_books_without_copying():
    """`admit` plans and books the admission in the tables; the caller copies: the slots are untouched."""
    cache = ExpertCache({"w": torch.randn(8, 3)}, 3, "lru")
    want = torch.zeros(8, dtype=torch.bool)
    want[[2, 6]] = True
    before = cache.slot_w.clone()
    src, dst, valid, count, gone, wasted = algorithm.admit(
        want, torch.zeros_like(want), 3, POLICIES["lru"], cache.state
    )
    assert int(count) == 2 and valid.tolist() == [True, True, False] and src[:2].tolist() == [2, 6]
    assert (
        cache.slot_to_expert[dst[:2]].tolist() == [2, 6]
        and cache.expert_to_slot[[2, 6]].tolist() == dst[:2].tolist()
    )
    assert gone.tolist() == [8, 8, 8] and int(wasted) == 0  # nothing evicted: E marks none
    assert not cache.used.any()  # admitted, not yet used
    assert torch.equal(cache.slot_w, before)


def test_markov_keeps_the_expert_that_follows():
    """Experts called in a cycle 0, 1, 2 over two slots: LFRU, like LRU, evicts the expert needed next and
    misses every call; Markov learns which expert follows which and keeps it, missing every other call once it
    has seen the cycle (Belady's misses)."""
    misses = {}
    for policy in ("lfru", "markov"):
        cache = make_cache(E=6, C=2, policy=policy)
        for t in range(30):
            if t == 12:
                before = cache.counters[Counter.MISSES].item()
            ensure(cache, torch.tensor([[t % 3]]), 0)
        misses[policy] = cache.counters[Counter.MISSES].item() - before
    assert misses == {"lfru": 18, "markov": 9}
