"""The offline simulator (trace/simulate.py): the runtime's own counters from a recorded trace, plain LRU, the
Belady bound against a brute-force optimum, the predictors on the embedded model's trace, the compiled step,
and the `asyncmoe simulate` command."""

import copy
import functools
import itertools
import json
import re
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import asyncmoe
from asyncmoe import cli
from asyncmoe.cache.policies import POLICIES
from asyncmoe.cli import main
from asyncmoe.trace import Trace
from asyncmoe.trace import simulate as simulator
from asyncmoe.trace.simulate import belady_misses, budget_slots, simulate

from models import tiny
from traces import demo_trace, random_trace


@torch.no_grad()
def decode_like(model, tokens):
    """One token per call, as decoding does: the calls the simulator replays one by one."""
    for t in tokens:
        model(torch.tensor([[t]]), use_cache=False)


def test_record_then_simulate_gives_the_runtimes_own_counters(tmp_path):
    ref = tiny("qwen3_moe")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, policy="lru", prefetch=False)
    tokens = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    with asyncmoe.record(model) as rec:
        rec.new_sequence()
        decode_like(model, tokens)
    rec.trace.save(tmp_path / "run.npz")
    trace = Trace.load(tmp_path / "run.npz")
    assert (
        trace.ids.shape == (60, 2, 2)
        and trace.starts.tolist() == [0]
        and trace.weights.shape == (60, 2, 2)
    )
    sim = simulate(trace, cache=4, policy="lru", compiled=False)
    runtime = asyncmoe.stats(model)
    assert [(r.hits, r.misses) for r in sim.layers] == [(r.hits, r.misses) for r in runtime.layers]


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
    assert [r.misses for r in sim.layers] == [
        plain_lru_misses(trace.ids[:, layer], 4) for layer in range(2)
    ]


def test_lru_with_several_experts_per_token_stays_close_to_ordered_dict():
    """k > 1: experts used by the same token tie on recency; asyncmoe breaks ties by slot, OrderedDict by order."""
    trace = random_trace(5, N=400, L=2, E=16, k=3)
    sim = simulate(trace, cache=6, policy="lru", compiled=False)
    for layer, r in enumerate(sim.layers):
        assert abs(r.misses - plain_lru_misses(trace.ids[:, layer], 6)) <= 0.05 * r.lookups


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
            options = (
                [resident | need]
                if evict == 0
                else [
                    (resident - set(out)) | need
                    for out in itertools.combinations(sorted(resident - need), evict)
                ]
            )
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
    assert (
        belady_misses(np.array([[0, 1, 2], [0, 1, 2]]), 2) == 4
    )  # 3, then the one of three not kept
    # 0 waits in one slot while 1, 2, 3 cycle through the other
    assert belady_misses(np.array([[0, 0, 0], [1, 2, 3], [0, 0, 0]]), 2) == 4


@pytest.mark.parametrize("seed", range(3))
def test_belady_bounds_every_policy(seed):
    trace = random_trace(seed, N=200, L=2, E=16, k=2)
    for policy in sorted(POLICIES):
        for prefetch in ((), ("temporal", "transition")):
            sim = simulate(trace, cache=5, policy=policy, prefetch=prefetch, compiled=False)
            assert sim.totals["belady_hit_rate"] >= sim.totals["hit_rate"]


def test_the_default_prefetch_is_the_gate_alone():
    """Temporal nominates what the target routed last call, which is resident: it copies nothing. Its nominations
    are kept from eviction, so at a cache of top-k slots, which they fill, the gate's prefetch evicts by the
    policy alone, which may take one the gate nominated: more misses than the gate alone. Transition alone
    nominates nothing on this trace, and beside the gate at a budget of one it decides nothing: it would only
    cost its update each call (predictors.Prefetch). 128 tokens: ~24 misses per token, and the margins
    are those of 512 (temporal beside the gate: 7% more misses at 128, 5% at 512)."""
    trace = demo_trace(128)
    misses = {}
    for sources in (
        ("gate",),
        ("gate", "transition"),
        ("gate", "temporal", "transition"),
        ("temporal",),
        ("transition",),
        (),
    ):
        sim = simulate(trace, cache=trace.top_k, prefetch=sources, compiled=False)
        misses[sources] = sim.totals["misses_per_token"]
        if sources in (("temporal",), ("transition",)):
            assert sim.totals["prefetched_per_token"] == 0
    assert asyncmoe.Prefetch().sources == ("gate",)
    assert misses[("gate",)] == misses[("gate", "transition")] < misses[()]
    assert misses[("gate", "temporal", "transition")] > 1.01 * misses[("gate",)]


