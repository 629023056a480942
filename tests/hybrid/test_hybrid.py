"""Hybrid execution (hybrid/): a cached layer's misses split between the slots and the host's CPU.

The model must compute what the GPU-only cache computes: greedy tokens equal over 64 steps in
float32 activations (eager, `generate`, the Decoder; its graph on CUDA), logits within the format's
tolerance, whatever the split. On the CPU the costs are given so that the CPU takes about half of
the misses; on CUDA the calibrated costs decide, and a second model takes given costs.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import pytest
import torch

import asyncmoe
from asyncmoe.cache.state import COUNTERS, Counter
from asyncmoe.hybrid import calibrate
from asyncmoe.hybrid.calibrate import decode_miss_ns, pays
from asyncmoe.hybrid.split import TOKENS, Cost
from asyncmoe.integrations import install
from asyncmoe.integrations.install import _calibrated
from asyncmoe.integrations.transformers import PROVIDER, find_experts

from greedy import GREEDY, STEPS, assert_same_greedy, prompt
from models import NUM_EXPERTS, tiny


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """torch's small ops on one thread: on a host whose cores are busy, a second one's barrier waits
    for a scheduler slice (tens of ms), which the calibration would time as the copy's cost."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def providers(model):
    return [getattr(m, PROVIDER) for _, m in find_experts(model)]


# costs by hand, in ns: with these, a call's misses split about evenly
EVEN = asyncmoe.HybridCosts(round_trip=1, per_expert=10, per_pair=1, copy=10)


def hybrid(model, quantize=None, device="cpu", hybrid_costs=EVEN, **kw):
    return asyncmoe.compile(
        copy.deepcopy(model),
        cache=4,
        quantize=quantize,
        device=device,
        hybrid=True,
        hybrid_costs=hybrid_costs,
        cpu_threads=2,
        **kw,
    )


def assert_split_both_ways(model) -> None:
    t = asyncmoe.stats(model).totals
    assert t["cpu_misses"] > 0 and t["misses"] > 0, t
    assert t["cpu_experts"] == t["cpu_misses"] and t["cost_ns"] > 0


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
@torch.no_grad()
def test_hybrid_computes_what_the_model_does(family):
    model = tiny(family)
    ours = hybrid(model)
    ids = prompt()
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert_same_greedy(ours, model, ids)
    assert_split_both_ways(ours)


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
@torch.no_grad()
def test_hybrid_quantized_equals_the_gpu_only_cache(quantize):
    model = tiny("olmoe")
    gpu_only = asyncmoe.compile(copy.deepcopy(model), cache=4, quantize=quantize, hybrid=False)
    ours = hybrid(model, quantize)
    ids = prompt()
    torch.testing.assert_close(ours(ids).logits, gpu_only(ids).logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.generate(ids, **GREEDY), gpu_only.generate(ids, **GREEDY))
    assert_split_both_ways(ours)


@torch.no_grad()
def test_hybrid_under_torch_compile_fullgraph():
    model = tiny("olmoe")
    ours = hybrid(model)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    for ids in prompt().split(2, dim=1):  # calls of decode size (one wave), each its own split
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert_split_both_ways(ours)


@torch.no_grad()
def test_the_cpus_experts_are_routed_but_not_copied():
    """One call from empty caches: each layer's `routed` holds every expert it routed to, the CPU's
    too (so the next call's temporal prefetch may admit them), and its slots only the link's misses."""
    ours = hybrid(tiny("olmoe"))
    ours(prompt()[:, :2])  # 2 tokens x top-2 <= 4 slots: one wave, split
    split = 0
    for p in providers(ours):
        c = dict(zip(COUNTERS, p.cache.counters.tolist(), strict=True))
        assert c["hits"] == 0 and int(p.cache.routed.sum()) == c["misses"] + c["cpu_misses"]
        assert int((p.cache.expert_to_slot[:NUM_EXPERTS] >= 0).sum()) == c["misses"]
        split += c["cpu_misses"] > 0 and c["misses"] > 0
    assert split > 0


