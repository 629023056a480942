"""The GPU runtime: graph replay == eager under heavy eviction, prefetch changes nothing, compile paths stay whole."""

import copy

import pytest
import torch

import asyncmoe

from asyncmoe.integrations.transformers import find_experts
from models import NUM_EXPERTS, TOP_K, tiny

pytestmark = pytest.mark.cuda
STEPS = 200


def prompts(kind: str, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    if kind == "random":
        return torch.randint(3, 128, (batch, 12), generator=g)
    return torch.randint(3, 128, (batch, 3), generator=g).repeat(1, 4)  # a repeated phrase


def lockstep(graphed: asyncmoe.Decoder, eager: asyncmoe.Decoder, ids: torch.Tensor, steps: int) -> float:
    """Largest |logit difference| between graph replay and eager steps over `steps` greedy steps."""
    graphed.prefill(ids)
    eager.prefill(ids)
    worst = (graphed.logits - eager.logits).abs().max().item()
    for _ in range(steps):
        graphed.decode(1)
        eager.decode(1)
        worst = max(worst, (graphed.logits - eager.logits).abs().max().item())
        assert torch.equal(graphed.tok, eager.tok)
    return worst


# batch 4 needs cache >= 4*top_k to capture in one wave (test_decoder.py); at cache = top_k and E/4 its steps
# capture their waves (waves=True)
CASES = [(1, TOP_K), (1, NUM_EXPERTS // 4), (4, 4 * TOP_K), (4, TOP_K), (4, NUM_EXPERTS // 4)]


@pytest.mark.parametrize("batch, cache", CASES)
@pytest.mark.parametrize("kind", ["random", "repeated"])
# GPT-OSS is left out: transformers 5.17 builds its sliding-window mask with a host->GPU copy, so even
# the unmodified model cannot be captured by hand ("Cannot copy between CPU and CUDA tensors during
# CUDA graph capture", seen on the H200); its experts layout is covered in eager tests.
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v3"])
@torch.no_grad()
def test_graph_replay_equals_eager_fp32(family, kind, batch, cache):
    ref = tiny(family, device="cuda")
    a = asyncmoe.compile(copy.deepcopy(ref), cache=cache)
    b = asyncmoe.compile(copy.deepcopy(ref), cache=cache)
    ids = prompts(kind, batch).cuda()
    n = ids.shape[1] + STEPS + 1
    waves = cache < min(NUM_EXPERTS, batch * TOP_K)
    graphed, eager = asyncmoe.Decoder(a, batch, n, graph=True, waves=waves), asyncmoe.Decoder(b, batch, n, graph=False)
    assert lockstep(graphed, eager, ids, STEPS) <= 1e-5
    s = asyncmoe.stats(a)
    copies = s.totals["misses"] + s.totals["prefetched"]  # prefetch may fetch an expert before it is missed
    assert copies > STEPS // 4 and s.totals["evictions"] > 0  # slots really were refilled, every few steps
    unmodified = asyncmoe.Decoder(ref, batch, n, graph=False).generate(ids, STEPS + 1).tokens
    assert torch.equal(graphed.history[:, : graphed.length], unmodified)
    print(f"\n{family} {kind} batch={batch} cache={cache}: hit rate {100 * s.totals['hit_rate']:.1f}%, "
          f"prefetch recall {100 * s.totals['prefetch_recall']:.1f}%")


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
    a = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    b = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    worst = lockstep(asyncmoe.Decoder(a, 1, n, graph=True), asyncmoe.Decoder(b, 1, n, graph=False), ids, 40)
    print(f"\n{family} bf16: graph vs eager {worst:.3e}; unmodified eager vs compiled {own:.3e}")
    assert worst <= max(own, 1e-2)


@pytest.mark.parametrize("budget", [1, TOP_K])  # the default, and every slot
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@torch.no_grad()
def test_prefetch_changes_nothing_in_the_graph(family, budget):
    ref = tiny(family, device="cuda")
    ids = prompts("random", 1).cuda()
    n = ids.shape[1] + 101
    plan = asyncmoe.Prefetch(budget=budget)
    on = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=plan), 1, n)
    off = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=False), 1, n)
    on.prefill(ids), off.prefill(ids)
    for _ in range(100):
        on.decode(1), off.decode(1)
        assert torch.equal(on.logits, off.logits)
    assert asyncmoe.stats(on.model).totals["prefetched"] > 0


