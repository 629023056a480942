"""Prefetch changes timing, never results; the predictors predict; their hits are counted by source."""

import copy

import numpy as np
import pytest
import torch

import asyncmoe
from asyncmoe.predict.predictors import GATE, TEMPORAL, TRANSITION, combine, gate_scores, temporal_scores, transition_scores

from asyncmoe.cache.expert_cache import TRANSITION_DECAY
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.trace import Trace
from models import FAMILIES, NUM_EXPERTS, TOP_K, tiny
from test_cache_step import devices


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", [2, 4])
@torch.no_grad()
def test_prefetch_on_off_identical(family, cache):
    ref = tiny(family)
    on = asyncmoe.compile(copy.deepcopy(ref), cache=cache, prefetch=asyncmoe.Prefetch(sources=("gate", "transition"), depth=2))
    off = asyncmoe.compile(copy.deepcopy(ref), cache=cache, prefetch=False)
    g = torch.Generator().manual_seed(5)
    for batch, length in [(1, 8), (1, 1), (4, 1), (1, 1), (2, 17)]:
        ids = torch.randint(0, 128, (batch, length), generator=g)
        assert torch.equal(on(ids).logits, off(ids).logits)
    assert asyncmoe.stats(on).totals["prefetched"] > 0
    assert asyncmoe.stats(off).totals["prefetched"] == 0


@torch.no_grad()
def test_budget_caps_what_a_layer_admits_per_call():
    """A gate that is always right about the second layer, on routing that needs a new pair of experts every
    token: it admits exactly `budget` experts per call (default one: more do not fit one layer's compute on
    the GPU, docs/results/2026-11-30), and each one saves a miss."""
    calls = 20
    ids = np.array([[[(TOP_K * t + j) % NUM_EXPERTS for j in range(TOP_K)]] * 2 for t in range(calls)])  # [N, L, k]
    gate_ids = np.where(np.arange(2)[None, :, None] == 0, -1, ids)  # no gate predicts the first layer
    gate_probs = np.tile(np.linspace(0.6, 0.4, TOP_K, dtype=np.float32), (calls, 2, 1))
    trace = Trace(ids, NUM_EXPERTS, gate_ids=gate_ids, gate_probs=gate_probs)
    ref = tiny("olmoe")
    assert asyncmoe.Prefetch().budget == 1
    for budget in (1, TOP_K):
        model = asyncmoe.compile(copy.deepcopy(ref), cache=4, replay=trace, prefetch=asyncmoe.Prefetch(sources=("gate",), budget=budget))
        for t in range(calls):
            model(torch.tensor([[t + 1]]))
        first, second = asyncmoe.stats(model).layers
        assert (first.prefetched, first.misses) == (0, TOP_K * calls)
        assert (second.prefetched, second.misses) == (budget * calls, (TOP_K - budget) * calls)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("depth", [1, 2])
@torch.no_grad()
def test_every_layer_learns_its_transitions(device, depth):
    """Every layer's transition counts take each call's (routed at the layer before -> routed here) pairs."""
    model = asyncmoe.compile(tiny("qwen3_moe", device=device, num_hidden_layers=4), cache=4,
                             prefetch=asyncmoe.Prefetch(sources=("gate", "transition"), depth=depth))
    caches = [m.asyncmoe.cache for _, m in find_experts(model)]
    g = torch.Generator().manual_seed(1)
    want = [torch.zeros(NUM_EXPERTS, NUM_EXPERTS, device=device) for _ in caches[1:]]
    for _ in range(3):
        model(torch.randint(0, 128, (1, 1), generator=g).to(device))
        for w, before, here in zip(want, caches, caches[1:]):
            w.mul_(TRANSITION_DECAY).add_(before.routed[:, None].float() * here.routed[None, :].float())
    for w, here in zip(want, caches[1:]):
        torch.testing.assert_close(here.transitions, w, atol=0, rtol=1e-6)  # the kernel may fuse its multiply-add
    assert all(c.transitions.sum() > 0 for c in caches[1:])