@torch.no_grad()
def test_the_next_call_finds_the_cpus_experts_prefetched():
    """The cache learns from what the CPU computed: a layer's `routed` holds the CPU's experts, so the
    temporal predictor nominates them for the layer's next call and the prefetch copies them in the
    background; a next call that routes them again finds them resident, not computed on the CPU."""
    ours = hybrid(tiny("olmoe"), prefetch=asyncmoe.Prefetch(sources=("temporal",), budget=4))
    ids = prompt()[:, :2]  # 2 tokens x top-2 <= 4 slots: one wave, split
    ours(ids)
    target = providers(ours)[1]  # the first layer has no layer before it to prefetch into it
    first = dict(zip(COUNTERS, target.cache.counters.tolist(), strict=True))
    on_cpu = target.cache.routed & (target.cache.expert_to_slot[:NUM_EXPERTS] < 0)
    assert first["cpu_misses"] > 0 and int(on_cpu.sum()) == first["cpu_misses"]
    asyncmoe.stats(ours, reset=True)
    ours(ids)  # the same tokens route the same experts
    again = dict(zip(COUNTERS, target.cache.counters.tolist(), strict=True))
    assert bool((target.cache.expert_to_slot[:NUM_EXPERTS][on_cpu] >= 0).all())
    assert again["prefetch_hits"] == first["cpu_misses"] and again["cpu_misses"] == 0


def one_wave_a_call(model) -> bool:
    """Whether every layer served each of its calls in one wave: its clock counts waves, `calls`
    the calls."""
    return all(int(p.cache.clock) == int(p.cache.counters[Counter.CALLS]) for p in providers(model))


