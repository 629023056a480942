"""asyncmoe.Decoder: the same tokens as transformers' generate (eager steps on the CPU), its stop at EOS, sampling and
argument checks; on a GPU, graph replay == eager under heavy eviction, prefetch changes nothing, compile paths stay
whole."""

import copy
import dataclasses
import time
import warnings

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import masking_utils

import asyncmoe
from asyncmoe.integrations.replay import rewind_replay
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.prefetch.prefetch_gate import EXPLORE_EVERY
from asyncmoe.runtime.decoder import (
    CHECK_EVERY,
    LEAD,
    cached_providers,
    capturable_masks,
    check_capturable,
    eager_mask,
)

from models import NUM_EXPERTS, TOP_K, tiny
from traces import random_trace

STEPS = 200


def prompts(kind: str, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    if kind == "random":
        return torch.randint(3, 128, (batch, 12), generator=g)
    return torch.randint(3, 128, (batch, 3), generator=g).repeat(1, 4)  # a repeated phrase


def first_eos(new: torch.Tensor, eos: int) -> list[int]:
    """New tokens of each row up to and including its first `eos`, all of them where it has none; [B, n] -> B."""
    return [
        (row == eos).nonzero()[0].item() + 1 if (row == eos).any() else row.numel() for row in new
    ]


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_greedy_equals_transformers_generate(family, batch):
    ref = tiny(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=batch, max_length=48)
    ids = torch.randint(3, 128, (batch, 7), generator=torch.Generator().manual_seed(batch))
    kw = dict(
        max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids)
    )  # EOS and pad: the config's
    start = time.perf_counter()
    out = dec.generate(ids, 24)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert torch.equal(out.tokens, ref.generate(ids, **kw))
    assert out.new_tokens == 24 and out.lengths.tolist() == [7 + 24] * batch
    # the two timed parts cover the call but for its argument checks and the final cut: 23 decode steps
    assert 0.9 * wall_ms <= out.prefill_ms + 23 * out.decode_ms_per_token <= wall_ms
    assert out.tokens_per_s == pytest.approx(1e3 / out.decode_ms_per_token)
    assert torch.equal(dec.generate(ids, 24).tokens, out.tokens)  # a second call reuses everything


@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_eos_ends_each_sequence_as_transformers_does(batch):
    ref = tiny("olmoe")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=batch, max_length=40)
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(2))[:batch]
    mask = torch.ones_like(ids)
    free = ref.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
    )
    eos = free[0, 7 + 3].item()  # the 4th new token of the first sequence
    ends = first_eos(free[:, 7:], eos)
    if batch == 3:
        assert len(set(ends)) == 3, ends  # the prompts make the sequences finish at different steps
    want = ref.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        eos_token_id=eos,
        pad_token_id=0,
        do_sample=False,
    )
    assert want.shape[1] == 7 + max(ends) < 7 + 30
    out = dec.generate(ids, 30, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.tokens, want)
    assert out.lengths.tolist() == [7 + e for e in ends] and out.new_tokens == max(ends)
    assert (
        dec.length - 7 < 30
    )  # the loop ended once every sequence had finished, not at max_new_tokens
    streamed = []
    dec.generate(ids, 30, eos_token_id=eos, pad_token_id=0, callback=streamed.append)
    assert streamed == out.tokens[:, 7:].T.tolist()  # streaming ends at the last EOS
    assert dec.length == 7 + max(ends)


@torch.no_grad()
def test_eos_and_pad_default_to_the_generation_config():
    """A list of EOS ids from the model's generation config, and its pad: the first of them (the config has none)."""
    ref = tiny("mixtral")
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    free = ref.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
    )
    eos = [free[0, 7 + 3].item(), free[1, 7 + 20].item()]
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = eos, None
    dec = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=4), batch_size=3, max_length=40
    )
    out = dec.generate(ids, 30)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(out.tokens, want)
    ends = [min(first_eos(free[r : r + 1, 7:], e)[0] for e in eos) for r in range(3)]
    assert out.lengths.tolist() == [7 + e for e in ends] and len(set(ends)) > 1
    for row, end in zip(out.tokens, ends, strict=True):
        assert (row[7 + end :] == eos[0]).all()


@torch.no_grad()
def test_sampled_sequences_stop_at_eos_and_are_padded():
    model = asyncmoe.compile(tiny("mixtral"), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=3, max_length=40)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=True, temperature=0.9, seed=3)
    eos = dec.generate(ids, 30, eos_token_id=[], **kw).tokens[0, 5 + 3].item()
    out = dec.generate(ids, 30, eos_token_id=eos, pad_token_id=0, **kw)
    ends = first_eos(out.tokens[:, 5:], eos)
    assert (
        ends[0] <= 4
        and out.lengths.tolist() == [5 + e for e in ends]
        and out.tokens.shape[1] == 5 + max(ends)
    )
    for row, end in zip(out.tokens, ends, strict=True):
        assert (row[5 + end :] == 0).all()


