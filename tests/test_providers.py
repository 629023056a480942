"""Providers (providers.py): on one experts module, waves == single path, the resident passthrough, post-expert
norm; across a model's layers, prefetch changes timing, never results, each layer learns its transitions, and the
linked layers share one pace."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncmoe
import asyncmoe.providers
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.prefetch.predictors import TRANSITION_DECAY
from asyncmoe.providers import CachedProvider, Links, ResidentProvider
from asyncmoe.trace import Trace

from devices import devices
from models import FAMILIES, NUM_EXPERTS, TOP_K, tiny


def experts_of(model):
    return find_experts(model)[0][1]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(3, 9), st.sampled_from(["gpt_oss", "olmoe"]))
@torch.no_grad()
def test_waves_equal_single_path(monkeypatch_seed, tokens, family):
    """Where both apply (distinct experts <= cache < tokens*k), the waves path gives the single path's result."""
    ref = tiny(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, prefetch=True)
    experts, original = experts_of(model), experts_of(ref)
    g = torch.Generator().manual_seed(monkeypatch_seed)
    x = torch.randn(tokens, ref.config.hidden_size, generator=g)
    pool = torch.randperm(16, generator=g)[:4]  # 4 distinct experts among all pairs
    ids = torch.stack([pool[torch.randperm(4, generator=g)[:2]] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    waves = experts(x, ids, w)  # tokens*2 > 4 slots: the waves path
    single_waves = asyncmoe.providers.num_waves
    try:
        asyncmoe.providers.num_waves = lambda *a: 1
        single = experts(x, ids, w)
    finally:
        asyncmoe.providers.num_waves = single_waves
    torch.testing.assert_close(waves, single, rtol=0, atol=1e-6)
    torch.testing.assert_close(waves, original(x, ids, w), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    "fixed, reached, planned, computed",
    [
        (False, 6, [0, 1], 2),
        (False, 4, [0, 1], 1),
        (True, 6, [0, 1, 2, 3], 4),
        (True, 4, [0, 1, 2, 3], 4),
    ],
)
@torch.no_grad()
def test_an_eager_call_stops_after_the_waves_its_experts_fill(
    monkeypatch, fixed, reached, planned, computed, device
):
    """16 tokens x top-2 over 4 slots: shapes alone give 4 waves (16 experts). Routed to 6 experts the call
    fills 2, and eager it computes those 2; routed to 4 it plans wave 1 (where it reads the count) but computes
    only wave 0. A capture or a compile trace (`_fixed_shapes`) runs all 4. All give the model's own output.
    On CUDA the count reaches the host through pinned memory and an event."""
    ref = tiny("olmoe")
    model = asyncmoe.compile(
        copy.deepcopy(ref), cache=4, device=device, prefetch=True, hybrid=False
    )
    experts, original = experts_of(model), experts_of(ref)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, ref.config.hidden_size, generator=g)
    ids = torch.stack(
        [torch.randperm(reached, generator=g)[:2] for _ in range(16)]
    )  # experts 0 to reached-1
    w = torch.rand(16, 2, generator=g)
    waves, ensure = [], asyncmoe.cache.ops.ensure
    monkeypatch.setattr(
        asyncmoe.cache.ops,
        "ensure",
        lambda cache, ids, wave, **kw: waves.append(wave) or ensure(cache, ids, wave, **kw),
    )
    computes, routed = [], asyncmoe.providers.routed_outputs
    monkeypatch.setattr(
        asyncmoe.providers, "routed_outputs", lambda *a: computes.append(1) or routed(*a)
    )
    monkeypatch.setattr(asyncmoe.providers, "_fixed_shapes", lambda x: fixed)
    out = experts(x.to(device), ids.to(device), w.to(device))
    assert (waves, len(computes)) == (planned, computed)
    torch.testing.assert_close(
        out.cpu(), original(x, ids, w), rtol=0, atol=1e-5 if device == "cpu" else 1e-3
    )


@torch.no_grad()
def test_resident_runs_the_models_own_implementation():
    ref = tiny("mixtral")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=16)
    experts = experts_of(model)
    assert isinstance(experts.asyncmoe, ResidentProvider)
    assert experts.asyncmoe.implementation == ref.config._experts_implementation
    assert isinstance(experts.gate_up_proj, torch.nn.Parameter)  # nothing moved, no tables
    ids = torch.randint(0, 128, (2, 9))
    assert torch.equal(model(ids).logits, ref(ids).logits)  # bit for bit


