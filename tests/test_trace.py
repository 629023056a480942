"""Routing traces: record, replay, simulate; the simulator against plain LRU and a brute-force optimum."""

import copy
import functools
import itertools
import json
import pathlib
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch

import asyncmoe
from asyncmoe.cli import main
from asyncmoe.trace import Trace
from asyncmoe.integrations.transformers import find_experts, find_router
from asyncmoe.predict import predictors
from asyncmoe.trace.simulate import belady_misses, gate_scores, simulate

from models import tiny


def demo_trace(tokens: int) -> Trace:
    """The embedded model's first `tokens` held-out tokens of routing, with what its gate predicted."""
    demo = Trace.load(pathlib.Path(__file__).parents[1] / "benchmarks" / "traces" / "demo_val.npz")
    return Trace(demo.ids[:tokens], demo.num_experts, gate_ids=demo.gate_ids[:tokens], gate_probs=demo.gate_probs[:tokens])


def random_trace(seed, N=120, L=3, E=12, k=2, skew=1.3):
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, E + 1) ** skew
    ids = np.stack([np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(L)]) for _ in range(N)])
    return Trace(ids, E)


@torch.no_grad()
def decode_like(model, tokens):
    """One token per call, as decoding does: the calls the simulator replays one by one."""
    for t in tokens:
        model(torch.tensor([[t]]), use_cache=False)


def test_format_round_trip(tmp_path):
    tr = random_trace(0)
    tr.starts = np.array([0, 50])
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.ids, tr.ids) and back.num_experts == 12 and back.starts.tolist() == [0, 50]
    with pytest.raises(ValueError, match=r"must lie in \[0, num_experts=4\)"):
        Trace(np.full((2, 1, 1), 7), 4)
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an asyncmoe trace"):
        Trace.load(tmp_path / "bad.npz")
    gate_ids = np.where(np.arange(3)[None, :, None] == 0, -1, tr.ids[:, :, :1])  # [N, L, 1], none for layer 0
    gated = Trace(tr.ids, 12, gate_ids=gate_ids, gate_probs=np.full(gate_ids.shape, 0.5))
    gated.save(tmp_path / "g.npz")
    back = Trace.load(tmp_path / "g.npz")
    assert np.array_equal(back.gate_ids, gate_ids) and np.array_equal(back.gate_probs, np.full(gate_ids.shape, 0.5))
    with pytest.raises(ValueError, match=r"gate_ids \(120, 2, 1\) and gate_probs \(120, 2, 1\) must both be"):
        Trace(tr.ids, 12, gate_ids=gate_ids[:, :2], gate_probs=np.zeros((120, 2, 1)))


def test_record_then_simulate_gives_the_runtimes_own_counters(tmp_path):
    ref = tiny("qwen3_moe")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, policy="lru", prefetch=False)
    tokens = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    with asyncmoe.record(model) as rec:
        rec.new_sequence()
        decode_like(model, tokens)
    rec.trace.save(tmp_path / "run.npz")
    trace = Trace.load(tmp_path / "run.npz")
    assert trace.ids.shape == (60, 2, 2) and trace.starts.tolist() == [0] and trace.weights.shape == (60, 2, 2)
    sim = simulate(trace, cache=4, policy="lru", compiled=False)
    runtime = asyncmoe.stats(model)
    assert [(r.hits, r.misses) for r in sim.layers] == [(r.hits, r.misses) for r in runtime.layers]


def test_replay_routes_exactly_by_the_trace():
    trace = random_trace(1, N=40, L=1, E=16, k=2)  # one trace layer: every model layer replays it
    model = asyncmoe.compile(tiny("olmoe"), cache=4, replay=trace)
    tokens = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    with asyncmoe.record(model) as rec:
        decode_like(model, tokens)
    got = rec.trace.ids  # [50, 2, 2]: wraps after 40 tokens
    want = np.concatenate([trace.ids, trace.ids[:10]])[:, 0]
    assert np.array_equal(got[:, 0], want) and np.array_equal(got[:, 1], want)


def test_replay_needs_matching_shape():
    with pytest.raises(ValueError, match=r"routes 2 of 16 experts but the trace has 2 of 12"):
        asyncmoe.compile(tiny("olmoe"), cache=4, replay=random_trace(0))


def plain_lru_misses(ids: np.ndarray, cache: int) -> int:
    lru, misses = OrderedDict(), 0
    for row in ids:
        for e in row.tolist():
            if e in lru:
                lru.move_to_end(e)
            else:
                misses += 1
                if len(lru) >= cache:
                    lru.popitem(last=False)
                lru[e] = None
    return misses