@torch.no_grad()
def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = asyncmoe.compile(tiny("mixtral"), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=2, max_length=40)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=True, temperature=0.9, top_p=0.8, seed=3)
    a, b = dec.generate(ids, 20, **kw), dec.generate(ids, 20, **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(
        a.tokens, dec.generate(ids, 20, do_sample=True, temperature=5.0, seed=4).tokens
    )
    greedy = dec.generate(ids, 20)
    assert torch.equal(dec.generate(ids, 20, do_sample=True, top_k=1, seed=1).tokens, greedy.tokens)
    unfiltered = dec.generate(ids, 20, do_sample=True, seed=1).tokens
    assert torch.equal(
        dec.generate(ids, 20, do_sample=True, top_k=1000, seed=1).tokens, unfiltered
    )  # > vocabulary
    streamed = []
    dec.generate(ids, 6, callback=streamed.append)
    assert streamed == [greedy.tokens[:, 5 + i].tolist() for i in range(6)]


# each is refused by transformers' generate too (top_p above 1 it ignores; here it is an error, as is 0)
HF_REFUSES = [
    dict(max_new_tokens=0),
    dict(max_new_tokens=-3),
    dict(do_sample=True, temperature=0.0),
    dict(do_sample=True, temperature=-1.0),
    dict(do_sample=True, top_k=-1),
    dict(do_sample=True, top_k=2.5),
]
MESSAGES = dict(
    max_new_tokens="max_new_tokens must be an int >= 1",
    temperature="temperature must be a number > 0",
    top_k="top_k must be an int >= 0",
    top_p=r"top_p must be a number in \(0, 1\]",
)


@pytest.mark.parametrize(
    "bad", HF_REFUSES + [dict(do_sample=True, top_p=2.0), dict(do_sample=True, top_p=0.0)]
)
@torch.no_grad()
def test_generate_refuses_what_transformers_refuses(bad):
    ref = tiny("olmoe")
    dec = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=4), max_length=16)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4) | bad
    name = next(k for k in bad if k != "do_sample")
    with pytest.raises(ValueError, match=MESSAGES[name] + f".*got {bad[name]}"):
        dec.generate(ids, **kw)
    if name != "max_new_tokens":
        with pytest.raises(ValueError, match=MESSAGES[name]):
            dec.prefill(ids, **bad)
    if bad in HF_REFUSES:
        with pytest.raises(ValueError, match=name):
            ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(do_sample="yes"), TypeError, "do_sample must be True or False, got 'yes'"),
        (dict(do_sample=1), TypeError, "do_sample must be True or False, got 1"),
        (dict(temperature="hot"), ValueError, "temperature must be a number > 0 .*got 'hot'"),
        (dict(top_p=True), ValueError, r"top_p must be a number in \(0, 1\].*got True"),
        (dict(top_k=2.0), ValueError, "top_k must be an int >= 0.*got 2.0"),
        (
            dict(do_sample=True, temperature=float("inf")),
            ValueError,
            "temperature must be a number > 0 and finite when do_sample=True, got inf",
        ),
        (dict(do_sample=True, temperature=float("nan")), ValueError, "got nan"),
        (dict(do_sample=True, seed="abc"), TypeError, "seed must be an int .* got 'abc'"),
    ],
)
def test_sampling_arguments_are_checked_in_either_mode(bad, error, match):
    """Types whatever the mode (greedy ignores the knobs' values, as transformers does, not their
    types); an infinite temperature, which would sample every token alike, is refused."""
    dec = asyncmoe.Decoder(asyncmoe.compile(tiny("olmoe"), cache=4), max_length=16)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(error, match=match):
        dec.generate(ids, 4, **bad)


@torch.no_grad()
def test_greedy_ignores_the_sampling_knobs():
    """transformers' generate only warns about them without do_sample; so the Decoder uses none of them."""
    dec = asyncmoe.Decoder(asyncmoe.compile(tiny("olmoe"), cache=4), max_length=16)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = dec.generate(ids, 6).tokens
    assert torch.equal(dec.generate(ids, 6, temperature=0.0, top_k=-1, top_p=2.0).tokens, greedy)


