"""The predictor kernels (prefetch/scores.py, prefetch/prefetch_scores.py) against their plain-torch
references: under TRITON_INTERPRET=1 on the CPU, on cuda for real."""

import pytest
import torch

from asyncmoe.cache import algorithm
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.state import GATE, TEMPORAL, TRANSITION, Counter
from asyncmoe.prefetch import scores as score_kernels
from asyncmoe.prefetch.predictors import (
    TRANSITION_DECAY,
    gate_scores,
    gate_scores_reference,
    observe_reference,
    recorded_scores_reference,
)
from asyncmoe.prefetch.prefetch import Request, predict_and_prefetch
from asyncmoe.prefetch.state import PREFETCHES, RUNNERS_UP, WASTED, PrefetchBuffers

from devices import assert_same, devices

BITS = {"gate": GATE, "temporal": TEMPORAL, "transition": TRANSITION}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T, E, per_token, bias",
    [(1, 64, 8, False), (3, 8, 2, True), (20, 60, 6, False), (64, 128, 8, True)],
)
def test_gate_kernel_matches_reference(device, dtype, T, E, per_token, bias):
    g = torch.Generator().manual_seed(T * E)
    H = 96
    x = torch.randn(T, H, generator=g).to(device, dtype)
    weight = (
        torch.randn(E, H, generator=g).to(device, dtype) / H**0.5 * 4
    )  # spread probabilities, few near-ties
    b = torch.randn(E, generator=g).to(device, dtype) if bias else None
    want, got = torch.full((2, E), -1.0, device=device)  # written whole, not added to
    gate_scores_reference(x, weight, b, per_token, want)
    score_kernels.gate_scores_triton(x, weight, b, per_token, got)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert torch.equal(got > 0, want > 0)  # the same nominations
    else:  # equal bf16 logits tie, and topk's order among ties is unspecified: a share of at most 1/k over T tokens
        torch.testing.assert_close(got, want, atol=1 / (per_token * T), rtol=2e-2)
        torch.testing.assert_close(got.sum(), want.sum(), atol=0, rtol=1e-2)


@pytest.mark.parametrize("device", devices())
def test_a_prefill_sized_call_takes_the_reference(device, monkeypatch):
    """More than MAX_TOKENS tokens: `gate_scores` runs the reference even where the kernel is asked
    for."""
    launched = []
    monkeypatch.setattr(score_kernels, "gate_scores_triton", lambda *a: launched.append(1))
    x, weight = (
        torch.randn(score_kernels.MAX_TOKENS + 1, 8, device=device),
        torch.randn(4, 8, device=device),
    )
    out = torch.zeros(4, device=device)
    gate_scores(x, weight, None, 4, out, use_kernel=True)
    assert not launched and torch.isclose(
        out.sum(), torch.tensor(1.0, device=device)
    )  # all 4 probabilities
    gate_scores(x[:1], weight, None, 4, out, use_kernel=True)
    assert launched == [1]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("E_before, E", [(4, 6), (64, 64)])