@pytest.mark.parametrize("seed", range(3))
def test_lru_equals_a_plain_ordered_dict_lru(seed):
    """With one expert per token LRU is unambiguous; the simulator must match OrderedDict exactly."""
    trace = random_trace(seed, N=300, L=2, E=10, k=1)
    sim = simulate(trace, cache=4, policy="lru", compiled=False)
    assert [r.misses for r in sim.layers] == [plain_lru_misses(trace.ids[:, l], 4) for l in range(2)]


def test_lru_with_several_experts_per_token_stays_close_to_ordered_dict():
    """k > 1: experts used by the same token tie on recency; asyncmoe breaks ties by slot, OrderedDict by order."""
    trace = random_trace(5, N=400, L=2, E=16, k=3)
    sim = simulate(trace, cache=6, policy="lru", compiled=False)
    for l, r in enumerate(sim.layers):
        assert abs(r.misses - plain_lru_misses(trace.ids[:, l], 6)) <= 0.05 * r.lookups


def brute_force_misses(ids: np.ndarray, cache: int) -> int:
    """The optimum by search. A row with more experts than slots (waves) loads what it lacks and then keeps
    any `cache` of the experts it had or loaded, at most cache - 1 of them unused by the row: a
    relaxation of every wave schedule, so its minimum bounds them."""
    rows = [frozenset(r.tolist()) for r in ids]

    @functools.cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(rows):
            return 0
        need = rows[t]
        missing = need - resident
        if len(need) > cache:
            kept = itertools.combinations(sorted(resident | need), cache)
            options = [frozenset(k) for k in kept if len(set(k) - need) < cache]
        else:
            evict = max(0, len(missing) - (cache - len(resident)))
            options = [resident | need] if evict == 0 else [
                (resident - set(out)) | need for out in itertools.combinations(sorted(resident - need), evict)
            ]
        return len(missing) + min(best(t + 1, r) for r in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_brute_force_optimum_on_tiny_traces(seed):
    trace = random_trace(seed, N=9, L=1, E=6, k=2, skew=0.5)
    for cache in (2, 3, 4):
        assert belady_misses(trace.ids[:, 0], cache) == brute_force_misses(trace.ids[:, 0], cache)


@pytest.mark.parametrize("seed", range(6))
def test_belady_with_rows_larger_than_the_cache_equals_the_searched_bound(seed):
    """A batch's step routes to more experts than slots (waves); the floor is then the relaxed optimum."""
    trace = random_trace(seed, N=8, L=1, E=7, k=4, skew=0.5)
    for cache in (1, 2, 3, 5):
        assert belady_misses(trace.ids[:, 0], cache) == brute_force_misses(trace.ids[:, 0], cache)
    assert belady_misses(np.array([[0, 1, 2], [0, 1, 2]]), 2) == 4  # 3, then the one of three not kept
    # 0 waits in one slot while 1, 2, 3 cycle through the other
    assert belady_misses(np.array([[0, 0, 0], [1, 2, 3], [0, 0, 0]]), 2) == 4


@pytest.mark.parametrize("seed", range(3))
def test_belady_bounds_every_policy(seed):
    trace = random_trace(seed, N=200, L=2, E=16, k=2)
    for policy in ("lru", "lfu", "lfru", "fifo"):
        for prefetch in ((), ("temporal", "transition")):
            sim = simulate(trace, cache=5, policy=policy, prefetch=prefetch, compiled=False)
            assert sim.totals["belady_hit_rate"] >= sim.totals["hit_rate"]


def test_record_gate_is_the_gate_predictors_view():
    """Recorded with gate=True, layer l's gate arrays are what the runtime's gate predictor scores from layer
    l-1's MoE input: each token's top-k experts of layer l's router, with their probabilities."""
    model = tiny("olmoe")
    inputs = []
    first, second = [m for _, m in find_experts(model)]
    first.register_forward_pre_hook(lambda m, a, kw: inputs.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad(), asyncmoe.record(model, gate=True) as rec:
        model(torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2)))
    trace = rec.trace
    assert (trace.gate_ids[:, 0] == -1).all()
    weight, bias = find_router(model, *find_experts(model)[1])
    want = torch.zeros(trace.num_experts)
    with torch.no_grad():
        predictors.gate_scores(inputs[0], weight, bias, trace.top_k, want, use_kernel=False)
    got = torch.zeros(12, trace.num_experts).scatter_(1, torch.as_tensor(trace.gate_ids[:, 1]), torch.as_tensor(trace.gate_probs[:, 1]))
    torch.testing.assert_close(got.mean(0), want)