def test_simulate_the_recorded_gate():
    trace = demo_trace(100)  # 18 misses per token without prefetch, as at 300, and the same ratios
    with pytest.raises(ValueError, match="did not record what it predicted"):
        simulate(Trace(trace.ids, 64), cache=16, prefetch=("gate",), compiled=False)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        simulate(Trace(trace.ids, 64), cache=16, prefetch=("temporal",), budget=0, compiled=False)
    plain = simulate(trace, cache=16, compiled=False)
    one, wide = (
        simulate(trace, cache=16, prefetch=("gate",), budget=b, compiled=False)
        for b in (1, trace.top_k)
    )
    assert (
        0 < one.totals["prefetched_per_token"] <= trace.layers < wide.totals["prefetched_per_token"]
    )
    assert one.totals["prefetch_recall"] > 0.05
    assert wide.totals["misses_per_token"] < 0.8 * plain.totals["misses_per_token"]
    assert (
        wide.totals["misses_per_token"]
        < one.totals["misses_per_token"]
        < 0.9 * plain.totals["misses_per_token"]
    )


def test_a_measured_pace_admits_a_second_expert_only_where_its_copy_starts_within_the_window():
    """With the GPU's pace the gate decides as it does there: at a bf16 expert's (a copy outlasts the window)
    budget 2 is budget 1 exactly; at an fp8 expert's (two copies start within it) it prefetches more, and the
    nominations past the first are routed often enough to be copied (1.7x as many prefetches at 100
    tokens, 1.8x at 300)."""
    trace = demo_trace(100)
    runs = {
        (pace, budget): simulate(
            trace, cache=16, prefetch=("gate",), budget=budget, compiled=False, pace_us=pace
        )
        for pace in ((254.0, 210.0), (131.0, 210.0))
        for budget in (1, 2)
    }
    bf16, fp8 = (254.0, 210.0), (131.0, 210.0)
    assert runs[bf16, 2].layers == runs[bf16, 1].layers
    assert (
        runs[fp8, 2].totals["prefetched_per_token"]
        > 1.3 * runs[fp8, 1].totals["prefetched_per_token"]
    )
    assert runs[fp8, 2].totals["misses_per_token"] < runs[fp8, 1].totals["misses_per_token"]
    with pytest.raises(
        ValueError, match=r"pace_us is \(an expert's copy, a layer's window\) in µs, both > 0"
    ):
        simulate(trace, cache=16, prefetch=("gate",), compiled=False, pace_us=(0.0, 210.0))


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            dict(prefetch=("oracle",)),
            r"unknown predictors \['oracle'\]; simulable: gate, temporal, transition",
        ),
        (dict(cache=1), r"cache=1 is below the trace's top_k=2; use cache>=2"),
        (
            dict(hybrid_us=(50, 0, 10, 300)),
            r"hybrid_us is .* each > 0 \(asyncmoe.compile prints a model's, in ns\)",
        ),
        (dict(hybrid_us=(50, 200)), r"hybrid_us is \(a request's round trip"),
        (dict(batch=6), r"batch=6: a step decodes 1 to the trace's 5 tokens"),
        (dict(batch=0), r"batch=0: a step decodes 1 to"),
    ],
)
def test_simulate_refuses_what_it_cannot_run(bad, message):
    with pytest.raises(ValueError, match=message):
        simulate(random_trace(0, N=5), **{"cache": 4, "compiled": False, **bad})


# with the temporal predictor, a budget of 2 and a measured pace: the whole step, prefetch and gate
PACED = dict(cache=4, prefetch=("temporal",), budget=2, pace_us=(254.0, 210.0))


