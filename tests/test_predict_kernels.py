"""The predictor kernels against their plain-torch references: under TRITON_INTERPRET=1 on the CPU, on cuda for real."""

import pytest
import torch

from asyncmoe.cache import expert_cache
from asyncmoe.cache.expert_cache import COUNTERS, ExpertCache, observe
from asyncmoe.predict.predictors import gate_scores
from test_cache_step import assert_same, devices


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, per_token, bias", [(1, 64, 8, False), (3, 8, 2, True), (20, 60, 6, False), (64, 128, 8, True)])
def test_gate_kernel_matches_reference(device, dtype, T, E, per_token, bias):
    g = torch.Generator().manual_seed(T * E)
    H = 96
    x = torch.randn(T, H, generator=g).to(device, dtype)
    weight = torch.randn(E, H, generator=g).to(device, dtype) / H**0.5 * 4  # spread probabilities, few near-ties
    b = torch.randn(E, generator=g).to(device, dtype) if bias else None
    want, got = torch.full((2, E), -1.0, device=device)  # written whole, not added to
    gate_scores(x, weight, b, per_token, want, use_kernel=False)
    gate_scores(x, weight, b, per_token, got, use_kernel=True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert torch.equal(got > 0, want > 0)  # the same nominations
    else:  # equal bf16 logits tie, and topk's order among ties is unspecified: a share of at most 1/k over T tokens
        torch.testing.assert_close(got, want, atol=1 / (per_token * T), rtol=2e-2)
        torch.testing.assert_close(got.sum(), want.sum(), atol=0, rtol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("E_before, E", [(4, 6), (64, 64)])
def test_observe_kernel_matches_reference(device, E_before, E):
    g = torch.Generator().manual_seed(E)
    want = torch.rand(E_before, E, generator=g).to(device) * 5
    got = want.clone()
    for _ in range(3):
        before = (torch.rand(E_before, generator=g) < 0.3).to(device)
        routed = (torch.rand(E, generator=g) < 0.3).to(device)
        observe(before, routed, want, use_kernel=False)
        observe(before, routed, got, use_kernel=True)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)  # a fused multiply-add may round once where torch rounds twice


def _prefetch_pair(E_before, E, C, device, seed):
    g = torch.Generator().manual_seed(seed)
    hosts = {"w": torch.randn(E, 2, 3, generator=g).to(device)}
    caches = [ExpertCache(hosts, C, "lfru") for _ in range(2)]
    # each row: one or two successors, counts summing to a power of two, so every share is a sum of quarters,
    # exact in any order: the kernel sums in another order than torch, and an ulp could flip a near-tie in the
    # top-keep (it did: random counts, on the H200, step 69)
    successors = torch.randint(0, E, (E_before, 2), generator=g)
    counts = torch.tensor([[1.0, 1.0], [1.0, 3.0], [2.0, 0.0]])[torch.randint(0, 3, (E_before,), generator=g)]
    transitions = torch.zeros(E_before, E).index_put_((torch.arange(E_before)[:, None], successors), counts, accumulate=True)
    transitions = transitions.to(device)
    for c in caches:
        c.register_buffer("transitions", transitions.clone(), persistent=False)
    return caches, g


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("sources", [("gate",), ("temporal", "transition"), ("gate", "temporal", "transition"), ("transition",),
                                     ("gate", "transition")])  # the first: Prefetch()'s default
@pytest.mark.parametrize("E_before, E, C, k, steps", [(20, 24, 8, 2, 70), (64, 64, 16, 8, 8)])
def test_prefetch_scores_kernel_matches_reference(device, sources, E_before, E, C, k, steps):
    """The side stream's fused scoring + gating, then the decision and copy, against the torch chain over
    calls that route, prefetch, waste prefetches (so the gate closes) and reach the exploring calls, with the
    prefetch's pace measured (a copy 2x or 4x the compute) or not: the 32nd does not explore (a copy 4x the
    window explores every 128th call), the 64th does (unmeasured: every 32nd)."""
    (kernel, reference), g = _prefetch_pair(E_before, E, C, device, E * C + len(sources))
    scored = 0
    for step in range(steps):
        ids = (torch.rand(1, E, generator=g) * torch.linspace(2, 1, E)).topk(k, dim=-1).indices.to(device)
        before = (torch.rand(E_before, generator=g) < 3 / E_before).to(device)  # few: shares big enough to pass MIN_SUPPORT
        gate = torch.rand(E, generator=g) * (torch.rand(E, generator=g) < 0.15)
        gate[step % E] = 0.25  # a tie with another nomination now and then
        pace = torch.tensor([0, 1000 * (step % 3), 4000])  # every third call unmeasured: MIN_PRECISION
        for cache, use_kernel in ((kernel, True), (reference, False)):
            c = cache
            c.pace.copy_(pace)
            expert_cache.ensure(ids, 0, c.policy, c.expert_to_slot, c.slot_to_expert, c.state, c.counters, c.hosts, c.slots,
                                use_kernel=use_kernel)
            c.gate.copy_(gate)
            expert_cache.predict_and_prefetch(
                c.gate if "gate" in sources else None, "temporal" in sources,
                before if "transition" in sources else None, c.transitions if "transition" in sources else None,
                k, c.policy, c.predicted, c.nominated, c.expert_to_slot, c.slot_to_expert, c.state, c.counters,
                c.hosts, c.slots, c.outcomes, c.pace, use_kernel=use_kernel,
            )
        torch.testing.assert_close(kernel.predicted, reference.predicted, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(kernel.outcomes, reference.outcomes, atol=0, rtol=1e-6)  # a fused multiply-add
        assert torch.equal(kernel.nominated, reference.nominated), step
        assert_same(kernel, reference)
        scored += int((reference.predicted > 0).sum())
    assert scored > 0
    if "gate" in sources:
        assert reference.counters[COUNTERS.index("prefetched")] > 0
        assert reference.outcomes[0] > 0  # wasted prefetches: the gate's estimate moved
