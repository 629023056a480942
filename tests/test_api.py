"""The public entry points (api.py): a compiled model against the unmodified transformers model (the reference)
for the families users run most, on the CPU and the GPU; under torch.compile; compile's arguments; stats."""

import copy
import dataclasses
import functools
import pathlib
import zlib

import numpy as np
import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import asyncmoe
from asyncmoe.cache.policies import POLICIES
from asyncmoe.integrations.transformers import PROVIDER, find_experts
from asyncmoe.trace import Trace

from models import FAMILIES, NUM_EXPERTS, TOP_K, tiny

CACHES = [TOP_K, NUM_EXPERTS // 4, NUM_EXPERTS]  # heaviest eviction, a quarter, resident
SHAPES = [
    (1, 1),
    (4, 33),
    (4, 1),
    (1, 33),
    (4, 1),
    (1, 1),
]  # (batch, prompt length); cache state carries over


@functools.cache
def reference(family, dtype=torch.float32, device="cpu"):
    return tiny(family, dtype=dtype, device=device)


@functools.cache
def exact(family):
    model = tiny(family, dtype=torch.float64, device="cuda")
    model.set_experts_implementation("batched_mm")  # grouped_mm has no float64 CUDA kernel
    return model


def cases():
    for family in FAMILIES:
        for cache in CACHES:
            for policy in (
                sorted(POLICIES) if cache < NUM_EXPERTS else ["lfru"]
            ):  # resident: no policy
                yield family, cache, policy


@pytest.mark.parametrize("family, cache, policy", list(cases()))
@torch.no_grad()
def test_logits_equal_unmodified(family, cache, policy):
    ref = reference(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=cache, policy=policy, prefetch=True)
    g = torch.Generator().manual_seed(zlib.crc32(f"{family}{cache}{policy}".encode()))
    for batch, length in SHAPES:
        ids = torch.randint(0, ref.config.vocab_size, (batch, length), generator=g)
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
        assert diff <= 1e-5, (
            f"{family} cache={cache} {policy} batch={batch} len={length}: max |diff| {diff:.2e}"
        )
    if cache < NUM_EXPERTS:  # the cache really worked: experts were copied and evicted
        s = asyncmoe.stats(model)
        assert s.totals["misses"] > 0 and s.totals["evictions"] > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
@torch.no_grad()
def test_greedy_generate_identical(family, cache):
    """asyncmoe's `generate` gives the unmodified model's greedy tokens, or parts from them only where the
    reference's own two best logits tie to the 1e-5 the logits agree to: there a 6e-8 difference picks the other,
    both greedy (qwen3_moe at caches 2 and 4: an exact fp32 tie at the 5th new token on an AVX512 CPU),
    and what follows is no longer comparable."""
    ref = reference(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=cache, prefetch=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, ref.config.vocab_size, (2, 6), generator=g)
    kw = dict(
        max_new_tokens=20,
        do_sample=False,
        min_new_tokens=20,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
        output_logits=True,
        return_dict_in_generate=True,
    )
    want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert got.sequences.shape == want.sequences.shape
    for b, (w, o) in enumerate(zip(want.sequences[:, 6:], got.sequences[:, 6:], strict=True)):
        parted = (w != o).nonzero()
        if len(parted):
            t = parted[0].item()
            logits = want.logits[t][b]  # [vocab]: the reference's at the step where the two part
            gap = (logits[w[t]] - logits[o[t]]).item()
            assert gap <= 1e-5, (
                f"{family} cache={cache}: sequence {b} parts at new token {t}, {gap:.2e} below the best"
            )


def gpu_cases():
    """Every family at every cache size in float32 and at the smallest in bf16. The policies' kernels
    take turns over the families and sizes (each runs in several), as the CPU's cases cross them all."""
    policies = sorted(POLICIES)
    for i, family in enumerate(FAMILIES):
        for j, cache in enumerate(CACHES):
            yield family, torch.float32, cache, policies[(i + j) % len(policies)]
        yield family, torch.bfloat16, TOP_K, "lfru"


@pytest.mark.cuda
@pytest.mark.parametrize("family, dtype, cache, policy", list(gpu_cases()))
@torch.no_grad()
def test_logits_match_unmodified_on_gpu(family, dtype, cache, policy):
    ref = reference(family, dtype, "cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=cache, policy=policy)
    g = torch.Generator().manual_seed(3)
    for batch, length in SHAPES:
        ids = torch.randint(0, 128, (batch, length), generator=g).cuda()
        ours, theirs = model(ids).logits, ref(ids).logits
        if dtype == torch.float32:
            assert (ours - theirs).abs().max().item() <= 1e-5
        else:  # bf16: as close to the fp64 model as the unmodified bf16 model is
            truth = exact(family)(ids).logits
            ours_err = (ours.double() - truth).abs().max().item()
            their_err = (theirs.double() - truth).abs().max().item()
            assert ours_err <= 1.5 * their_err + 1e-3, (
                f"asyncmoe {ours_err:.3e} vs unmodified {their_err:.3e}"
            )


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_greedy_generate_identical_on_gpu_fp32(family):
    ref = reference(family, torch.float32, "cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7)).cuda()
    kw = dict(
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, dtype, tol", [("olmoe", torch.float32, 1e-5), ("gpt_oss", torch.bfloat16, None)]
)
@torch.no_grad()
def test_fullgraph_compile_matches_without_recompiling(family, dtype, tol):
    """torch.compile(fullgraph=True): no graph break, equal to eager, no recompiles as routing changes."""
    ref = tiny(family, dtype=dtype)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, prefetch=True)
    eager = asyncmoe.compile(copy.deepcopy(ref), cache=4, prefetch=True)
    compiles = 0

    def counting_inductor(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=counting_inductor)
    cache = find_experts(model)[0][1].asyncmoe.cache
    contents = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 6), generator=g)
        out = compiled(ids, use_cache=False).logits
        want = eager(ids, use_cache=False).logits
        if (
            tol is None
        ):  # bf16: the compiled graph may fuse differently; hold it to eager's own error vs fp32
            exact = ref.float()(ids, use_cache=False).logits
            ref.to(dtype)
            tol = 2 * (want.float() - exact).abs().max().item() + 1e-2
        assert (out.float() - want.float()).abs().max().item() <= tol
        contents.add(tuple(cache.slot_to_expert.tolist()))
    assert compiles == 1, f"recompiled: {compiles} graphs for one input shape"
    assert len(contents) > 1, "routing never changed the cache contents: the test proves nothing"
    if (
        dtype == torch.float32
    ):  # same routing, same cache decisions (bf16 rounding may flip a near-tie)
        assert asyncmoe.stats(model).totals["misses"] == asyncmoe.stats(eager).totals["misses"]


