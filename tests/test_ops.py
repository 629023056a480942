"""Each custom op passes torch.library.opcheck: schema, fake, mutation declarations, aot dispatch."""

import pytest
import torch

from asyncmoe import ops
from asyncmoe.cache.expert_cache import ExpertCache


def clone(ts):
    return [t.clone() for t in ts]  # opcheck runs the op several times on the same arguments


def warm_cache(policy: str) -> ExpertCache:
    cache = ExpertCache({"w": torch.randn(10, 4, 3), "b": torch.randn(10, 4)}, 4, policy)
    ops.ensure(cache, torch.tensor([[0, 1], [2, 3]]), 0)  # a warm cache, so the ops also evict
    return cache


def ensure_args(cache: ExpertCache, ids: torch.Tensor, wave: int):
    return (
        ids, wave, False, False, cache.policy, cache.expert_to_slot.clone(), cache.slot_to_expert.clone(), clone(cache.state),
        cache.counters.clone(), cache.timer.clone(), cache.pace.clone(), cache.hosts, clone(cache.slots),
    )


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("wave", [0, 1])
def test_ensure_opcheck(policy, wave):
    cache = warm_cache(policy)
    ids = torch.tensor([[4, 5], [6, 1], [7, 8]])
    torch.library.opcheck(torch.ops.asyncmoe.ensure.default, ensure_args(cache, ids, wave))


@pytest.mark.parametrize("predictors", ["gate", "temporal", "gate+temporal+transition"])
def test_prefetch_opcheck(predictors):
    cache = warm_cache("lru")
    gate = torch.tensor([0.0, 0.9, 0.0, 0.0, 0.5, 0.7, 0.0, 0.0, 0.1, 0.0]) if "gate" in predictors else None
    before, transitions = (torch.arange(10) % 3 == 0, torch.rand(10, 10)) if "transition" in predictors else (None, None)
    args = (
        gate, "temporal" in predictors, before, transitions, 2, 0, False, "lru", cache.predicted.clone(), cache.nominated.clone(),
        cache.expert_to_slot.clone(), cache.slot_to_expert.clone(), clone(cache.state), cache.counters.clone(),
        cache.outcomes.clone(), cache.pace.clone(), cache.hosts, clone(cache.slots),
    )
    torch.library.opcheck(torch.ops.asyncmoe.prefetch.default, args)


@pytest.mark.parametrize("bias", [False, True])
def test_gate_scores_opcheck(bias):
    x, weight = torch.randn(3, 8), torch.randn(10, 8)
    torch.library.opcheck(torch.ops.asyncmoe.gate_scores.default, (x, weight, torch.randn(10) if bias else None, 4, torch.zeros(10)))


def test_observe_opcheck():
    previous = torch.tensor([True, False, True])
    routed = torch.tensor([False, True, True, False])
    torch.library.opcheck(torch.ops.asyncmoe.observe.default, (previous, routed, torch.rand(3, 4)))


def test_fake_states_the_contract():
    cache = ExpertCache({"w": torch.randn(10, 4)}, 2, "lru")
    args = ensure_args(cache, torch.zeros(3, 4, dtype=torch.int64), 0)
    mode = torch._subclasses.FakeTensorMode()
    fake = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
    args = tuple([fake(t) for t in a] if isinstance(a, list) else fake(a) for a in args)
    with mode:
        with pytest.raises(Exception, match="top_k=4 exceeds the cache's 2 slots.*use cache>=4"):
            torch.ops.asyncmoe.ensure(*args)
