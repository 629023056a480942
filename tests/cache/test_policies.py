"""Each policy (cache/policies.py) evicts the expert it says it does; prefetched-but-unused slots go first."""

import pytest
import torch

from asyncmoe.cache import ops
from asyncmoe.cache.algorithm import admit
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.policies import get_policy


def cache_with(policy: str, E=8, C=3) -> ExpertCache:
    return ExpertCache({"w": torch.randn(E, 4)}, C, policy)


def run(cache, *calls):
    for ids in calls:
        ops.ensure(cache, torch.tensor([ids]), 0)


def resident(cache) -> set[int]:
    return {e for e in cache.slot_to_expert.tolist() if e >= 0}


@pytest.mark.parametrize(
    "policy, evicted",
    [
        ("lru", 1),  # 0 was used last call, 1 longest ago
        ("fifo", 0),  # 0 was admitted first, however often used since
        ("lfu", 1),  # 0 used 4 times, 2 twice, 1 once
        ("lfru", 1),
        ("markov", 1),  # nothing has followed 3 yet: LFRU decides
    ],
)
def test_victim_by_policy(policy, evicted):
    cache = cache_with(policy)
    run(cache, [0], [1], [2], [0, 2], [0], [0])
    run(cache, [3])
    assert resident(cache) == {0, 1, 2, 3} - {evicted}


def test_lfu_prefers_frequency_lru_prefers_recency():
    calls = [[0], [0], [0], [0], [1], [2]]  # 0 hot long ago, 1 and 2 used once recently
    lru, lfu = cache_with("lru"), cache_with("lfu")
    run(lru, *calls, [3])
    run(lfu, *calls, [3])
    assert 0 not in resident(lru)
    assert 0 in resident(lfu)


def test_prefetched_unused_slots_are_evicted_before_used_ones():
    cache = cache_with("lru")
    run(cache, [0], [1])
    # admit expert 5 as a prefetch would: resident but not yet used
    want = torch.zeros(8, dtype=torch.bool)
    want[5] = True
    nothing = torch.zeros(8, dtype=torch.bool)
    admit(want, nothing, 1, get_policy("lru"), cache.state)
    assert resident(cache) == {0, 1, 5}
    run(cache, [6])  # 5 is the newest by clock, yet unused: it goes, not 0 (the LRU used expert)
    assert resident(cache) == {0, 1, 6}


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown cache policy 'mru'.*fifo.*lfru.*lfu.*lru"):
        cache_with("mru")