def test_prefetch_hits_are_counted_by_nominator():
    from asyncmoe import ops
    from asyncmoe.cache import expert_cache
    from asyncmoe.cache.expert_cache import ExpertCache

    cache = ExpertCache({"w": torch.randn(8, 3)}, 3, "lru")
    scores = torch.tensor([0, 0.9, 0, 0, 0.2, 0.5, 0, 0])
    sources = torch.tensor([0, GATE | TEMPORAL, 0, 0, TRANSITION, GATE, 0, 0], dtype=torch.int8)
    tables = (cache.expert_to_slot, cache.slot_to_expert, cache.state, cache.counters, cache.hosts, cache.slots)
    expert_cache.prefetch(scores, sources, 2, "lru", *tables)  # admits 1 and 5, the two likeliest
    assert sorted(e for e in cache.slot_to_expert.tolist() if e >= 0) == [1, 5]
    assert torch.equal(cache.slot_w[cache.expert_to_slot[[1, 5]]], cache.host_w[[1, 5]])
    ops.ensure(cache, torch.tensor([[1, 2]]), 0)  # 1 was prefetched, 2 misses
    ops.ensure(cache, torch.tensor([[1, 3]]), 0)  # 1 again: a plain hit now; 3 evicts the unused prefetch of 5
    c = dict(zip(asyncmoe.cache.COUNTERS, cache.counters.tolist()))
    assert (c["prefetched"], c["prefetch_hits"], c["hits_gate"], c["hits_temporal"], c["hits_transition"]) == (2, 1, 1, 1, 0)
    assert (c["hits"], c["misses"], c["wasted"]) == (2, 2, 1)
    assert c["bytes_h2d"] == 4 * cache.expert_bytes


@torch.no_grad()
def test_default_prefetch_hits_during_decode():
    model = asyncmoe.compile(tiny("qwen3_moe"), cache=4)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        model(torch.randint(0, 128, (1, 1), generator=g))
    s = asyncmoe.stats(model)
    t = s.totals
    assert t["prefetched"] > 0 and t["prefetch_hits"] > 0 and t["wasted"] <= t["prefetched"]
    assert t["hits_gate"] + t["hits_temporal"] + t["hits_transition"] >= t["prefetch_hits"]
    assert s.layers[0].prefetched == 0  # nothing precedes the first MoE layer
    assert "prefetch hits by predictor" in str(s)


def test_gate_scores_follow_the_router():
    weight = torch.eye(4) * 10  # token i prefers expert i
    x = torch.eye(4)[[1, 1, 3]]
    s = torch.full((4,), -1.0)
    gate_scores(x, weight, None, 1, s)
    assert s.argmax() == 1 and s[3] > 0 and s[0] == 0 and s[2] == 0


def test_transition_scores_learn_a_mapping():
    from asyncmoe.cache.expert_cache import observe

    transitions = torch.zeros(4, 6)
    for _ in range(10):  # expert 0 before -> 5 here; 2 -> 3
        observe(torch.tensor([True, False, True, False]), torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.bool), transitions)
    before = torch.tensor([True, False, False, False])
    observe(before, torch.tensor([0, 0, 0, 0, 0, 1], dtype=torch.bool), transitions)
    s = transition_scores(before, transitions, keep=1)
    assert s.argmax() == 5 and (s > 0).sum() == 1


def test_combine_ranks_the_gate_first_and_drops_weak_support():
    gate = (GATE, torch.tensor([0.5, 0, 0, 0]))
    temporal = (TEMPORAL, temporal_scores(torch.tensor([True, False, True, False])))
    transition = (TRANSITION, torch.tensor([0.0, 0.0, 0.4, 0.2]))
    scores, sources = combine([gate, temporal, transition])
    # expert 0: the gate's (1 + 0.5); 2: temporal and transition agree (mean 0.7); 3: mean 0.1 < MIN_SUPPORT
    assert scores.tolist() == pytest.approx([1.5, 0, 0.7, 0])
    assert sources.tolist() == [GATE | TEMPORAL, 0, TEMPORAL | TRANSITION, 0]
    scores, sources = combine([temporal])
    assert scores.tolist() == [1, 0, 1, 0] and sources.tolist() == [TEMPORAL, 0, TEMPORAL, 0]


@pytest.mark.parametrize("bad", [dict(sources=("oracle",)), dict(sources=()), dict(depth=0), dict(depth=2), dict(budget=0)])
def test_bad_prefetch_settings(bad):
    with pytest.raises(ValueError, match="prefetch"):
        asyncmoe.Prefetch(**bad)


