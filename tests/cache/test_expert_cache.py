"""One layer's cache buffers (cache/expert_cache.py): `state` names them, `clear` resets them, and the cache
refuses to be moved or cast."""

import pytest
import torch

import asyncmoe
from asyncmoe.cache import ops
from asyncmoe.cache.expert_cache import ExpertCache, expert_bytes, num_waves
from asyncmoe.cache.state import COUNTERS, TIMER_SIZE, CacheState, Counter

from models import tiny


def make_cache(E: int, C: int, policy: str, **kw) -> ExpertCache:
    g = torch.Generator().manual_seed(E * 100 + C)
    hosts = {"w": torch.randn(E, 3, 2, generator=g), "b": torch.randn(E, 5, generator=g)}
    return ExpertCache(hosts, C, policy, **kw)


def test_state_fields_are_the_buffers():
    """`state` is the cache's own buffers, by name, in CacheState's order: what the ops mutate is the cache."""
    cache = make_cache(E=6, C=2, policy="lru")
    state = cache.state
    assert isinstance(state, CacheState) and state._fields == CacheState._fields
    buffers = dict(cache.named_buffers())
    assert set(buffers) - set(CacheState._fields) == {
        f"{kind}_{n}" for n in ("w", "b") for kind in ("host", "slot")
    }
    for name in CacheState._fields:
        assert getattr(state, name) is buffers[name] is getattr(cache, name), name
    assert state.timer.numel() == 0 and state.pace.shape == (3,)
    assert state.counters.shape == (len(COUNTERS),) == (len(Counter),)
    assert (
        COUNTERS[Counter.HITS] == "hits"
        and COUNTERS[Counter.PREFETCH_VICTIMS] == "prefetch_victims"
    )
    assert make_cache(E=6, C=2, policy="lru", time_stalls=True).timer.numel() == TIMER_SIZE


def test_linked_caches_share_the_pace_they_are_given():
    pace = torch.zeros(3, dtype=torch.int64)
    a, b = make_cache(6, 2, "lru", pace=pace), make_cache(6, 2, "lru", pace=pace)
    assert a.pace is pace and b.state.pace is pace
    assert make_cache(6, 2, "lru").pace is not pace  # a new one when none is given


def test_sizes():
    cache = make_cache(E=6, C=2, policy="lru")
    assert cache.expert_bytes == expert_bytes(cache.slots) == (3 * 2 + 5) * 4
    assert cache.slot_w.shape == (2, 3, 2) and cache.host_b is cache.hosts[1]
    assert (
        num_waves(2, 4, 16),
        num_waves(5, 4, 16),
        num_waves(40, 4, 16),
        num_waves(40, 4, 10),
    ) == (1, 2, 4, 3)


def test_unknown_policy_fails_at_build():
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        make_cache(E=6, C=2, policy="mru")


def test_clear_returns_the_cache_as_built():
    """After `clear`, every buffer but the weights equals a fresh cache's, and the same calls count the same."""
    calls = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 4]]), torch.tensor([[0, 5]])]
    used, fresh = make_cache(E=8, C=4, policy="lfru"), make_cache(E=8, C=4, policy="lfru")
    for ids in calls:
        ops.ensure(used, ids, 0)
    used.explored.fill_(3)  # mid-exploration
    used.clear()
    weights = {f"{kind}_{n}" for n in used.names for kind in ("host", "slot")}
    for name, buf in fresh.named_buffers():
        if name not in weights:
            assert torch.equal(getattr(used, name), buf), name
    for ids in calls:
        assert torch.equal(ops.ensure(used, ids, 0), ops.ensure(fresh, ids, 0))
    assert torch.equal(used.counters, fresh.counters)


def test_clear_keeps_the_pace_and_the_addresses():
    cache = make_cache(E=8, C=4, policy="lru")
    cache.pace.copy_(torch.tensor([1, 2, 3]))
    addresses = [t.data_ptr() for t in cache.state]
    ops.ensure(cache, torch.tensor([[0, 1]]), 0)
    cache.clear()
    assert cache.pace.tolist() == [1, 2, 3]  # it measures the GPU, not the cache's history
    assert [
        t.data_ptr() for t in cache.state
    ] == addresses  # in place: a captured graph stays valid


def test_a_cache_refuses_to_be_moved_or_cast():
    cache = make_cache(E=6, C=2, policy="lru")
    with pytest.raises(
        RuntimeError,
        match=r"lives on cpu in torch.float32 and cannot be moved or cast \(asked for cpu, torch.float64\)",
    ):
        cache.double()
    cache.to("cpu")  # a no-op move is fine


def test_cast_after_compile_is_refused():
    model = tiny("mixtral")
    asyncmoe.compile(model, cache=4)
    with pytest.raises(RuntimeError, match="cannot be moved or cast.*before asyncmoe.compile"):
        model.half()
    model.to("cpu")  # a no-op move is fine
