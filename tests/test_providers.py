"""Providers on one experts module: waves == single path, the resident passthrough, post-expert norm."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncmoe
import asyncmoe.providers
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.providers import CachedProvider, ResidentProvider

from models import tiny


def experts_of(model):
    return find_experts(model)[0][1]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(3, 9), st.sampled_from(["gpt_oss", "olmoe"]))
@torch.no_grad()
def test_waves_equal_single_path(monkeypatch_seed, tokens, family):
    """Where both apply (distinct experts <= cache < tokens*k), the waves path gives the single path's result."""
    ref = tiny(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4)
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
@pytest.mark.parametrize("fixed, reached, planned, computed", [
    (False, 6, [0, 1], 2), (False, 4, [0, 1], 1), (True, 6, [0, 1, 2, 3], 4), (True, 4, [0, 1, 2, 3], 4),
])
@torch.no_grad()
def test_an_eager_call_stops_after_the_waves_its_experts_fill(monkeypatch, fixed, reached, planned, computed, device):
    """16 tokens x top-2 over 4 slots: shapes alone give 4 waves (16 experts). Routed to 6 experts the call
    fills 2, and eager it computes those 2; routed to 4 it plans wave 1 (where it reads the count) but computes
    only wave 0. A capture or a compile trace (`_fixed_shapes`) runs all 4. All give the model's own output.
    On CUDA the count reaches the host through pinned memory and an event."""
    ref = tiny("olmoe")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, device=device)
    experts, original = experts_of(model), experts_of(ref)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, ref.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(reached, generator=g)[:2] for _ in range(16)])  # experts 0 to reached-1
    w = torch.rand(16, 2, generator=g)
    waves, ensure = [], asyncmoe.ops.ensure
    monkeypatch.setattr(asyncmoe.ops, "ensure", lambda cache, ids, wave, **kw: waves.append(wave) or ensure(cache, ids, wave, **kw))
    computes, routed = [], asyncmoe.providers.routed_outputs
    monkeypatch.setattr(asyncmoe.providers, "routed_outputs", lambda *a: computes.append(1) or routed(*a))
    monkeypatch.setattr(asyncmoe.providers, "_fixed_shapes", lambda x: fixed)
    out = experts(x.to(device), ids.to(device), w.to(device))
    assert (waves, len(computes)) == (planned, computed)
    torch.testing.assert_close(out.cpu(), original(x, ids, w), rtol=0, atol=1e-5 if device == "cpu" else 1e-3)


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
    ms = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark", reason="MuseSpark (and has_post_expert_norm) arrived after transformers 5.17")

    config = ms.MuseSparkTextConfig(
        hidden_size=32, moe_hidden_size=32, moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=8, num_experts_per_tok=2,
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