def test_bad_stop_tokens_are_refused():
    dec = asyncmoe.Decoder(asyncmoe.compile(tiny("mixtral"), cache=4), max_length=16)
    ids = torch.ones(1, 5, dtype=torch.long)
    with pytest.raises(TypeError, match="eos_token_id must be an int or a list of ints, got 'x'"):
        dec.generate(ids, 4, eos_token_id="x")
    with pytest.raises(ValueError, match=r"eos_token_id must hold token ids >= 0, got \[3, -1\]"):
        dec.generate(ids, 4, eos_token_id=[3, -1])
    with pytest.raises(TypeError, match="pad_token_id must be an int, got 0.5"):
        dec.prefill(ids, pad_token_id=0.5)
    with pytest.raises(
        ValueError, match="pad_token_id=500 is outside the model's vocabulary of 128"
    ):
        dec.generate(ids, 4, eos_token_id=2, pad_token_id=500)
    with pytest.raises(
        ValueError,
        match=r"eos_token_id=\[3, 500\] holds ids outside the model's vocabulary of 128 \(500\): "
        r"the model never produces them.*eos_token_id=\[\]",
    ):
        dec.generate(ids, 4, eos_token_id=[3, 500])


def test_bad_input_names_the_argument():
    model = asyncmoe.compile(tiny("olmoe"), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=2, max_length=16)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError,
        match=r"input_ids must be \[batch, length\], got shape \(5,\); for one prompt use "
        r"input_ids\[None\]",
    ):
        dec.generate(ids[0], 4)
    with pytest.raises(
        TypeError, match=r"input_ids must hold integer token ids, got torch.float32; .*\.long\(\)"
    ):
        dec.generate(ids.float(), 4)
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        dec.prefill(ids.tolist())
    with pytest.raises(ValueError, match="this Decoder was built for batch_size=2; got 1 prompts"):
        dec.generate(ids[:1], 4)
    with pytest.raises(ValueError, match="input_ids has no tokens"):
        dec.prefill(ids[:, :0])
    outside = ids.clone()
    outside[0, 1], outside[1, 3] = -1, 200
    with pytest.raises(
        ValueError, match=r"input_ids must be token ids in \[0, 128\).*got values in \[-1, 200\]"
    ):
        dec.generate(outside, 4)
    with pytest.raises(ValueError, match="decode continues a prefill: call prefill"):
        dec.decode(1)
    dec.prefill(ids)
    for bad in (-5, 1.0, None):
        with pytest.raises(ValueError, match=f"steps must be an int >= 0, got {bad}"):
            dec.decode(bad)
    assert dec.length == 6  # the prompt and its first new token: nothing rewound
    for bad in (-5, 0, 1, 2.0):
        with pytest.raises(
            ValueError, match=f"max_length must be an int >= 2, room for prompt .* got {bad}"
        ):
            asyncmoe.Decoder(model, max_length=bad)
    for bad in (0, -1, True):
        with pytest.raises(
            ValueError, match=f"batch_size must be an int >= 1, the number of prompts .* got {bad}"
        ):
            asyncmoe.Decoder(model, batch_size=bad)


def test_capture_needs_slots_for_the_whole_batch():
    model = asyncmoe.compile(tiny("olmoe"), cache=4)  # top-2: batch 4 may touch 8 experts per layer
    with pytest.raises(
        ValueError,
        match=r"batch 4 needs cache >= min\(num_experts=16, batch\*top_k=8\) = 8 .*Use "
        r"cache>=8, or batch_size<=2, or Decoder\(..., waves=True\) to capture the waves anyway, or "
        r"compile with hybrid=True: its CPU takes the excess",
    ):
        check_capturable(model, batch_size=4)
    check_capturable(model, batch_size=2)


def test_a_hybrid_model_captures_a_batch_over_the_slots():
    """A hybrid layer's CPU takes the experts its slots cannot hold, so a batch of one CPU request
    (`max_tokens`) is one wave: batch 4 at cache 4 needs no waves=True; over the request it does."""
    model = asyncmoe.compile(tiny("olmoe"), cache=4, hybrid=True, cpu_threads=1)
    check_capturable(model, batch_size=4)
    executor = next(p.hybrid.executor for p in cached_providers(model))
    executor.settings = dataclasses.replace(executor.settings, max_tokens=2)
    with pytest.raises(
        ValueError, match=r"batch 4 needs cache >= .*waves=True\) to capture the waves anyway\.$"
    ):
        check_capturable(model, batch_size=4)


def test_prompt_too_long():
    dec = asyncmoe.Decoder(asyncmoe.compile(tiny("olmoe"), cache=4), max_length=10)
    with pytest.raises(
        ValueError, match=r"exceeds max_length=10; use Decoder\(..., max_length=14\)"
    ):
        dec.generate(torch.ones(1, 6, dtype=torch.long), 8)
    with pytest.raises(
        ValueError,
        match=r"prompt length 10 leaves no room in max_length=10; use Decoder\(..., "
        r"max_length=11\)",
    ):
        dec.prefill(torch.ones(1, 10, dtype=torch.long))