@pytest.fixture(scope="module")
def compiled_paced():
    """`PACED` on random_trace(0) through the compiled step, compiled once for the module (the tests
    that need it share the graph), after a dynamo reset, with `error_on_recompile` (a recompile is an
    error); and the graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        sim = simulate(random_trace(0), **PACED, compiled=True)
    return sim, counters["stats"]["unique_graphs"]


def test_the_compiled_step_counts_as_the_uncompiled_and_compiles_once(compiled_paced):
    """The step over every layer compiles to one graph that every token replays: no recompile as the routing, the
    cache contents, the predictors' state and the clock change (`error_on_recompile` makes one an error), and it
    counts exactly what the uncompiled step counts."""
    compiled, graphs = compiled_paced
    eager = simulate(random_trace(0), **PACED, compiled=False)
    assert graphs == 1
    assert compiled.layers == eager.layers and compiled.totals == eager.totals


def test_compiled_simulator_sweeps_more_configurations_than_dynamos_recompile_limit(compiled_paced):
    trace = random_trace(0, N=40)  # the shapes of the fixture's: its graph serves the first
    with torch._dynamo.config.patch(recompile_limit=1):  # as if 8 configurations had run before
        # the second compiles a second graph of `_step`, without prefetch
        for config in (PACED, dict(cache=6)):
            sim = simulate(trace, **config, compiled=True)
            assert sim.totals["belady_hit_rate"] >= sim.totals["hit_rate"] > 0
            eager = simulate(trace, **config, compiled=False)
            assert sim.layers == eager.layers and sim.totals == eager.totals
        assert (
            torch._dynamo.config.recompile_limit == 1
        )  # simulate's own raise of the limit ends with it


def test_cli_simulate_json(tmp_path, capsys, compiled_paced):
    random_trace(0).save(tmp_path / "t.npz")
    assert (
        main(
            [
                "simulate",
                str(tmp_path / "t.npz"),
                "--cache",
                "4",
                "--prefetch",
                "temporal",
                "--expert-bytes",
                "1000",
                "--json",
                "--compile",
                "off",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {"hit_rate", "belady_hit_rate", "misses_per_token", "bytes_per_token"} <= set(out)
    assert out["belady_hit_rate"] >= out["hit_rate"] and out["bytes_per_token"] > 0
    argv = [
        "simulate",
        str(tmp_path / "t.npz"),
        "--cache",
        "4",
        "--prefetch",
        "temporal",
        "--budget",
        "2",
    ]
    assert main([*argv, "--pace", "254", "210", "--json", "--compile", "off"]) == 0
    paced, _ = compiled_paced  # PACED, compiled, on the trace the file holds
    assert json.loads(capsys.readouterr().out) == json.loads(paced.to_json())


def test_a_budget_gives_the_slots_compile_would():
    """A GPU-memory budget for every layer's slots, divided by one expert's bytes, at most every expert."""
    trace = random_trace(0)  # 3 layers, 12 experts, top-2
    assert budget_slots(trace, "20KB", 1000) == (
        6,
        "cache='20KB' gives 6 slots per MoE layer (3 MoE layers, experts of 1000 B; 17.58 KiB of slots)",
    )
    assert budget_slots(trace, "1GiB", 1000)[0] == 12
    sim = simulate(trace, "20KB", expert_bytes=1000, compiled=False)
    assert sim.cache == 6 and sim.layers == simulate(trace, 6, compiled=False).layers
    with pytest.raises(
        ValueError,
        match=r"holds 1 experts per MoE layer .* smallest budget that works is cache='5.86KiB'",
    ):
        simulate(trace, "5KB", expert_bytes=1000, compiled=False)
    with pytest.raises(ValueError, match="records no expert size to divide it by"):
        simulate(trace, "6GiB", compiled=False)
    with pytest.raises(ValueError, match="the simulator runs on the CPU without one"):
        simulate(trace, "auto", expert_bytes=1000, compiled=False)


def test_progress_hears_of_every_token():
    seen = []
    simulate(
        random_trace(0, N=7),
        4,
        compiled=False,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen == [(done, 7) for done in range(1, 8)]


def test_a_trace_changed_after_it_was_built_is_refused():
    trace = random_trace(0, N=5)
    trace.ids[2, 0] = [3, 3]
    with pytest.raises(ValueError, match="token 2 names expert 3 twice in its layer-0 row"):
        simulate(trace, 4, compiled=False)


def test_cli_simulate_says_what_it_does_before_the_work_and_shows_progress(
    tmp_path, capsys, monkeypatch
):
    """Compiling the step once printed nothing for half a minute: now a line says what runs before anything does,
    a heartbeat counts the compile, and progress the tokens, all on stderr (stdout keeps the table)."""
    random_trace(0).save(tmp_path / "t.npz")
    real, said = simulator.simulate, []

    def slow_to_compile(*args, **kwargs):  # as the command calls it: `compiled` 7th
        said.append(capsys.readouterr().err)
        assert args[6]
        time.sleep(0.3)  # as torch.compile works on the first token
        return real(*args[:6], False, *args[7:], **kwargs)

    monkeypatch.setattr(simulator, "simulate", slow_to_compile)
    monkeypatch.setattr(cli.simulate, "PROGRESS_EVERY_S", {True: 0.05, False: 0.05})
    assert main(["simulate", str(tmp_path / "t.npz"), "--cache", "4", "--compile", "on"]) == 0
    out, err = capsys.readouterr()
    (before,) = said
    assert before.startswith(
        f"asyncmoe simulate: {tmp_path / 't.npz'}: 120 tokens x 3 MoE layers, top-2 of 12 experts; cache 4 slots per "
        "layer, policy markov, prefetch off\ncompiling the simulator step (about 30 s); --compile off"
    )
    assert re.match(r"(compiling \(\d+ s\)\n)+simulated 1/120 tokens", err)
    assert re.search(r"\nsimulated 120/120 tokens \(100%, \d+ s\)\n$", err)
    assert out.startswith("cache 4 slots, policy markov, prefetch off, 120 tokens")


def test_the_step_compiles_only_where_the_trace_wins_its_wait_back(tmp_path, capsys, monkeypatch):
    """Compiling the step costs seconds a layer, won back over tens of thousands of tokens
    (docs/decisions.md#simulator-compile): `--compile auto` runs a short trace eagerly and says nothing of
    compiling; a long one compiles, and says about how long that takes."""

    def tokens(n: int) -> Trace:  # one layer, each token routed to experts 0 and 1
        return Trace(np.tile(np.array([0, 1]), (n, 1, 1)), 12)

    long = tokens(simulator.COMPILE_FROM_TOKENS)
    assert simulator.compiles(long) and not simulator.compiles(random_trace(0))
    assert simulator.compile_seconds(long, ()) < simulator.compile_seconds(long, ("temporal",))
    monkeypatch.setattr(
        simulator, "COMPILE_FROM_TOKENS", 200
    )  # the command on a short "long" trace
    long, compiled = tokens(200), []

    def spy(*args, **kwargs):  # as the command calls it: `compiled` 7th
        compiled.append(args[6])
        return simulate(*args[:6], False, *args[7:], **kwargs)

    monkeypatch.setattr(simulator, "simulate", spy)
    for trace, name in ((random_trace(0), "short.npz"), (long, "long.npz")):
        trace.save(tmp_path / name)
        assert main(["simulate", str(tmp_path / name), "--cache", "2", "--json"]) == 0
    short_err, long_err = capsys.readouterr().err.split("asyncmoe simulate: ")[-2:]
    assert compiled == [False, True] and "\ncompiling" not in short_err
    about = simulator.compile_seconds(long, ())
    assert f"\ncompiling the simulator step (about {about:.0f} s); --compile off skips" in long_err


def test_cli_simulate_takes_a_budget(tmp_path, capsys):
    trace = random_trace(0)
    trace.expert_bytes = 1000
    trace.save(tmp_path / "t.npz")
    for extra in ([], ["--expert-bytes", "2000"]):  # the trace's expert bytes, or the option's
        assert (
            main(
                [
                    "simulate",
                    str(tmp_path / "t.npz"),
                    "--cache",
                    "20KB",
                    "--json",
                    "--compile",
                    "off",
                    *extra,
                ]
            )
            == 0
        )
        out, err = capsys.readouterr()
        slots = 6 if not extra else 3
        assert (
            json.loads(out)["cache"] == slots
            and f"cache='20KB' gives {slots} slots per MoE layer" in err
        )


def test_the_command_speaks_within_a_second_of_starting(tmp_path):
    """`asyncmoe simulate` says what it is doing before it imports torch (seconds): the first line reaches stderr
    within a second of the process starting, whatever the machine takes to load torch after it."""
    random_trace(0).save(tmp_path / "t.npz")
    argv = [
        sys.executable,
        "-m",
        "asyncmoe",
        "simulate",
        str(tmp_path / "t.npz"),
        "--cache",
        "4",
        "--compile",
        "off",
    ]
    start = time.perf_counter()
    with subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    ) as child:
        first = child.stderr.readline()
        took = time.perf_counter() - start
        child.communicate(timeout=600)
    assert first.startswith("asyncmoe simulate: loading torch") and took < 1.0, (first, took)
    assert child.returncode == 0


def test_the_hybrid_splits_the_misses_by_the_runtimes_own_decision():
    """A CPU far slower than a copy takes nothing: the GPU-only counts, exactly. One far faster takes
    every miss, so nothing is ever copied or resident: every lookup misses on the CPU. Between them,
    the misses the CPU computed leave the copies, and count as misses in the hit rate."""
    trace = random_trace(3, N=60)
    gpu = simulate(trace, cache=4, compiled=False).totals
    slow = simulate(trace, cache=4, compiled=False, hybrid_us=(50, 10**6, 10**6, 1)).totals
    assert slow.pop("miss_ms_per_token") == pytest.approx(gpu["misses_per_token"] * 1e-3)
    assert gpu.pop("miss_ms_per_token") is None
    assert slow == gpu and slow["cpu_misses_per_token"] == 0
    fast = simulate(trace, cache=4, compiled=False, hybrid_us=(1, 1, 1, 10**6)).totals
    assert fast["hit_rate"] == 0 and fast["bytes_per_token"] == 0
    assert fast["cpu_misses_per_token"] == fast["misses_per_token"] > 0
    both = simulate(trace, cache=4, compiled=False, hybrid_us=(1, 90, 10, 100)).totals
    assert 0 < both["cpu_misses_per_token"] < both["misses_per_token"]
    assert both["lookups"] == gpu["lookups"] and both["belady_hit_rate"] == gpu["belady_hit_rate"]


def test_batched_steps_give_the_runtimes_own_counters(tmp_path):
    """Decode calls of 3 tokens, top-2 at 4 slots (6 pairs: waves), recorded and simulated in steps
    of 3: each layer's hits and misses are the runtime's. LRU, which the waves the eager runtime
    skips (they tick every slot's clock alike) cannot reorder."""
    ref = tiny("qwen3_moe")
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4, policy="lru", prefetch=False)
    tokens = torch.randint(0, 128, (20, 3), generator=torch.Generator().manual_seed(1))
    with asyncmoe.record(model) as rec, torch.no_grad():
        rec.new_sequence()
        for step in tokens:
            model(step.view(3, 1), use_cache=False)
    trace = rec.trace
    assert trace.ids.shape == (60, 2, 2)
    sim = simulate(trace, cache=4, policy="lru", compiled=False, batch=3)
    runtime = asyncmoe.stats(model)
    assert [(r.hits, r.misses) for r in sim.layers] == [(r.hits, r.misses) for r in runtime.layers]
    assert sim.totals["tokens"] == 60 and json.loads(sim.to_json())["batch"] == 3
    assert sum(r.belady_misses for r in sim.layers) <= sum(r.misses for r in sim.layers)


def test_the_hybrid_takes_a_steps_excess_over_the_slots_however_slow_the_cpu():
    """Steps of 4 tokens, top-2, at 4 slots: a captured step's split leaves the GPU no more experts
    than slots, so a CPU too slow to take any miss of one token still takes the excess."""
    trace = random_trace(3, N=60)
    slow = (50, 10**6, 10**6, 1)
    one = simulate(trace, cache=4, compiled=False, hybrid_us=slow).totals
    four = simulate(trace, cache=4, compiled=False, hybrid_us=slow, batch=4).totals
    assert one["cpu_misses_per_token"] == 0 < four["cpu_misses_per_token"]
    assert four["miss_ms_per_token"] > 0


def test_cli_simulate_takes_hybrid_costs(tmp_path, capsys):
    path = tmp_path / "t.npz"
    random_trace(3, N=30).save(path)
    assert (
        main(
            [
                "simulate",
                str(path),
                "--cache",
                "4",
                "--compile",
                "off",
                "--hybrid",
                "1",
                "90",
                "10",
                "100",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "misses split with the CPU" in out.err
    assert re.search(r"misses the CPU computed per token: (0\.[1-9]|[1-9])", out.out)
    assert re.search(r"the cost model's time for the misses: 0\.\d{3} ms a token", out.out)
    args = ["simulate", str(path), "--cache", "4", "--compile", "off", "--batch", "3", "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "3 tokens a step" in out.err and json.loads(out.out)["batch"] == 3