def test_stats_of_uncompiled_model():
    with pytest.raises(ValueError, match="not asyncmoe-compiled"):
        asyncmoe.stats(tiny("mixtral"))


def test_stats_of_a_resident_model_count_nothing():
    model = asyncmoe.compile(tiny("mixtral"), cache=NUM_EXPERTS)
    s = asyncmoe.stats(model)
    assert s.layers == [] and s.resident_layers == 2 and "all 2 MoE layers resident" in str(s)


@torch.no_grad()
def test_stats_reset_zeroes_the_counters():
    model = asyncmoe.compile(tiny("olmoe"), cache=4)
    model(torch.randint(0, 128, (1, 5)))
    assert asyncmoe.stats(model, reset=True).totals["misses"] > 0
    assert asyncmoe.stats(model).totals["misses"] == 0


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(reset="yes"), TypeError, "reset must be True or False, got 'yes'"),
        (dict(reset=1), TypeError, "reset must be True or False, got 1"),
        (
            dict(group="x"),
            TypeError,
            "group must be a torch.distributed process group.*got str 'x'",
        ),
    ],
)
def test_stats_refuses_bad_arguments(bad, error, match):
    with pytest.raises(error, match=match):
        asyncmoe.stats(asyncmoe.compile(tiny("olmoe"), cache=4), **bad)


def test_stats_of_a_cpu_model_takes_no_group():
    """cache=0 runs no expert parallelism, whose ranks' counters a group sums."""
    model = asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1)
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    with pytest.raises(ValueError, match="cache=0 .* runs no expert parallelism: leave group out"):
        asyncmoe.stats(model, group=group)


@torch.no_grad()
def test_the_default_prefetch_is_off_on_the_cpu_and_true_turns_it_on():
    """On the CPU nothing runs beside a copy, so the default (prefetch=None) is off there; True turns it on."""
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(0))
    default = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4)
    on = asyncmoe.compile(tiny("qwen3_moe", num_hidden_layers=4), cache=4, prefetch=True)
    for _ in range(10):
        default(ids)
        on(ids)
    assert all(m.asyncmoe.plan is None for _, m in find_experts(default))
    assert all(m.asyncmoe.plan == asyncmoe.Prefetch() for _, m in find_experts(on))
    assert asyncmoe.stats(default).totals["prefetched"] == 0
    assert asyncmoe.stats(on).totals["prefetched"] > 0


def small_trace(num_experts=NUM_EXPERTS) -> Trace:
    rng = np.random.default_rng(0)
    return Trace(
        np.stack([rng.choice(num_experts, (2, TOP_K), replace=False) for _ in range(30)]),
        num_experts,
    )