def wrong_gate(model: torch.nn.Module) -> list:
    """Give every layer's gate predictor a router whose expert ids are shifted, so that it always predicts wrong and
    every prefetch gate closes; the model's own routers are unchanged. Returns the cached layers' providers."""
    providers = cached_providers(model)
    for p in providers:
        if p.router is not None:
            weight, bias = p.router
            p.router = (weight.roll(5, 0).clone(), bias)
    return providers


def prefetch_steps(dec: asyncmoe.Decoder) -> list[int]:
    """Record the decode step (`dec.length`) of every forward that runs the prefetch."""
    steps = []
    for p in dec.cached:
        p._prefetch = lambda h, run=p._prefetch: steps.append(dec.length) or run(h)
    return steps


@torch.no_grad()
def test_a_step_skips_prefetch_while_every_gate_is_closed():
    """Eager steps (the CPU) follow the gates as graph steps do: once every layer's gate has closed, a step runs
    the prefetch only one in EXPLORE_EVERY, on which closed gates explore; the tokens are transformers' own."""
    ref = tiny("olmoe", num_hidden_layers=4)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, prefetch=True)
    wrong_gate(model)
    dec = asyncmoe.Decoder(model, 1, 7 + 200)
    assert len(dec.gates.flags) == 3  # every cached layer but the first is a prefetch's target
    steps = prefetch_steps(dec)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    out = dec.generate(ids, 200, eos_token_id=[])
    want = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=200,
        do_sample=False,
        eos_token_id=[],
    )
    assert torch.equal(out.tokens, want)
    late = sorted(set(steps))[-4:]
    assert [b - a for a, b in zip(late, late[1:])] == [EXPLORE_EVERY] * 3
    assert len(set(steps)) < 200 // 8
    assert not any(p.prefetch.gate_open_host.item() for p in dec.cached[1:])
    stats = asyncmoe.stats(model)
    assert (
        stats.totals["explored"] >= 3 * 3
    )  # the late prefetching steps explored, in each of the three targets
    assert f"explored {stats.totals['explored']} times with no copy" in str(stats)


def lockstep(
    graphed: asyncmoe.Decoder, eager: asyncmoe.Decoder, ids: torch.Tensor, steps: int
) -> float:
    """Largest |logit difference| between graph replay and eager steps over `steps` greedy steps (no EOS: every
    step decodes)."""
    graphed.prefill(ids, eos_token_id=[])
    eager.prefill(ids, eos_token_id=[])
    worst = (graphed.logits - eager.logits).abs().max().item()
    for _ in range(steps):
        graphed.decode(1)
        eager.decode(1)
        worst = max(worst, (graphed.logits - eager.logits).abs().max().item())
        assert torch.equal(graphed.tok, eager.tok)
    return worst


@pytest.mark.parametrize("window", [None, 3])
def test_the_capturable_eager_mask_is_transformers_own(window):
    causal = masking_utils.causal_mask_function
    fn = causal if window is None else masking_utils.sliding_window_causal_mask_function(window)
    kw = dict(
        batch_size=2, q_length=1, kv_length=9, q_offset=5, mask_function=fn, dtype=torch.bfloat16
    )
    padded = dict(
        kw, q_length=4, q_offset=0, attention_mask=torch.tensor([[1] * 9, [0, 0] + [1] * 7]).bool()
    )
    for args in (kw, padded):
        torch.testing.assert_close(
            eager_mask(**args), masking_utils.eager_mask(**args), rtol=0, atol=0
        )


@torch.no_grad()
def test_capturable_masks_change_no_output_and_are_undone():
    model = tiny("gpt_oss")  # eager attention, sliding-window layers
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    before = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    with capturable_masks():
        assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"] is eager_mask
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"] is before


