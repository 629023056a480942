"""The cache algorithm on its own: invariants after any sequence of `ensure` calls (hypothesis)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe import ops
from asyncmoe.cache.expert_cache import COUNTERS, ExpertCache, num_waves
from asyncmoe.cache.policies import POLICIES

HITS, MISSES = COUNTERS.index("hits"), COUNTERS.index("misses")


def make_cache(E: int, C: int, policy: str) -> ExpertCache:
    g = torch.Generator().manual_seed(E * 100 + C)
    hosts = {"w": torch.randn(E, 3, 2, generator=g), "b": torch.randn(E, 5, generator=g)}
    return ExpertCache(hosts, C, policy)


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
    for host, slot in zip(cache.hosts, cache.slots):
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
            slots = ops.ensure(cache, ids, wave)
            check_invariants(cache, ids, slots)
        served_once = cache.counters - before
        assert served_once[HITS] + served_once[MISSES] == ids.unique().numel()
        if num_waves(T * k, C, E) == 1:  # the single path serves every pair of the call
            assert (slots >= 0).all()


def test_victims_are_never_experts_needed_now():
    cache = make_cache(E=8, C=3, policy="lru")
    for ids in ([[0, 1, 2]], [[3, 4, 5]], [[0, 6, 7]], [[5, 6, 7]]):
        ids = torch.tensor(ids)
        slots = ops.ensure(cache, ids, 0)
        assert torch.equal(cache.slot_to_expert[slots], ids)


def test_hits_misses_and_bytes():
    cache = make_cache(E=8, C=4, policy="lru")
    ops.ensure(cache, torch.tensor([[0, 1], [1, 2]]), 0)  # 3 misses
    ops.ensure(cache, torch.tensor([[1, 2]]), 0)  # 2 hits
    ops.ensure(cache, torch.tensor([[3, 4]]), 0)  # 2 misses, 1 eviction (the LRU expert 0)
    c = dict(zip(COUNTERS, cache.counters.tolist()))
    assert (c["calls"], c["hits"], c["misses"], c["evictions"]) == (3, 2, 5, 1)
    assert c["bytes_h2d"] == 5 * cache.expert_bytes
    assert cache.expert_to_slot[0] == -1


def test_waves_cover_more_experts_than_slots():
    cache = make_cache(E=12, C=3, policy="lfru")
    ids = torch.arange(12).view(6, 2)  # 12 distinct experts, 3 slots: 4 waves
    seen = torch.zeros(6, 2, dtype=torch.bool)
    for wave in range(num_waves(12, 3, 12)):
        slots = ops.ensure(cache, ids, wave)
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
            slots = ops.ensure(cache, ids, wave)
            check_invariants(cache, ids, slots)
            if call == 1 and wave == 0:
                assert torch.equal(ids[slots >= 0].sort().values, torch.tensor([9, 10, 11]))
        got = cache.counters - before
        assert (got[HITS].item(), got[MISSES].item()) == ((0, 12) if call == 0 else (3, 9))


def test_clear_returns_the_cache_as_built():
    """After `clear`, every buffer but the weights equals a fresh cache's, and the same calls count the same."""
    calls = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 4]]), torch.tensor([[0, 5]])]
    used, fresh = make_cache(E=8, C=4, policy="lfru"), make_cache(E=8, C=4, policy="lfru")
    for ids in calls:
        ops.ensure(used, ids, 0)
    used.clear()
    weights = {f"{kind}_{n}" for n in used.names for kind in ("host", "slot")}
    for name, buf in fresh.named_buffers():
        if name not in weights:
            assert torch.equal(getattr(used, name), buf), name
    for ids in calls:
        assert torch.equal(ops.ensure(used, ids, 0), ops.ensure(fresh, ids, 0))
    assert torch.equal(used.counters, fresh.counters)