@torch.no_grad()
def test_post_expert_norm_is_applied():
    """MuseSpark is the one family with has_post_expert_norm; it is multimodal, so test its experts module alone."""
    ms = pytest.importorskip(
        "transformers.models.muse_spark.modeling_muse_spark",
        reason="MuseSpark (and has_post_expert_norm) arrived after transformers 5.17",
    )

    config = ms.MuseSparkTextConfig(
        hidden_size=32,
        moe_hidden_size=32,
        moe_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    original = ms.MuseSparkExperts(config)
    assert original.has_post_expert_norm
    for p in original.parameters():
        p.data.normal_()
    holder = torch.nn.Module()
    holder.experts = copy.deepcopy(original)
    holder.experts.config._experts_implementation = "eager"
    original.config = copy.deepcopy(original.config)
    original.config._experts_implementation = "eager"
    asyncmoe.compile(holder, cache=2)
    assert isinstance(holder.experts.asyncmoe, CachedProvider)
    x, ids = torch.randn(5, 32), torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    torch.testing.assert_close(holder.experts(x, ids, w), original(x, ids, w), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", [2, 4])
@torch.no_grad()
def test_prefetch_on_off_identical(family, cache):
    ref = tiny(family)
    on = asyncmoe.compile(
        copy.deepcopy(ref),
        cache=cache,
        prefetch=asyncmoe.Prefetch(sources=("gate", "transition"), depth=2),
    )
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
    token: it admits exactly `budget` experts per call (default two; on the GPU only as many as start copying
    within one layer's compute: docs/decisions.md#runners-up-within-the-window), and each one saves a miss."""
    calls = 20
    ids = np.array(
        [[[(TOP_K * t + j) % NUM_EXPERTS for j in range(TOP_K)]] * 2 for t in range(calls)]
    )  # [N, L, k]
    gate_ids = np.where(
        np.arange(2)[None, :, None] == 0, -1, ids
    )  # no gate predicts the first layer
    gate_probs = np.tile(np.linspace(0.6, 0.4, TOP_K, dtype=np.float32), (calls, 2, 1))
    trace = Trace(ids, NUM_EXPERTS, gate_ids=gate_ids, gate_probs=gate_probs)
    ref = tiny("olmoe")
    assert asyncmoe.Prefetch().budget == 2
    for budget in (1, TOP_K):
        model = asyncmoe.compile(
            copy.deepcopy(ref),
            cache=4,
            replay=trace,
            prefetch=asyncmoe.Prefetch(sources=("gate",), budget=budget),
        )
        assert [p.budget for p in (m.asyncmoe for _, m in find_experts(model))] == [budget, budget]
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
    model = asyncmoe.compile(
        tiny("qwen3_moe", device=device, num_hidden_layers=4),
        cache=4,
        prefetch=asyncmoe.Prefetch(sources=("gate", "transition"), depth=depth),
    )
    providers = [m.asyncmoe for _, m in find_experts(model)]
    caches = [p.cache for p in providers]
    assert providers[0].prefetch is None  # no layer before the first: no prefetch into it
    g = torch.Generator().manual_seed(1)
    want = [torch.zeros(NUM_EXPERTS, NUM_EXPERTS, device=device) for _ in caches[1:]]
    for _ in range(3):
        model(torch.randint(0, 128, (1, 1), generator=g).to(device))
        for w, before, here in zip(want, caches[:-1], caches[1:], strict=True):
            w.mul_(TRANSITION_DECAY).add_(
                before.routed[:, None].float() * here.routed[None, :].float()
            )
    for w, here in zip(want, providers[1:], strict=True):
        torch.testing.assert_close(
            here.prefetch.transitions, w, atol=0, rtol=1e-6
        )  # a fused multiply-add
    assert all(p.prefetch.transitions.sum() > 0 for p in providers[1:])


@torch.no_grad()
def test_default_prefetch_hits_during_decode():
    """`prefetch=True`, the default settings (on the GPU the default is on; on the CPU it must be asked for)."""
    model = asyncmoe.compile(tiny("qwen3_moe"), cache=4, prefetch=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        model(torch.randint(0, 128, (1, 1), generator=g))
    s = asyncmoe.stats(model)
    t = s.totals
    assert t["prefetched"] > 0 and t["prefetch_hits"] > 0 and t["wasted"] <= t["prefetched"]
    assert t["hits_gate"] + t["hits_temporal"] + t["hits_transition"] >= t["prefetch_hits"]
    assert s.layers[0].prefetched == 0  # nothing precedes the first MoE layer
    assert "prefetch hits by predictor" in str(s)


@torch.no_grad()
def test_linked_layers_share_one_unmeasured_pace_on_the_cpu():
    """Every prefetching layer's gate reads one pace; on the CPU nothing measures it (no GPU clock, no streams),
    so the gate keeps MIN_PRECISION and `stats` prints no pace line."""
    model = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4, prefetch=True)
    providers = [m.asyncmoe for _, m in find_experts(model)]
    caches = [p.cache for p in providers]
    assert len({c.pace.data_ptr() for c in caches}) == 1
    assert not any(
        p.stamps or p.laps for p in providers
    )  # the window is measured on the GPU clock only
    model(torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0)))
    s = asyncmoe.stats(model)
    assert caches[0].pace.tolist() == [0, 0, 0] and s.min_precision == 0.5
    assert s.totals["prefetched"] > 0 and "prefetch gate:" not in str(s)


@pytest.mark.parametrize("depth", [1, 2])
def test_links_name_the_previous_layer_and_the_targets(depth):
    plan = asyncmoe.Prefetch(sources=("gate", "transition"), depth=depth)
    model = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4, prefetch=plan)
    p = [m.asyncmoe for _, m in find_experts(model)]
    for i, provider in enumerate(p):
        assert isinstance(provider.links, Links) and provider.plan is plan
        assert provider.links.previous is (p[i - 1].cache if i else None)
        assert provider.links.targets == tuple(p[i + 1 : i + 1 + depth])
        assert provider.wait == (i > 0) and provider.per_token == TOP_K
    assert not any(
        isinstance(m, CachedProvider) for q in p for m in q.children()
    )  # links are not submodules
    off = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4, prefetch=False)
    assert all(
        m.asyncmoe.links.targets == () and m.asyncmoe.plan is None for _, m in find_experts(off)
    )