# batch 4 needs cache >= 4*top_k to capture in one wave (test_capture_needs_slots_for_the_whole_batch); at
# cache = top_k and E/4 its steps capture their waves (waves=True)
CASES = [(1, TOP_K), (1, NUM_EXPERTS // 4), (4, 4 * TOP_K), (4, TOP_K), (4, NUM_EXPERTS // 4)]


# every case in two families, one prompt of each kind (the first two families' prompts random, the
# others' repeated); each family in two or three cases. GPT-OSS: eager attention with sliding windows,
# captured through `capturable_masks`
REPLAY_CASES = [
    (family, ("random", "repeated")[i // 2], batch, cache)
    for i, family in enumerate(["olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
    for j, (batch, cache) in enumerate(CASES)
    if (i + j) % 2 == 0
]


@pytest.mark.cuda
@pytest.mark.parametrize("family, kind, batch, cache", REPLAY_CASES)
@torch.no_grad()
def test_graph_replay_equals_eager_fp32(family, kind, batch, cache):
    ref = tiny(family, device="cuda")
    a = asyncmoe.compile(copy.deepcopy(ref), cache=cache, hybrid=False)  # slots refill: GPU only
    b = asyncmoe.compile(copy.deepcopy(ref), cache=cache, hybrid=False)
    ids = prompts(kind, batch).cuda()
    n = ids.shape[1] + STEPS + 1
    waves = cache < min(NUM_EXPERTS, batch * TOP_K)
    graphed, eager = (
        asyncmoe.Decoder(a, batch, n, graph=True, waves=waves),
        asyncmoe.Decoder(b, batch, n, graph=False),
    )
    assert lockstep(graphed, eager, ids, STEPS) <= 1e-5
    s = asyncmoe.stats(a)
    copies = (
        s.totals["misses"] + s.totals["prefetched"]
    )  # prefetch may fetch an expert before it is missed
    assert (
        copies > STEPS // 4 and s.totals["evictions"] > 0
    )  # slots really were refilled, every few steps
    unmodified = (
        asyncmoe.Decoder(ref, batch, n, graph=False)
        .generate(ids, STEPS + 1, eos_token_id=[])
        .tokens
    )
    assert torch.equal(graphed.history[:, : graphed.length], unmodified)
    print(
        f"\n{family} {kind} batch={batch} cache={cache}: hit rate {100 * s.totals['hit_rate']:.1f}%, "
        f"prefetch recall {100 * s.totals['prefetch_recall']:.1f}%"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
@torch.no_grad()
def test_graph_replay_bf16_within_the_models_own_compile_tolerance(family):
    """bf16: graph vs eager asyncmoe must differ no more than the unmodified model's eager vs compiled runs do."""
    ref = tiny(family, dtype=torch.bfloat16, device="cuda")
    ids = prompts("random", 1).cuda()
    n = ids.shape[1] + 41
    # the unmodified model's own spread: eager vs torch.compile'd forward on the same inputs
    x = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(9)).cuda()
    own = (torch.compile(ref)(x).logits.float() - ref(x).logits.float()).abs().max().item()
    a = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, hybrid=False)
    b = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, hybrid=False)
    worst = lockstep(
        asyncmoe.Decoder(a, 1, n, graph=True), asyncmoe.Decoder(b, 1, n, graph=False), ids, 40
    )
    print(f"\n{family} bf16: graph vs eager {worst:.3e}; unmodified eager vs compiled {own:.3e}")
    assert worst <= max(own, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "budget", [1, TOP_K]
)  # one, and the default: every expert a token routes to
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@torch.no_grad()
def test_prefetch_changes_nothing_in_the_graph(family, budget):
    ref = tiny(family, device="cuda")
    ids = prompts("random", 1).cuda()
    n = ids.shape[1] + 101
    plan = asyncmoe.Prefetch(budget=budget)
    # hybrid off: which misses the CPU computes (in another summation order) depends on the cache
    gpu_only = dict(cache=TOP_K, hybrid=False)
    on = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), prefetch=plan, **gpu_only), 1, n)
    off = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), prefetch=False, **gpu_only), 1, n)
    on.prefill(ids), off.prefill(ids)
    for _ in range(100):
        on.decode(1), off.decode(1)
        assert torch.equal(on.logits, off.logits)
    assert asyncmoe.stats(on.model).totals["prefetched"] > 0


@pytest.mark.cuda
@torch.no_grad()
def test_a_graph_step_without_prefetch_replays_while_every_gate_is_closed():
    """The device writes each gate to pinned memory and the host reads it there: once every gate has closed,
    the step captured without prefetch replays, but for one step in EXPLORE_EVERY, and the logits are those of
    a model without prefetch, step by step."""
    ref = tiny("olmoe", num_hidden_layers=4, device="cuda")
    ids = prompts("random", 1).cuda()
    n = ids.shape[1] + 201
    gpu_only = dict(cache=4, hybrid=False)  # bit for bit: the CPU sums in another order
    on = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), prefetch=True, **gpu_only), 1, n)
    off = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), prefetch=False, **gpu_only), 1, n)
    wrong_gate(on.model)
    on.prefill(ids), off.prefill(ids)
    assert not off.gates and sorted(on._graphs) == [(False, 0, False), (False, 0, True)]
    replays = {key: 0 for key in on._graphs}
    for key, graph in on._graphs.items():
        graph.replay = lambda key=key, run=graph.replay: (
            replays.__setitem__(key, replays[key] + 1) or run()
        )
    for _ in range(200):
        on.decode(1), off.decode(1)
        assert torch.equal(on.logits, off.logits)
        assert len(on._queued) <= LEAD
    print(
        f"\nreplays of 200 steps, with / without prefetch: {replays[(False, 0, True)]} / {replays[(False, 0, False)]}"
    )
    assert replays[(False, 0, False)] > 150
    assert not any(p.prefetch.gate_open_host.item() for p in on.cached[1:])