def test_observe_kernel_matches_reference(device, E_before, E):
    g = torch.Generator().manual_seed(E)
    want = torch.rand(E_before, E, generator=g).to(device) * 5
    got = want.clone()
    for _ in range(3):
        before = (torch.rand(E_before, generator=g) < 0.3).to(device)
        routed = (torch.rand(E, generator=g) < 0.3).to(device)
        observe_reference(before, routed, want)
        score_kernels.observe_triton(before, routed, got, TRANSITION_DECAY)
    # a fused multiply-add may round once where torch rounds twice
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def _prefetch_pair(E_before, E, C, device, seed):
    g = torch.Generator().manual_seed(seed)
    hosts = {"w": torch.randn(E, 2, 3, generator=g).to(device)}
    caches = [ExpertCache(hosts, C, "lfru") for _ in range(2)]
    targets = [PrefetchBuffers(E, caches[0].expert_to_slot.device, E_before) for _ in range(2)]
    # each row: one or two successors, counts summing to a power of two, so every share is a sum of
    # quarters, exact in any order: the kernel sums in another order than torch, and an ulp could
    # flip a near-tie in the top-keep (it did with random counts on the H200)
    successors = torch.randint(0, E, (E_before, 2), generator=g)
    counts = torch.tensor([[1.0, 1.0], [1.0, 3.0], [2.0, 0.0]])[
        torch.randint(0, 3, (E_before,), generator=g)
    ]
    transitions = torch.zeros(E_before, E).index_put_(
        (torch.arange(E_before)[:, None], successors), counts, accumulate=True
    )
    for p in targets:
        p.transitions.copy_(transitions)
    return caches, targets, g


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "sources",
    [
        ("gate",),
        ("temporal", "transition"),
        ("gate", "temporal", "transition"),
        ("transition",),
        ("gate", "transition"),
    ],
)  # the first: Prefetch()'s default
@pytest.mark.parametrize(
    "E_before, E, C, k, calls_before, steps", [(20, 24, 8, 2, 27, 40), (64, 64, 16, 8, 0, 8)]
)
def test_prefetch_scores_kernel_matches_reference(
    device, sources, E_before, E, C, k, calls_before, steps
):
    """The side stream's fused scoring + gating, then the decision and copy, against the torch chain
    over calls that route, prefetch (the runners-up too, gated apart), waste prefetches (so the gate
    closes) and reach the exploring calls, with the prefetch's pace measured (a copy 2x or 4x the
    compute) or not: the 32nd does not explore (a copy 4x the window explores every 128th call), the
    64th does (unmeasured: every 32nd); every seventh step skips the prefetch, as a step without
    prefetch does. The first case's layer has served `calls_before` calls with no prefetch before the
    first step (a multiple of 3: the paces fall on the same calls), so its 32nd call is the fifth
    step and its 64th the 37th: 30 fewer interpreted steps, gated shut as the ones that follow."""
    (kernel, reference), (kernel_p, reference_p), g = _prefetch_pair(
        E_before, E, C, device, E * C + len(sources)
    )
    for c in (kernel, reference):
        c.counters[Counter.CALLS] = calls_before
    bits = sum(BITS[s] for s in sources)
    scored = 0
    for step in range(steps):
        ids = (
            (torch.rand(1, E, generator=g) * torch.linspace(2, 1, E))
            .topk(k, dim=-1)
            .indices.to(device)
        )
        # few: shares big enough to pass MIN_SUPPORT
        before = (torch.rand(E_before, generator=g) < 3 / E_before).to(device)
        gate = torch.rand(E, generator=g) * (torch.rand(E, generator=g) < 0.15)
        gate[step % E] = 0.25  # a tie with another nomination now and then
        pace = torch.tensor(
            [0, 1000 * (step % 3), 4000]
        )  # every third call unmeasured: MIN_PRECISION
        for c, p, use_kernel in ((kernel, kernel_p, True), (reference, reference_p, False)):
            c.pace.copy_(pace)
            algorithm.ensure(ids, 0, c.policy, c.state, c.hosts, c.slots, use_kernel=use_kernel)
            if step % 7 == 5:
                continue  # a step without prefetch: the evidence decays by the calls since (prefetch_gate)
            p.gate.copy_(gate)
            predict_and_prefetch(
                Request(bits, k, c.policy),
                c.state,
                p.state,
                before if "transition" in sources else None,
                c.hosts,
                c.slots,
                use_kernel=use_kernel,
            )
        torch.testing.assert_close(kernel_p.predicted, reference_p.predicted, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(
            kernel_p.outcomes, reference_p.outcomes, atol=0, rtol=1e-6
        )  # a fused multiply-add
        assert torch.equal(kernel_p.nominated, reference_p.nominated), step
        for name in ("visited", "gate_open", "transitions"):
            assert torch.equal(getattr(kernel_p, name), getattr(reference_p, name)), name
        assert_same(kernel, reference)
        scored += int((reference_p.predicted > 0).sum())
    assert scored > 0
    if "gate" in sources:
        assert reference.counters[Counter.PREFETCHED] > 0
        assert (
            reference_p.outcomes[PREFETCHES, WASTED] > 0
        )  # wasted prefetches: the gate's estimate moved
        assert (
            reference.counters[Counter.RUNNERS_UP] > 0
            and reference_p.outcomes[RUNNERS_UP, WASTED] > 0
        )  # k > 1
        # the first case's 64th call explored
        assert (reference.counters[Counter.EXPLORED] > 0) == (calls_before + steps > 64)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("T, E, g, per_token", [(1, 64, 8, 8), (3, 6, 4, 2), (5, 128, 8, 6)])
def test_recorded_kernel_matches_reference(device, T, E, g, per_token):
    """A replayed trace's recorded gate, from a cursor near the end (rows wrap), -1 ids for no
    nomination, and the per-layer slice of the trace's [N, L, g] arrays as the replay holds it."""
    gen = torch.Generator().manual_seed(E + T)
    N = 7
    ids = torch.stack([torch.randperm(E, generator=gen)[:g] for _ in range(N * 2)]).view(N, 2, g)
    ids[0, 0, -1] = ids[N - 1, 0, 0] = -1
    probs = torch.rand(N, 2, g, generator=gen)
    recorded = [ids[:, 0].to(device), probs[:, 0].to(device), torch.tensor([N - 2], device=device)]
    want, got = torch.full((2, E), -1.0, device=device)  # written whole, not added to
    recorded_scores_reference(recorded, T, per_token, want)
    score_kernels.recorded_scores_triton(recorded, T, per_token, got)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    assert torch.equal(got > 0, want > 0)