@pytest.mark.parametrize("use", ["timely", "late", "never"])
def test_prefetch_gate_stops_a_layer_whose_prefetches_go_unused(use):
    """Every other call prefetches one expert; routing then uses it in that call (timely), in the call
    after (late), or never. Only timely prefetches keep the layer prefetching: otherwise prefetch
    switches off, except every EXPLORE_EVERY-th call."""
    from asyncmoe import ops
    from asyncmoe.cache.expert_cache import COUNTERS, EXPLORE_EVERY, ExpertCache

    E, steps = 16, 6 * EXPLORE_EVERY
    cache = ExpertCache({"w": torch.randn(E, 3)}, 4, "lru")
    admitted, guess = [], 0
    for step in range(steps):
        if step % 2 == 0:
            guess = step // 2 % (E - 2)
            prefetched = cache.counters[COUNTERS.index("prefetched")].item()
            cache.gate.copy_(torch.nn.functional.one_hot(torch.tensor(guess), E))
            ops.prefetch(cache, 1, gate=True)
            admitted.append(cache.counters[COUNTERS.index("prefetched")].item() - prefetched)
            routed = guess if use == "timely" else E - 1
        else:
            routed = guess if use == "late" else E - 2
        ops.ensure(cache, torch.tensor([[routed]]), 0)
    late = admitted[len(admitted) // 2 :]  # the prefetching calls of the second half
    if use == "timely":
        assert all(late)  # every prefetch admitted
    else:
        assert 0 < sum(late) <= steps // 2 // EXPLORE_EVERY + 1  # only the exploring calls


@pytest.mark.parametrize("victim_needed", [False, True])
def test_prefetch_gate_counts_the_hits_a_prefetch_evicts(victim_needed):
    """Before every call one expert that is not resident is prefetched, and the call uses it. When the
    call routes to every expert (more than the slots: two waves), the expert the prefetch evicted is
    needed too: the prefetch saved no miss, only traded a hit, and the gate closes although every
    prefetch was used by its call. When the call routes to the prefetched expert alone, it stays open."""
    from asyncmoe import ops
    from asyncmoe.cache.expert_cache import COUNTERS, EXPLORE_EVERY, ExpertCache

    E, C, steps = 8, 4, 4 * EXPLORE_EVERY
    cache = ExpertCache({"w": torch.randn(E, 3)}, C, "lru")
    count = lambda name: cache.counters[COUNTERS.index(name)].item()  # noqa: E731
    ops.ensure(cache, torch.arange(C).view(1, C), 0)  # fill the slots
    admitted = []
    for _ in range(steps):
        guess = int((cache.expert_to_slot[:E] < 0).nonzero()[0])
        cache.gate.copy_(torch.nn.functional.one_hot(torch.tensor(guess), E))
        prefetched = count("prefetched")
        ops.prefetch(cache, 1, gate=True)
        admitted.append(count("prefetched") - prefetched)
        ids = torch.arange(E).view(2, E // 2) if victim_needed else torch.tensor([[guess]])
        for wave in range(2 if victim_needed else 1):
            ops.ensure(cache, ids, wave)
    assert count("prefetch_timely") == sum(admitted)  # every admitted prefetch was used by its call
    assert count("prefetch_victims") == (sum(admitted) if victim_needed else 0)
    late = admitted[steps // 2 :]
    assert admitted[0] == 1  # no evidence yet: the gate is open
    if victim_needed:
        assert sum(late) <= len(late) // EXPLORE_EVERY + 1  # at most the exploring calls
    else:
        assert all(late)


def mixtral_router_replay(batch: int, prefetch: bool, pace=(0, 0, 0), calls: int = 150) -> tuple[int, int]:
    """Copies (misses + prefetches) and prefetch victims over a replay shaped as the Mixtral-8x7B shape's router
    at 4 of 8 slots: 6 layers, routing uniform over 8 experts, top-2; the gate predictor sees the next layer's
    routing with 30% of its picks replaced at random. `pace`: (stamp, window, copy) for every layer's gate."""
    from asyncmoe.cache import expert_cache
    from asyncmoe.cache.expert_cache import COUNTERS, ExpertCache, num_waves
    from asyncmoe.predict.predictors import top_scores

    L, E, C, k = 6, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    routing = [[torch.rand(batch, E, generator=g).topk(k, dim=-1).indices for _ in range(L)] for _ in range(calls)]
    guesses = [[torch.where(torch.rand(batch, k, generator=g) < 0.3, torch.randint(0, E, (batch, k), generator=g), ids)
                for ids in step] for step in routing]
    caches = [ExpertCache({"w": torch.zeros(E, 0)}, C, "lfru") for _ in range(L)]
    for c in caches:
        c.pace.copy_(torch.tensor(pace))
    for step, guess in zip(routing, guesses):
        for l, c in enumerate(caches):
            for wave in range(num_waves(batch * k, C, E)):
                expert_cache.ensure(step[l], wave, c.policy, c.expert_to_slot, c.slot_to_expert, c.state, c.counters, [], [])
            if prefetch and l + 1 < L:
                t = caches[l + 1]
                gate = top_scores(guess[l + 1], torch.full((batch, k), 0.5), E).mean(0)
                expert_cache.predict_and_prefetch(gate, False, None, None, 1, t.policy, t.predicted, t.nominated,
                                                  t.expert_to_slot, t.slot_to_expert, t.state, t.counters, [], [], t.outcomes,
                                                  t.pace)
    n = lambda name: sum(c.counters[COUNTERS.index(name)].item() for c in caches)  # noqa: E731
    return n("misses") + n("prefetched"), n("prefetch_victims")


def test_a_batch_wider_than_the_cache_copies_no_more_with_prefetch():
    """Mixtral's router at 4 of 8 slots, batch 8, where nearly all a prefetch fetches is used: the old gate (use
    alone) copied 1.18x what no prefetch copies (1.01x now), as on the H200 (36.5 against 30.4 GB a token, 1.14x
    slower; docs/results/2026-11-30, twenty-third session)."""
    alone, _ = mixtral_router_replay(8, False)
    with_prefetch, victims = mixtral_router_replay(8, True)
    assert victims > 0  # the gate had evidence: prefetches whose victims the call needed
    assert with_prefetch <= 1.03 * alone


def test_a_copy_that_outlasts_the_compute_needs_more_prefetches_to_save_a_miss():
    """Mixtral's router at 4 of 8 slots, batch 1: ~78% of prefetches are used, and with the gate's break-even
    at half they copy 1.16x what no prefetch copies (on the H200 82%, 1.15x slower: twenty-third session). With
    a copy 13x the compute it hides behind (6.4 against ~0.5 ms there) the gate wants 93%, and closes."""
    alone, _ = mixtral_router_replay(1, False, calls=200)
    unmeasured, _ = mixtral_router_replay(1, True, calls=200)
    paced, _ = mixtral_router_replay(1, True, (0, 1000, 13000), calls=200)
    assert unmeasured >= 1.1 * alone
    assert paced <= 1.03 * alone


@pytest.mark.parametrize("waves, stride", [(1, 1), (2, 1), (1, 3)])
def test_a_gated_layer_explores_every_period_and_reopens_where_half_is_enough(waves, stride):
    """Prefetches that are never used close the gate; the layer then explores every EXPLORE_EVERY calls, not
    less often as it goes on (on OLMoE's trace doubling the interval up to 512 made decode 4% slower). Once
    the predictions are right, two exploring prefetches used by their calls reopen it, where half is enough.
    Counted in calls, whatever a call's waves: with two a call, counting `ensure`s (the clock) explored at
    calls 16, 32, 48, ... Where a copy takes 3x the compute it hides behind, the interval is 3x as long and
    the gate wants 75%: explores 96 calls apart keep too little of their evidence to reach it, so the gate
    stays closed (`explore_period`)."""
    from asyncmoe import ops
    from asyncmoe.cache.expert_cache import COUNTERS, EXPLORE_EVERY, ExpertCache, num_waves

    E, C = 16, 4
    cache = ExpertCache({"w": torch.randn(E, 3)}, C, "lru")
    if stride > 1:
        cache.pace.copy_(torch.tensor([0, 1000, 1000 * stride + 500]))  # copy // window: the stride
    routed = torch.arange(E - 1, E - 2 - C * (waves - 1), -1).view(1, -1)  # E-1 alone, or C+1 experts: two waves
    assert num_waves(routed.numel(), C, E) == waves
    period = EXPLORE_EVERY * stride
    admitted, guess, right_from, end = [], 0, 4 * period, 8 * period
    for call in range(1, end):
        ids = torch.tensor([[guess]]) if call > right_from else routed  # from then on the prediction is routed
        for wave in range(num_waves(ids.numel(), C, E)):
            ops.ensure(cache, ids, wave)
        guess = int((cache.expert_to_slot[: E - routed.numel()] < 0).nonzero()[0])  # not resident: a prediction copies it
        cache.gate.copy_(torch.nn.functional.one_hot(torch.tensor(guess), E))
        prefetched = cache.counters[COUNTERS.index("prefetched")].item()
        ops.prefetch(cache, 1, gate=True)
        if cache.counters[COUNTERS.index("prefetched")].item() > prefetched:
            admitted.append(call)
    if stride == 1:  # open with no evidence yet; explores at 32 ... 128, 160; those at 128 and 160 paid: open again
        assert admitted == [1, *range(period, 5 * period, period), *range(5 * period, end)]
    else:
        assert admitted == list(range(period, end, period))


@pytest.mark.parametrize("use_kernel", [False, True])  # the kernel on cuda where there is one, else interpreted
def test_a_stats_reset_does_not_make_a_gated_layer_explore(use_kernel):
    """The latency suite resets the counters after each round's prompt. A layer's prefetch runs before its own
    `ensure`, so the next one saw `calls` at 0, which every exploring period divides: every gated layer explored
    once a round (Mixtral shape, trace, batch 1, 4 of 8 on the H200: 15/32 of an expert a token more than without
    prefetch, 2.7%, with the exploring period 32 or 448; docs/results/2026-11-30, twenty-sixth session)."""
    from asyncmoe.cache import expert_cache
    from asyncmoe.cache.expert_cache import CALLS, COUNTERS, ExpertCache
    from asyncmoe.cache.stats import read_stats

    E, C = 16, 4
    device = "cuda" if use_kernel and torch.cuda.is_available() else "cpu"
    c = ExpertCache({"w": torch.randn(E, 3, device=device)}, C, "lru")
    c.pace.copy_(torch.tensor([0, 1000, 1000]))  # a copy as long as the window: half is enough, explore every 32nd call
    prefetched = lambda: c.counters[COUNTERS.index("prefetched")].item()  # noqa: E731

    def prefetch(expert):  # the gate predicts `expert`, as the prefetch op does before the layer's own ensure
        scores = torch.nn.functional.one_hot(torch.tensor(expert, device=device), E).float()
        expert_cache.predict_and_prefetch(scores, False, None, None, 1, c.policy, c.predicted, c.nominated,
                                          c.expert_to_slot, c.slot_to_expert, c.state, c.counters, c.hosts, c.slots,
                                          c.outcomes, c.pace, use_kernel=use_kernel)

    for call in range(4):  # experts 0 and 1 predicted, E-1 routed: the prefetches are wasted and the gate closes
        prefetch(call % 2)
        expert_cache.ensure(torch.tensor([[E - 1]], device=device), 0, c.policy, c.expert_to_slot, c.slot_to_expert,
                            c.state, c.counters, c.hosts, c.slots, use_kernel=use_kernel)
    assert prefetched() == 1  # the first, with no evidence yet
    read_stats([("layer", c)], reset=True)
    assert c.counters[CALLS] == 0
    prefetch(2)
    assert prefetched() == 0


@pytest.mark.parametrize("copy, window, open_", [(0, 0, True), (1000, 1000, True), (3000, 1000, True), (13000, 1000, False)])
def test_prefetch_gate_wants_more_saved_where_a_copy_outlasts_the_compute(copy, window, open_):
    """82 of 100 prefetches saved a miss. Where a copy takes no longer than the compute it hides behind (or
    nothing was measured: the CPU) half is enough; at 3x, 75%; at 13x (the Mixtral-8x7B shape at batch 1,
    where 82% made decode 1.15x slower than no prefetch) 93%, and the gate closes."""
    from asyncmoe.cache.expert_cache import CALLS, COUNTERS, ExpertCache, gate_prefetch

    E = 8
    cache = ExpertCache({"w": torch.randn(E, 3)}, 4, "lru")
    cache.counters[COUNTERS.index("prefetched")] = 100
    cache.counters[COUNTERS.index("prefetch_timely")] = 82
    cache.counters[CALLS] = 1  # not an exploring call
    cache.pace.copy_(torch.tensor([0, window, copy]))
    predicted = torch.rand(E) + 0.1
    gate_prefetch(predicted, cache.expert_to_slot, cache.counters, cache.outcomes, cache.pace)
    assert bool((predicted > 0).all()) == open_ and bool((predicted == 0).all()) != open_


@torch.no_grad()
def test_linked_layers_share_one_unmeasured_pace_on_the_cpu():
    """Every prefetching layer's gate reads one pace; on the CPU nothing measures it (no GPU clock, no streams),
    so the gate keeps MIN_PRECISION and `stats` prints no pace line."""
    model = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4)
    caches = [m.asyncmoe.cache for _, m in find_experts(model)]
    assert len({c.pace.data_ptr() for c in caches}) == 1
    model(torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0)))
    s = asyncmoe.stats(model)
    assert caches[0].pace.tolist() == [0, 0, 0] and s.min_precision == 0.5
    assert s.totals["prefetched"] > 0 and "prefetch gate:" not in str(s)