def api_calls(fn, *prefixes: str) -> list[int]:
    """How many CUDA runtime/driver calls start with each prefix while `fn` runs, as torch.profiler records them
    (cudaGraphLaunch: a graph replay; cudaLaunchKernel, cuLaunchKernel: a kernel launched outside any graph)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return [sum(n.startswith(p) for n in names) for p in prefixes]


@pytest.mark.cuda
@torch.no_grad()
def test_reduce_overhead_compile_keeps_the_moe_layers_in_cudagraphs():
    """mode="reduce-overhead": a whole forward, MoE layers included, replays as one CUDA graph (one graph launch per
    call, next to none of eager's kernel launches), while the routing changes with every prompt and the outputs
    stay eager's."""
    ref = tiny("olmoe", device="cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, hybrid=False)  # misses refill slots
    eager = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, hybrid=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (1, 4), generator=g).cuda() for _ in range(8)]
    warm = 3  # compile and warm-up run, graph recording, first replay
    launches = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel")
    torch._dynamo.reset()
    torch._inductor.config.triton.cudagraph_or_error = True  # any skip raises instead of logging
    try:
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = [step(ids, use_cache=False).logits.clone() for ids in batches[:warm]]
        evictions = asyncmoe.stats(model).totals["evictions"]
        graphs, *kernels = api_calls(
            lambda: outs.extend(
                step(ids, use_cache=False).logits.clone() for ids in batches[warm:]
            ),
            *launches,
        )
    finally:
        torch._inductor.config.triton.cudagraph_or_error = False
    for ids, out in zip(batches, outs, strict=True):
        assert (out - eager(ids, use_cache=False).logits).abs().max().item() <= 1e-5
    assert (
        asyncmoe.stats(model).totals["evictions"] > evictions
    )  # the replays refilled slots: the routing changed
    _, *eager_kernels = api_calls(lambda: eager(batches[0], use_cache=False), *launches)
    calls = len(batches) - warm
    print(
        f"\n{calls} compiled calls: {graphs} graph launches, {sum(kernels)} kernel launches; "
        f"one eager call: {sum(eager_kernels)} kernel launches"
    )
    assert sum(eager_kernels) > 20  # the profiler sees launches at all
    assert graphs == calls  # one graph per call: no partition left the MoE layers out
    assert sum(kernels) * 10 <= sum(eager_kernels) * calls


@pytest.mark.cuda
@torch.no_grad()
def test_transformers_generate_with_static_cache_compiled():
    ref = tiny("olmoe", device="cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    ids = prompts("random", 1).cuda()
    kw = dict(
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert asyncmoe.stats(model).totals["misses"] > 0


@pytest.mark.cuda
@pytest.mark.timing
@pytest.mark.parametrize("prefetch", [False, True])
@torch.no_grad()
def test_stall_timing_in_the_graph(prefetch):
    """GPU-clock stall times: present per layer, within the decode's own elapsed time, and no change to outputs."""
    ref = tiny("olmoe", device="cuda")
    ids = prompts("random", 1).cuda()
    n, steps = ids.shape[1] + 65, 64
    timing = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=prefetch, time_stalls=True)
    timed = asyncmoe.Decoder(timing, 1, n)
    plain = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=prefetch), 1, n
    )
    timed.prefill(ids), plain.prefill(ids)
    asyncmoe.stats(timed.model, reset=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    timed.decode(steps)
    end.record()
    end.synchronize()
    plain.decode(steps)
    assert torch.equal(timed.history, plain.history)
    s = asyncmoe.stats(timed.model)
    elapsed_ns = start.elapsed_time(end) * 1e6
    for (
        layer
    ) in s.layers:  # every call decides on the GPU: its ensure takes time; waits are never negative
        assert layer.calls == steps and layer.ensure_ns > 0 and layer.wait_ns >= 0
        assert 0 < layer.miss_copy_ns < layer.ensure_ns  # its copies, within it
        assert layer.miss_copies == layer.misses  # every miss of a step is one of its copies
    assert (
        0 < s.totals["stall_ns"] < elapsed_ns
    )  # the stalls sit on the compute stream, one after another
    per_call = {k: s.totals[k] / 1e3 / s.totals["calls"] for k in ("wait_ns", "ensure_ns")}
    print(
        f"\nprefetch={prefetch}: per layer call: wait {per_call['wait_ns']:.1f} us, "
        f"ensure {per_call['ensure_ns']:.1f} us; "
        f"stalls {s.totals['stall_ns'] / elapsed_ns:.1%} of the decode; misses {s.totals['misses']}"
    )
    if not prefetch:  # nothing to wait for: the two stamps are one kernel boundary apart
        assert per_call["wait_ns"] < 20
    assert "wait us" in str(s)


@pytest.mark.cuda
@torch.no_grad()
def test_prefetch_pace_is_measured_in_the_graph():
    """The gate's pace: one expert's copy timed at compile, the compute a prefetch hides behind measured on the
    GPU clock in every captured step; one tensor for every layer, kept by a cache clear."""
    ref = tiny("olmoe", device="cuda")
    ids = prompts("random", 1).cuda()
    steps = 64
    # the prompt, prefill's token, the capture step, the timed steps
    dec = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K), 1, ids.shape[1] + 2 + steps
    )
    caches = [m.asyncmoe.cache for _, m in find_experts(dec.model)]
    assert len(caches) > 1 and len({c.pace.data_ptr() for c in caches}) == 1
    dec.prefill(ids)
    dec.decode(1)  # capture
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dec.decode(steps)
    end.record()
    end.synchronize()
    s = asyncmoe.stats(dec.model)
    step_ns = start.elapsed_time(end) * 1e6 / steps
    print(
        f"\ncopy {s.copy_ns / 1e3:.1f} us, window {s.window_ns / 1e3:.1f} us, step {step_ns / 1e3:.1f} us: "
        f"min precision {s.min_precision:.2f}"
    )
    assert 0 < s.copy_ns < 10**7
    assert 0 < s.window_ns < step_ns  # one layer's compute, within the step
    assert "prefetch gate:" in str(s)
    caches[0].clear()
    assert caches[0].pace[2] == s.copy_ns