@pytest.mark.parametrize("as_path", [str, pathlib.Path])
@torch.no_grad()
def test_replay_takes_the_path_of_a_trace(tmp_path, as_path):
    trace = small_trace()
    trace.save(tmp_path / "t.npz")
    model = asyncmoe.compile(tiny("olmoe"), cache=4, replay=as_path(tmp_path / "t.npz"))
    with asyncmoe.record(model) as rec:
        for t in range(5):
            model(torch.tensor([[t]]), use_cache=False)
    assert np.array_equal(rec.trace.ids, trace.ids[:5])


def test_replay_of_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"replay=.*nope.npz.*no such trace file"):
        asyncmoe.compile(tiny("olmoe"), cache=4, replay=tmp_path / "nope.npz")


@pytest.mark.parametrize("content", [b"hello, not a trace\n", b"", b"PK\x03\x04 a truncated zip"])
def test_replay_of_a_file_that_is_not_a_trace(tmp_path, content):
    """A clear ValueError naming replay=, and none of numpy's advice to unpickle the file (`allow_pickle`): a trace
    never holds pickled data, and loading an untrusted pickle runs its code."""
    (tmp_path / "bad.npz").write_bytes(content)
    with pytest.raises(ValueError, match=r"replay=.*bad.npz.* is not an asyncmoe trace") as info:
        asyncmoe.compile(tiny("olmoe"), cache=4, replay=tmp_path / "bad.npz")
    assert "allow_pickle" not in str(info.value) and "pickle" not in str(info.value)


def test_replay_of_the_wrong_type():
    with pytest.raises(
        TypeError,
        match="replay must be an asyncmoe.trace.Trace or the path of its .npz file, got dict",
    ):
        asyncmoe.compile(tiny("olmoe"), cache=4, replay={"ids": 1})


def test_compile_returns_the_same_model():
    model = tiny("olmoe")
    assert asyncmoe.compile(model, cache=4) is model


@pytest.mark.parametrize(
    "call",
    [
        lambda x: asyncmoe.compile(x, cache=16),
        lambda x: asyncmoe.stats(x),
        lambda x: asyncmoe.record(x),
        lambda x: asyncmoe.Decoder(x),
    ],
    ids=["compile", "stats", "record", "Decoder"],
)
@pytest.mark.parametrize(
    "given", ["model", None, pathlib.Path("model")], ids=["str", "None", "path"]
)
def test_not_a_model(call, given):
    with pytest.raises(
        TypeError, match=r"model must be a torch.nn.Module \(a transformers model\), got"
    ):
        call(given)


def test_a_path_where_a_model_is_expected_names_from_pretrained():
    with pytest.raises(
        TypeError, match=r"got str; to load a checkpoint from a path use asyncmoe.from_pretrained"
    ):
        asyncmoe.compile("some/checkpoint", cache=16)


def _caches(model):
    """(slots, policy) of each cached layer."""
    caches = [getattr(m, PROVIDER).cache for _, m in find_experts(model)]
    return [(c.num_slots, c.policy) for c in caches]


def test_compile_takes_settings_and_its_keywords_are_the_short_form():
    settings = asyncmoe.Settings(cache=4, policy="lru", prefetch=False)
    ours = asyncmoe.compile(tiny("olmoe"), settings)
    short = asyncmoe.compile(tiny("olmoe"), cache=4, policy="lru", prefetch=False)
    assert _caches(ours) == _caches(short) == [(4, "lru")] * len(find_experts(ours))


def test_keywords_beside_settings_replace_its_fields():
    settings = asyncmoe.Settings(cache=4, policy="lru", prefetch=False)
    model = asyncmoe.compile(tiny("olmoe"), settings, cache=5)
    assert set(_caches(model)) == {(5, "lru")}
    with pytest.raises(ValueError, match="cache=-1: give slots per MoE layer"):  # checked again
        asyncmoe.compile(tiny("olmoe"), settings, cache=-1)


def test_settings_take_keywords_only():
    with pytest.raises(TypeError, match="positional"):
        asyncmoe.Settings(16)
    with pytest.raises(
        TypeError, match=r"takes an asyncmoe.Settings as its second argument, got 16.*cache=16"
    ):
        asyncmoe.compile(tiny("olmoe"), 16)


def test_a_misspelt_option_names_the_valid_ones():
    with pytest.raises(
        TypeError, match=r"'cach' \(did you mean cache\?\); it takes cache, policy"
    ) as info:
        asyncmoe.compile(tiny("olmoe"), cach=16)
    assert "hybrid" in str(info.value)


@pytest.mark.parametrize("call", [asyncmoe.compile, asyncmoe.from_pretrained, asyncmoe.Settings])
def test_help_lists_every_option_with_its_default(call):
    for f in dataclasses.fields(asyncmoe.Settings):
        assert f"  {f.name}={f.default!r}: {f.metadata['doc'][:30]}" in call.__doc__


def test_settings_load_a_replay_path(tmp_path):
    small_trace().save(tmp_path / "t.npz")
    assert isinstance(asyncmoe.Settings(replay=tmp_path / "t.npz").replay, Trace)
