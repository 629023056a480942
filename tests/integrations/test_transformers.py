"""The transformers integration (integrations/transformers.py): every family asyncmoe lists as supported is either
built small and matched against the unmodified model, or skipped with a stated reason; and the helpers that find
experts modules, routers and top-k."""

import copy

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import asyncmoe
from asyncmoe.integrations.transformers import (
    PROVIDER,
    families_hint,
    find_experts,
    find_router,
    is_experts_module,
    num_experts,
    supported_families,
    top_k_of,
)

from models import NUM_EXPERTS, TOP_K, tiny
from sweep import NotShrunk, build, moe_causal_lms

# Families a generic shrink cannot build small, with the reason. Listed, never silently skipped.
CANNOT_BUILD_SMALL = {
    "dots3_note": "attention sizes live in per-layer configs (per_layer_config) the generic shrink does not reach",
    "gemma4": "per-layer-input embeddings stay vocabulary-sized (135M parameters after shrinking)",
    "granitemoehybrid": "the shrunk layer pattern leaves no attention layer for the cache to count positions",
    "inkling2": "its text config keeps a 200k vocabulary the generic shrink does not reach",
    "inkling2_loop": "the same 200k-vocabulary text config as inkling2",
    "mimo_v2_flash": "separate sliding-window head geometry the generic shrink leaves inconsistent",
    "qwen4_exp": "its attention indexer needs token_budget/compress_ratio, which have no generic small value",
}
WELL_KNOWN = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
LMS = moe_causal_lms()


def not_run_because(family: str) -> str | None:
    """Why the sweep does not run a listed family, or None where it does."""
    if family not in LMS:
        return f"{family}: no causal-LM class on the experts interface (a multimodal or encoder-only family)"
    if family in CANNOT_BUILD_SMALL:
        return f"{family} cannot be built small: {CANNOT_BUILD_SMALL[family]}"
    return None


def test_well_known_families_are_listed_and_run():
    listed = set(supported_families())
    assert set(WELL_KNOWN) <= listed
    assert [f for f in WELL_KNOWN if not_run_because(f)] == []  # the sweep runs each of them
    assert set(LMS) <= listed  # every causal LM on the interface is in the list users are shown
    skipped = {f: not_run_because(f) for f in sorted(listed) if not_run_because(f)}
    print(
        f"\nsweep: {len(listed) - len(skipped)} of {len(listed)} listed families run; skipped: {skipped}"
    )


@pytest.mark.parametrize("family", supported_families())
@torch.no_grad()
def test_family_matches_unmodified(family):
    reason = not_run_because(family)
    if reason is not None:
        pytest.skip(reason)
    for cls in LMS[family]:
        try:
            ref = build(cls)
        except NotShrunk:
            continue  # a composite class of a family whose text-only LM is built instead
        top_k = max(top_k_of(m.config) or 1 for _, m in find_experts(ref))
        model = asyncmoe.compile(copy.deepcopy(ref), cache=max(top_k, 3), prefetch=True)
        g = torch.Generator().manual_seed(0)
        for shape in [(2, 9), (1, 1), (3, 4)]:
            ids = torch.randint(3, 100, shape, generator=g)
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
            assert diff <= 1e-5, f"{cls.__name__} {shape}: max |diff| {diff:.2e}"
        assert asyncmoe.stats(model).totals["misses"] > 0
        return
    pytest.fail(f"no causal-LM class of {family} could be built small")


def test_families_hint_names_the_list():
    hint = families_hint()
    assert hint.startswith(
        f"supported: the {len(supported_families())} families on transformers' experts interface"
    )
    assert all(f in hint for f in WELL_KNOWN)


def test_the_asyncmoe_implementation_is_registered():
    assert "asyncmoe" in ALL_EXPERTS_FUNCTIONS
    model = asyncmoe.compile(tiny("olmoe"), cache=4)
    assert all(
        m.config._experts_implementation == "asyncmoe" and hasattr(m, PROVIDER)
        for _, m in find_experts(model)
    )


def test_find_experts_and_their_routers():
    model = tiny("olmoe")
    experts = find_experts(model)
    assert [name for name, _ in experts] == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert all(is_experts_module(m) and num_experts(m) == NUM_EXPERTS for _, m in experts)
    assert not is_experts_module(model.model.layers[0].mlp)
    for name, m in experts:
        weight, bias = find_router(model, name, m)
        assert weight is model.get_submodule(name.rpartition(".")[0]).gate.weight and bias is None
    name, m = find_experts(tiny("gpt_oss"))[0]
    weight, bias = find_router(tiny("gpt_oss"), name, m)
    assert weight.shape == (NUM_EXPERTS, 32) and bias is not None and bias.shape == (NUM_EXPERTS,)
    # experts already in 4-bit codes (an MXFP4 checkpoint, or quantized on the way in): the same router
    for quantize in ("mxfp4", "int4"):
        model = asyncmoe.compile(tiny("gpt_oss", intermediate_size=32), cache=4, quantize=quantize)
        for name, m in find_experts(model):
            block = model.get_submodule(name.rpartition(".")[0])
            assert find_router(model, name, m)[0] is block.router.weight
            assert (
                getattr(m, PROVIDER).router[0] is block.router.weight
            )  # the gate predictor has it


def test_top_k_of_a_config():
    class Config:
        pass

    c = Config()
    assert top_k_of(c) is None
    c.moe_k = [1, 3]  # per-layer: the largest
    assert top_k_of(c) == 3
    c.num_experts_per_tok = 0  # not positive: look further
    assert top_k_of(c) == 3
    c.num_experts_per_tok = 2
    assert top_k_of(c) == 2 == top_k_of(tiny("mixtral").config) == TOP_K