@pytest.mark.cuda
@torch.no_grad()
def test_graph_stops_at_eos_as_eager_steps_do():
    ref = tiny("olmoe", device="cuda")
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(2)).cuda()
    n, new = 7 + 64, 64
    graphed = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=3 * TOP_K), 3, n, graph=True
    )
    eager = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=3 * TOP_K), 3, n, graph=False
    )
    free = eager.generate(ids, new, eos_token_id=[]).tokens[:, 7:]
    eos = free[0, 3].item()
    ends = first_eos(free, eos)
    want = eager.generate(ids, new, eos_token_id=eos, pad_token_id=0)
    got = graphed.generate(ids, new, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    assert got.lengths.tolist() == [7 + e for e in ends]
    for row, end in zip(got.tokens, ends, strict=True):
        assert (row[7 + end :] == 0).all()


@pytest.mark.cuda
@torch.no_grad()
def test_generate_looks_for_eos_every_few_steps_not_every_token():
    """With an EOS to watch for, the host syncs once every CHECK_EVERY steps; each step is one graph replay."""
    ref = tiny("olmoe", device="cuda")
    ids = prompts("random", 1).cuda()
    dec = asyncmoe.Decoder(
        asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K), 1, ids.shape[1] + STEPS
    )
    free = dec.generate(ids, STEPS, eos_token_id=[]).tokens[0].tolist()  # captures the graph
    eos = next(
        t for t in range(128) if t not in free
    )  # never produced: every step runs, and every check
    calls = ("cudaGraphLaunch", "cudaStreamSynchronize")
    short = api_calls(lambda: dec.generate(ids, 2, eos_token_id=eos), *calls)
    long = api_calls(lambda: dec.generate(ids, STEPS, eos_token_id=eos), *calls)
    print(
        f"\n{STEPS} new tokens: {long[0]} graph launches, {long[1]} stream syncs; 2 new tokens: {short[1]} syncs"
    )
    assert long[0] - short[0] == STEPS - 2
    assert long[1] - short[1] <= STEPS // CHECK_EVERY + 1
    assert dec.history[0, : dec.length].tolist() == free