@torch.no_grad()
def test_reduce_overhead_compile_keeps_the_moe_layers_in_cudagraphs():
    from torch._dynamo.utils import counters

    ref = tiny("olmoe", device="cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    eager = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    torch._dynamo.reset()
    counters.clear()
    torch._inductor.config.triton.cudagraph_or_error = True  # any skip raises instead of logging
    try:
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        g = torch.Generator().manual_seed(0)
        for _ in range(8):
            ids = torch.randint(0, 128, (1, 4), generator=g).cuda()
            out = step(ids, use_cache=False).logits.clone()
            assert (out - eager(ids, use_cache=False).logits).abs().max().item() <= 1e-5
    finally:
        torch._inductor.config.triton.cudagraph_or_error = False
    print(f"\ninductor counters: {dict(counters['inductor'])}")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_partitions"] <= 1


@torch.no_grad()
def test_transformers_generate_with_static_cache_compiled():
    ref = tiny("olmoe", device="cuda")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    ids = prompts("random", 1).cuda()
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert asyncmoe.stats(model).totals["misses"] > 0


@pytest.mark.parametrize("prefetch", [False, True])
@torch.no_grad()
def test_stall_timing_in_the_graph(prefetch):
    """GPU-clock stall times: present per layer, within the decode's own elapsed time, and no change to outputs."""
    ref = tiny("olmoe", device="cuda")
    ids = prompts("random", 1).cuda()
    n, steps = ids.shape[1] + 65, 64
    timed = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=prefetch, time_stalls=True), 1, n)
    plain = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K, prefetch=prefetch), 1, n)
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
    for layer in s.layers:  # every call decides on the GPU: its ensure takes time; waits are never negative
        assert layer.calls == steps and layer.ensure_ns > 0 and layer.wait_ns >= 0
    assert 0 < s.totals["stall_ns"] < elapsed_ns  # the stalls sit on the compute stream, one after another
    per_call = {k: s.totals[k] / 1e3 / s.totals["calls"] for k in ("wait_ns", "ensure_ns")}
    print(f"\nprefetch={prefetch}: per layer call: wait {per_call['wait_ns']:.1f} us, ensure {per_call['ensure_ns']:.1f} us; "
          f"stalls {s.totals['stall_ns'] / elapsed_ns:.1%} of the decode; misses {s.totals['misses']}")
    if not prefetch:  # nothing to wait for: the two stamps are one kernel boundary apart
        assert per_call["wait_ns"] < 20
    assert "wait us" in str(s)


@torch.no_grad()
def test_prefetch_pace_is_measured_in_the_graph():
    """The gate's pace: one expert's copy timed at compile, the compute a prefetch hides behind measured on the
    GPU clock in every captured step; one tensor for every layer, kept by a cache clear."""
    ref = tiny("olmoe", device="cuda")
    ids = prompts("random", 1).cuda()
    steps = 64
    # the prompt, prefill's token, the capture step, the timed steps
    dec = asyncmoe.Decoder(asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K), 1, ids.shape[1] + 2 + steps)
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
    print(f"\ncopy {s.copy_ns / 1e3:.1f} us, window {s.window_ns / 1e3:.1f} us, step {step_ns / 1e3:.1f} us: "
          f"min precision {s.min_precision:.2f}")
    assert 0 < s.copy_ns < 10**7
    assert 0 < s.window_ns < step_ns  # one layer's compute, within the step
    assert "prefetch gate:" in str(s)
    caches[0].clear()
    assert caches[0].pace[2] == s.copy_ns