def batch(size=4, length=6) -> torch.Tensor:
    return torch.randint(3, 128, (size, length), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def test_a_batch_over_the_slots_runs_one_wave_the_cpu_taking_the_excess():
    """Batch 4 at cache 4 (8 pairs > 4 slots) under torch.compile(fullgraph=True), whose shapes fix
    the waves: the CPU takes the misses the slots cannot hold, so each layer's call is one wave, and
    the logits are the model's."""
    model = tiny("olmoe")
    ours = hybrid(model)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    for ids in batch().split(1, dim=1):
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert one_wave_a_call(ours)
    assert_split_both_ways(ours)


@torch.no_grad()
def test_eager_calls_over_the_slots_split_by_cost_in_the_waves_they_fill():
    """Eager, a call of more distinct experts than slots splits by cost alone: a CPU slower than the
    link takes none and the GPU runs waves; at even costs both take some, the GPU's share in as
    many waves as it fills. Batch 4 at cache 4, decode-sized calls: the logits are the model's."""
    model = tiny("olmoe")
    slow_cpu = dataclasses.replace(EVEN, round_trip=10**6)
    for costs in (slow_cpu, EVEN):
        ours = hybrid(model, hybrid_costs=costs)
        over = 0  # layer calls of more distinct experts than slots
        for ids in batch(length=3).split(1, dim=1):  # [4, 1] each
            torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
            over += sum(int(p.cache.routed.sum()) > 4 for p in providers(ours))
        t = asyncmoe.stats(ours).totals
        assert over > 0 and not one_wave_a_call(ours)
        assert (t["cpu_misses"] > 0) == (costs is EVEN) and t["misses"] > 0, t


@torch.no_grad()
def test_eager_the_cpu_takes_no_expert_of_more_tokens_than_the_costs_timed():
    """A prompt whose experts carry many tokens each: the CPU, however fast the costs say it is, takes
    only experts of at most `split.TOKENS` tokens, those the calibration timed; the rest go to the
    GPU in waves."""
    model = tiny("olmoe")
    fast_cpu = asyncmoe.HybridCosts(round_trip=1, per_expert=1, per_pair=1, copy=10**6)
    ours = hybrid(model, hybrid_costs=fast_cpu)
    routed = {}  # each experts module's top_k_index

    def record(module, args, kwargs):
        routed[module] = args[1] if len(args) > 1 else kwargs["top_k_index"]

    for _, m in find_experts(ours):
        m.register_forward_pre_hook(record, with_kwargs=True)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(routed) == len(providers(ours))
    for m, ids in routed.items():
        p = getattr(m, PROVIDER)
        tokens = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
        few = int(((tokens > 0) & (tokens <= TOKENS)).sum())
        many = int((tokens > TOKENS).sum())
        c = dict(zip(COUNTERS, p.cache.counters.tolist(), strict=True))
        assert c["cpu_misses"] == few and c["misses"] == many and few > 0 and many > 0


@torch.no_grad()
def test_a_batch_over_the_slots_decodes_the_models_tokens():
    """Greedy tokens of batch 4 at cache 4 through the eager Decoder equal the unmodified model's
    (its calls over the slots split, the GPU's share in waves)."""
    model = tiny("olmoe")
    ours = hybrid(model)
    ids, steps = batch(), 16
    want = asyncmoe.Decoder(model, 4, 32, graph=False).generate(ids, steps).tokens
    got = asyncmoe.Decoder(ours, 4, 32, graph=False).generate(ids, steps).tokens
    assert torch.equal(got, want)


@torch.no_grad()
def test_calls_over_one_cpu_request_stay_on_the_gpu_in_waves():
    """A prompt longer than one CPU request (`max_tokens`, here 8) of more distinct experts than
    slots runs in waves, with no CPU share."""
    model = tiny("olmoe")
    ours = hybrid(model)
    ex = providers(ours)[0].hybrid.executor
    ex.settings = dataclasses.replace(ex.settings, max_tokens=8)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    t = asyncmoe.stats(ours).totals
    assert t["cpu_misses"] == 0 and t["misses"] > 0 and not one_wave_a_call(ours)


@pytest.mark.parametrize(
    "shape",
    [{}, dict(hidden_size=256, intermediate_size=512)],
    ids=["tiny", "1.5MiB-experts"],
)
def test_calibration_measures_this_host(shape, capsys):
    """Every cost above zero, on the tiny model's microsecond experts and on experts of 1.5 MiB
    alike; one tensor for every layer; read back by stats; printed once."""
    ours = asyncmoe.compile(tiny("olmoe", **shape), cache=4, hybrid=True, cpu_threads=1)
    costs = asyncmoe.stats(ours).hybrid_costs
    assert all(ns > 0 for ns in vars(costs).values()), costs
    cost = providers(ours)[0].hybrid.cost
    assert cost.tolist() == [getattr(costs, c.name.lower()) for c in Cost]
    assert all(p.hybrid.cost is cost for p in providers(ours))
    said = capsys.readouterr().out
    assert said.count("asyncmoe: hybrid") == 1 and f"{costs} in ns (timed on this host)" in said


def test_given_costs_skip_the_calibration_and_read_back(monkeypatch, capsys):
    def timed(*args):
        raise AssertionError("given costs are not timed")

    monkeypatch.setattr(install, "calibrate", timed)
    ours = hybrid(tiny("olmoe"))
    assert asyncmoe.stats(ours).hybrid_costs == EVEN
    assert providers(ours)[0].hybrid.cost.tolist() == [1, 10, 1, 10]
    said = capsys.readouterr().out.splitlines()
    (line,) = [s for s in said if s.startswith("asyncmoe: hybrid")]
    # two layers of 16 experts, 4 resident, top-2 under uniform routing: 1 miss with probability
    # 0.4, 2 with 0.55; the link 10 ns a miss, the split 10 ns for one and 12 for two
    assert line.startswith(f"asyncmoe: hybrid on, by {EVEN} in ns (given)")
    assert "a decode token's misses 0.0212 µs hybrid, 0.03 µs GPU-only" in line, line


def test_bad_costs_are_refused():
    with pytest.raises(
        ValueError, match=r"HybridCosts\(per_pair=0\): each cost is an int of ns >= 1"
    ):
        asyncmoe.HybridCosts(round_trip=1, per_expert=1, per_pair=0, copy=1)
    with pytest.raises(ValueError, match=r"HybridCosts\(copy=2.5\)"):
        asyncmoe.HybridCosts(round_trip=1, per_expert=1, per_pair=1, copy=2.5)
    with pytest.raises(TypeError, match="hybrid_costs must be an asyncmoe.HybridCosts"):
        asyncmoe.compile(tiny("olmoe"), cache=4, hybrid=True, hybrid_costs=[1, 1, 1, 1])
    with pytest.raises(ValueError, match="hybrid=False has no hybrid"):
        asyncmoe.compile(tiny("olmoe"), cache=4, hybrid=False, hybrid_costs=EVEN)
    with pytest.raises(ValueError, match="cache=0 has no hybrid"):
        asyncmoe.compile(tiny("olmoe"), cache=0, hybrid_costs=EVEN)
    with pytest.raises(ValueError, match="pass hybrid=True to split its misses anyway"):
        asyncmoe.compile(tiny("olmoe"), cache=4, hybrid_costs=EVEN)


def noisy(monkeypatch) -> None:
    """A host whose requests take anything from 10 µs to 10 ms; a short budget."""
    gen = torch.Generator().manual_seed(0)
    spread = lambda: float(10 ** (4 + 3 * torch.rand((), generator=gen)))
    monkeypatch.setattr(calibrate, "_request_ns", lambda *args: (spread(), spread()))
    monkeypatch.setattr(calibrate, "BUDGET_S", 0.2)


def test_a_noisy_host_warns_and_keeps_the_default_off(monkeypatch):
    p = providers(hybrid(tiny("olmoe")))[0]
    noisy(monkeypatch)
    with pytest.warns(UserWarning, match=r"hybrid stays off: this host was too noisy .* µs ±"):
        assert _calibrated(p.hybrid.executor, p.cache, asked=None) is None


def test_work_below_the_noise_gives_up_before_the_budget(monkeypatch):
    """Each request's work 0.1 µs an expert and 0.1 a token beside up to 200 µs of noise: after its
    first rounds the spread asks for far more than the budget, so the calibration says so then,
    not at its end."""
    gen = torch.Generator().manual_seed(0)
    noise = lambda: float(200e3 * torch.rand((), generator=gen))

    def request_ns(executor, x, ids, layer):
        work = 1e3 + 100 * len(set(ids.flatten().tolist())) + 100 * ids.numel() + noise()
        return work + 20e3 + noise(), work

    p = providers(hybrid(tiny("olmoe")))[0]
    monkeypatch.setattr(calibrate, "_request_ns", request_ns)
    monkeypatch.setattr(calibrate, "BUDGET_S", 30.0)
    start = time.monotonic()
    with pytest.raises(calibrate.CalibrationError, match=r"the spread so far asks for .* budget"):
        calibrate.calibrate(p.hybrid.executor, p.cache)
    assert time.monotonic() - start < 3.0


def test_a_noisy_host_fails_a_forced_hybrid_without_costs(monkeypatch):
    noisy(monkeypatch)
    with pytest.raises(ValueError, match=r"too noisy to time them .*pass hybrid_costs=asyncmoe"):
        asyncmoe.compile(tiny("olmoe"), cache=4, hybrid=True)


def test_the_default_is_on_where_the_split_pays():
    """`pays`: the CPU takes a decode call's miss where its round trip and work beat a copy."""
    cheap = asyncmoe.HybridCosts(round_trip=5, per_expert=2, per_pair=1, copy=10)
    dear = asyncmoe.HybridCosts(round_trip=100, per_expert=2, per_pair=1, copy=10)
    assert pays(cheap, top_k=2) and not pays(dear, top_k=2)
    assert decode_miss_ns(dear, 16, 4, 2, hybrid=True) == decode_miss_ns(dear, 16, 4, 2, False)
    assert decode_miss_ns(dear, 16, 4, 2, hybrid=False) == pytest.approx(2 * 0.75 * 10)


def test_the_ops_pass_opcheck():
    ours = hybrid(tiny("olmoe"))
    p = providers(ours)[0]
    x = torch.randn(3, 32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 5]])
    torch.library.opcheck(
        torch.ops.asyncmoe.hybrid_send,
        (x, ids, False, True, list(p.cache.state), p.hybrid.cost, p.hybrid.executor.id, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_settings_refuse_what_hybrid_cannot_do():
    with pytest.raises(TypeError, match="hybrid must be"):
        asyncmoe.compile(tiny("olmoe"), cache=4, hybrid="yes")
    with pytest.raises(ValueError, match="cache=0 has no GPU cache"):
        asyncmoe.compile(tiny("olmoe"), cache=0, hybrid=True)
    with pytest.raises(ValueError, match="there are no misses"):
        asyncmoe.compile(tiny("olmoe"), cache=NUM_EXPERTS, hybrid=True)


def test_hybrid_is_off_by_default_on_the_cpu():
    """On the CPU the slots and the host store share one memory: nothing to split."""
    ours = asyncmoe.compile(tiny("olmoe"), cache=4)
    assert all(p.hybrid is None for p in providers(ours))


# --------------------------------------------------------------------------------------------------
# CUDA: the split inside the captured step


@pytest.mark.cuda
@pytest.mark.parametrize("quantize", [None, "fp8", "mxfp4", "int4"])
@torch.no_grad()
def test_hybrid_on_the_gpu_equals_the_gpu_only_cache(quantize):
    """float32 activations: 64 greedy tokens equal eager, under generate and in the Decoder's graph,
    with and without prefetch."""
    model = tiny("olmoe")
    gpu_only = asyncmoe.compile(
        copy.deepcopy(model), cache=4, quantize=quantize, device="cuda", hybrid=False
    )
    ids = prompt("cuda")
    for prefetch in (False, True):
        ours = hybrid(model, quantize, "cuda", prefetch=prefetch)
        torch.testing.assert_close(ours(ids).logits, gpu_only(ids).logits, atol=1e-4, rtol=1e-4)
        assert_same_greedy(ours, gpu_only, ids, graph=True)
        assert_split_both_ways(ours)
        assert asyncmoe.stats(ours).totals["cpu_wait_ns"] > 0


@pytest.mark.cuda
@torch.no_grad()
def test_a_batch_over_the_slots_captures_without_waves():
    """Batch 4 at cache 4 (8 pairs > 4 slots) captured in the Decoder's graph without waves=True: the
    CPU takes the excess, every step one wave a layer (the eager prompt may run waves), and 64
    greedy tokens equal the GPU-only cache's (which needs waves=True) in float32."""
    model = tiny("olmoe")
    gpu_only = asyncmoe.compile(copy.deepcopy(model), cache=4, device="cuda", hybrid=False)
    ours = hybrid(model, device="cuda")
    ids = batch().cuda()
    n = ids.shape[1] + STEPS
    want = asyncmoe.Decoder(gpu_only, 4, n, graph=True, waves=True).generate(ids, STEPS).tokens
    with pytest.raises(ValueError, match="waves=True"):
        asyncmoe.Decoder(gpu_only, 4, n, graph=True)
    dec = asyncmoe.Decoder(ours, 4, n, graph=True)
    assert torch.equal(dec.generate(ids, STEPS).tokens, want)
    assert_split_both_ways(ours)
    dec.prefill(ids)
    waves = lambda: [
        (int(p.cache.clock), int(p.cache.counters[Counter.CALLS])) for p in providers(ours)
    ]
    before = waves()
    dec.decode(8)  # graph replays
    assert all(c - c0 == k - k0 > 0 for (c0, k0), (c, k) in zip(before, waves(), strict=True))


@pytest.mark.cuda
@torch.no_grad()
def test_hybrid_on_the_gpu_in_bf16_and_compiled():
    model = tiny("gpt_oss", dtype=torch.bfloat16)
    gpu_only = asyncmoe.compile(copy.deepcopy(model), cache=4, device="cuda", hybrid=False)
    ours = hybrid(model, device="cuda")
    ids = prompt("cuda")
    got, want = ours(ids).logits.float(), gpu_only(ids).logits.float()
    assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 5e-2
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits, ours(ids).logits, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.timing
@torch.no_grad()
def test_the_default_calibrates_on_this_host(capsys):
    """hybrid=None on CUDA: on where the calibrated CPU takes some of a decode call's misses, off
    (with a warning) where its work is below the timings' noise. Forced, on experts of 1.5 MiB whose
    work stands above that noise: every cost timed, positive, printed."""
    ours = asyncmoe.compile(tiny("olmoe"), cache=4, device="cuda")
    hybrids = {id(p.hybrid) for p in providers(ours)}
    model = tiny("olmoe", hidden_size=256, intermediate_size=512)
    forced = asyncmoe.compile(model, cache=4, device="cuda", hybrid=True)
    costs = asyncmoe.stats(forced).hybrid_costs
    with capsys.disabled():
        print(f"\n1.5 MiB experts' calibrated costs: {costs}; tiny model's hybrid on by default: "
              f"{hybrids != {id(None)}}")  # fmt: skip
    assert all(ns > 0 for ns in vars(costs).values()), costs


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [{}, dict(hidden_size=256, intermediate_size=512)],
    ids=["tiny", "1.5MiB-experts"],
)
def test_calibrations_repeat(shape, capsys):
    """Printed, not asserted past positive costs: ten calibrations of one model, how long each took,
    how many ran out of budget, and each cost's spread over those that did not (max / min)."""
    p = providers(asyncmoe.compile(tiny("olmoe", **shape), cache=4, hybrid=True,
                                   hybrid_costs=EVEN, cpu_threads=1))[0]  # fmt: skip
    runs, seconds, noisy = [], [], 0
    for _ in range(10):
        start = time.monotonic()
        try:
            runs.append(calibrate.calibrate(p.hybrid.executor, p.cache))
        except calibrate.CalibrationError:
            noisy += 1
        seconds.append(time.monotonic() - start)
    spread = {
        name: max(getattr(c, name) for c in runs) / min(getattr(c, name) for c in runs)
        for name in vars(EVEN)
    }
    with capsys.disabled():
        print(
            f"\n{shape or 'tiny'}: {noisy} of 10 too noisy; seconds each (median, max) "
            f"{statistics.median(seconds):.2f}, {max(seconds):.2f}; spread "
            + ", ".join(f"{k} {v:.2f}x" for k, v in spread.items())
        )
    assert all(ns > 0 for c in runs for ns in vars(c).values())