@pytest.mark.cuda
@torch.no_grad()
def test_graph_steps_count_the_replayed_tokens():
    """A graph replay runs no Python hook: the Decoder counts its steps' tokens, so a trace shorter
    than the run warns where it wraps, once the prompt and the steps pass its 24 tokens."""
    model = asyncmoe.compile(
        tiny("olmoe", device="cuda"), cache=4, replay=random_trace(5, N=24, L=2, E=16, k=2)
    )
    dec = asyncmoe.Decoder(model, 1, 40, graph=True)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
    dec.generate(ids, 2, eos_token_id=[])  # captures; 6 + warm-ups + 1 step
    rewind_replay(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec.generate(ids, 18, eos_token_id=[])  # 6 + 17 = 23 tokens
        assert caught == []
        with pytest.warns(UserWarning, match="the trace's 24 tokens are used up"):
            dec.decode(2)


def test_graph_on_a_cpu_model_refused_at_construction():
    model = asyncmoe.compile(tiny("mixtral"), cache=4)
    with pytest.raises(
        ValueError, match=r"graph=True captures each step in a CUDA graph.*on cpu.*graph=False"
    ):
        asyncmoe.Decoder(model, max_length=16, graph=True)


def test_a_model_without_moe_layers_is_refused_at_construction():
    """The Decoder runs MoE models, compiled or unmodified; a dense one (GPT-2) is refused."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no MoE layer: the Decoder runs"):
        asyncmoe.Decoder(transformers.GPT2LMHeadModel(config), max_length=16)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(graph="yes"), "graph must be True, False or None .*got 'yes'"),
        (dict(waves=1), "waves must be True or False, got 1"),
    ],
)
def test_bool_options_take_bools(bad, match):
    with pytest.raises(TypeError, match=match):
        asyncmoe.Decoder(tiny("olmoe"), max_length=16, **bad)


def test_a_kv_cache_past_the_free_memory_is_refused_before_it_is_allocated():
    """A length past the positions warns as transformers does; one whose KV cache cannot fit in
    memory (here 256 TB: 2 layers, 2 KV heads of 8, keys and values in fp32) is refused."""
    model = asyncmoe.compile(tiny("mixtral"), cache=4)
    with (
        pytest.warns(UserWarning, match="past the model's max_position_embeddings"),
        pytest.raises(
            MemoryError,
            match=r"Decoder\(batch_size=1, max_length=1000000000000\) needs [\d.]+ GiB on cpu for "
            r"its KV cache and token history, but .* is free: give the max_length a run needs",
        ),
    ):
        asyncmoe.Decoder(model, max_length=10**12)


def test_max_length_past_the_positions_warns():
    model = asyncmoe.compile(tiny("mixtral"), cache=4)  # max_position_embeddings=256
    with pytest.warns(
        UserWarning, match=r"max_length=300 is past the model's max_position_embeddings=256"
    ):
        asyncmoe.Decoder(model, max_length=300)
    assert asyncmoe.Decoder(model).max_length == 256  # the default: the model's positions


@pytest.mark.parametrize(
    "device, graph, steps",
    [
        pytest.param("cpu", False, 6, marks=pytest.mark.slow, id="eager-cpu"),
        pytest.param("cuda", True, 24, marks=pytest.mark.cuda, id="graph-cuda"),
    ],
)
@torch.no_grad()
def test_a_compiled_step_decodes_as_the_uncompiled_one(device, graph, steps):
    """Greedy steps of one cached model through a Decoder with compile=True and one without agree."""
    ref = tiny("olmoe", device=device)
    model = asyncmoe.compile(ref, cache=3 * TOP_K)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4)).to(device)
    out = []
    for compiled in (True, False):
        torch._dynamo.reset()
        counters.clear()
        dec = asyncmoe.Decoder(model, 2, 6 + steps, graph=graph, compile=compiled)
        got = dec.generate(ids, steps, eos_token_id=[])
        # Dynamo compiled the steps of the Decoder that asked for it, and nothing for the other
        assert (counters["stats"]["unique_graphs"] > 0) == compiled
        out.append((got.tokens, dec.logits.float().clone()))
    (tokens, logits), (want_tokens, want_logits) = out
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=2e-2, atol=2e-2)


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="compile must be True or False"):
        asyncmoe.Decoder(tiny("olmoe"), 1, 8, graph=False, compile="max-autotune")


def test_no_prefetch_where_the_cpu_takes_a_batchs_excess():
    """A batch whose pairs exceed every hybrid layer's slots never prefetches; one that fits, a layer without the
    hybrid, or a batch past the CPU's request, prefetches as the gates say."""
    from types import SimpleNamespace

    from asyncmoe.runtime.decoder import Gates

    open_gate = SimpleNamespace(
        prefetch=SimpleNamespace(gate_open_host=torch.ones(1, dtype=torch.bool))
    )

    def layer(slots, hybrid=True):
        executor = SimpleNamespace(settings=SimpleNamespace(max_tokens=256))
        return SimpleNamespace(
            links=SimpleNamespace(targets=[open_gate]),
            hybrid=SimpleNamespace(executor=executor) if hybrid else None,
            cache=SimpleNamespace(num_slots=slots),
        )

    def prefetches(providers, batch, top_k=6):
        gates = Gates(providers, batch, top_k)
        return gates.off, [gates.prefetch() for _ in range(3)]

    assert prefetches([layer(16), layer(16)], 8) == (True, [False] * 3)  # 48 pairs over 16 slots
    assert prefetches([layer(16), layer(16)], 2) == (False, [True] * 3)  # 12 pairs fit
    assert prefetches([layer(16), layer(64)], 8) == (False, [True] * 3)  # a layer holds them
    assert prefetches([layer(16), layer(16, hybrid=False)], 8) == (False, [True] * 3)  # waves there
    assert prefetches([layer(16)], 300) == (False, [True] * 3)  # past one CPU request: waves