def test_replay_feeds_the_recorded_gate_to_the_gate_predictor():
    """A model replaying a trace predicts with the trace's recorded gate, not with its own router."""
    recorded = tiny("olmoe", seed=3)
    with torch.no_grad(), asyncmoe.record(recorded, gate=True) as rec:
        decode_like(recorded, [5, 9, 17])
    trace = rec.trace
    model = asyncmoe.compile(tiny("olmoe"), cache=4, replay=trace, prefetch=asyncmoe.Prefetch(sources=("gate",)))
    _, second = find_experts(model)[1]
    decode_like(model, [1])  # the first layer's prefetch scores the second for trace row 0
    torch.testing.assert_close(second.asyncmoe.cache.gate, gate_scores(trace)[0, 1])
    assert gate_scores(trace)[0, 1].sum() > 0


def test_the_default_prefetch_is_the_gate_alone():
    """Temporal nominates what the target routed last call, which is resident: it copies nothing. Its nominations
    are kept from eviction, so at a cache of top-k slots, which they fill, the gate's prefetch evicts by the
    policy alone, which may take one the gate nominated: more misses than the gate alone. Transition alone
    nominates nothing on this trace, and beside the gate at a budget of one it decides nothing: it would only
    cost its update each call (predictors.Prefetch)."""
    trace = demo_trace(512)
    misses = {}
    for sources in (("gate",), ("gate", "transition"), ("gate", "temporal", "transition"), ("temporal",), ("transition",), ()):
        sim = simulate(trace, cache=trace.top_k, prefetch=sources, compiled=False)
        misses[sources] = sim.totals["misses_per_token"]
        if sources in (("temporal",), ("transition",)):
            assert sim.totals["prefetched_per_token"] == 0
    assert asyncmoe.Prefetch().sources == ("gate",)
    assert misses[("gate",)] == misses[("gate", "transition")] < misses[()]
    assert misses[("gate", "temporal", "transition")] > 1.02 * misses[("gate",)]


def test_simulate_the_recorded_gate():
    trace = demo_trace(300)
    with pytest.raises(ValueError, match="did not record what it predicted"):
        simulate(Trace(trace.ids, 64), cache=16, prefetch=("gate",), compiled=False)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        simulate(Trace(trace.ids, 64), cache=16, prefetch=("temporal",), budget=0, compiled=False)
    plain = simulate(trace, cache=16, compiled=False)
    one, wide = (simulate(trace, cache=16, prefetch=("gate",), budget=b, compiled=False) for b in (1, trace.top_k))
    assert 0 < one.totals["prefetched_per_token"] <= trace.layers < wide.totals["prefetched_per_token"]
    assert one.totals["prefetch_recall"] > 0.05
    assert wide.totals["misses_per_token"] < 0.8 * plain.totals["misses_per_token"]
    assert wide.totals["misses_per_token"] < one.totals["misses_per_token"] < 0.9 * plain.totals["misses_per_token"]


def test_compiled_simulator_sweeps_more_configurations_than_dynamos_recompile_limit(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)  # as if 8 configurations had run before
    trace = random_trace(0, N=20, L=2, E=16, k=2)
    for cache in (4, 6):  # the second compiles a second graph of `_step`
        sim = simulate(trace, cache=cache)
        assert sim.totals["belady_hit_rate"] >= sim.totals["hit_rate"] > 0


@pytest.mark.slow
def test_simulator_speed_one_core():
    torch.set_num_threads(1)
    trace = random_trace(3, N=1200, L=4, E=64, k=8)
    simulate(Trace(trace.ids[:5], 64), cache=16)  # compile
    start = time.perf_counter()
    sim = simulate(trace, cache=16)
    per_minute = sim.totals["lookups"] / (time.perf_counter() - start) * 60
    print(f"\nsimulator: {per_minute / 1e6:.2f} M expert lookups per minute on one core (Belady included)")
    assert per_minute >= 1e6


def test_cli_simulate_json(tmp_path, capsys):
    random_trace(0).save(tmp_path / "t.npz")
    assert main(["simulate", str(tmp_path / "t.npz"), "--cache", "4", "--prefetch", "temporal", "--expert-bytes", "1000",
                 "--json", "--no-compile"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"hit_rate", "belady_hit_rate", "misses_per_token", "bytes_per_token"} <= set(out)
    assert out["belady_hit_rate"] >= out["hit_rate"] and out["bytes_per_token"] > 0
