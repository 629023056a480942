"""parts.py on the CPU, with the smoke profile's cases: parts by shape and routing, each run as its own pytest
process into its own JSON, stopped at the time limit, cases chosen by what their estimates leave time for,
and what is in --out no longer missing."""

import json
import pathlib

import parts
import report
import test_latency as suite

ROUTER = ["test_latency.py::test_decode[tiny-router-unmodified-cache1-b1]"]
TRACE = ["test_latency.py::test_prefill[tiny-trace-unmodified-cache1-prompt32]"]
UNKNOWN = {node: (("unmodified", node), 0.0, parts.Copies(0.0)) for node in ROUTER + TRACE}  # nothing to go by


def case(system, fraction, counted=False, size="b1"):
    return f"{system}@{fraction}-{size}", ("olmoe-1b-7b", "trace", system, fraction, size), counted


def test_a_part_is_a_comparison_group_in_bundles():
    """A group's uncounted cases, each with what it compares with: the group's resident model and accelerate
    first, then each case with the seed at its cache, counted or not."""
    cases = [case("unmodified", 1.0, True), case("accelerate", 0.25, True), case("seed", 0.25, True),
             case("asyncmoe-graph", 0.25), case("seed", 0.5, True), case("asyncmoe-graph", 0.5),
             case("asyncmoe-graph", 0.125, True), case("unmodified", 1.0, True, "b8")]
    assert parts.parts(cases) == {("olmoe-1b-7b", "trace", "b1"): [["unmodified@1.0-b1", "accelerate@0.25-b1"],
                                                                  ["asyncmoe-graph@0.25-b1", "seed@0.25-b1"],
                                                                  ["asyncmoe-graph@0.5-b1", "seed@0.5-b1"]]}
    skip = {cases[4][1]}  # the seed at 0.5, too long for any call: the row at 0.5 goes without it
    assert parts.parts(cases, skip)[("olmoe-1b-7b", "trace", "b1")][2] == ["asyncmoe-graph@0.5-b1"]


def test_rows_at_one_cache_share_their_seed_where_they_fit():
    estimates = {n: (n, 0.0, t) for n, t in [("u", 10.0), ("eager", 100.0), ("graph", 50.0), ("prefetch", 50.0),
                                               ("seed", 200.0), ("eager2", 10.0)]}
    bundles = [["u"], ["eager", "seed"], ["eager2"], ["graph", "seed"], ["prefetch", "seed"]]
    assert parts.merged(bundles, estimates, 400) == [["u"], ["eager", "seed", "graph"], ["eager2"], ["prefetch", "seed"]]
    assert parts.merged(bundles, estimates, 500) == [["u"], ["eager", "seed", "graph", "prefetch"], ["eager2"]]


def test_too_long_is_what_no_call_can_hold_with_what_it_compares_with():
    cases = [case("unmodified", 1.0), case("accelerate", 0.25), case("seed", 0.25), case("asyncmoe-graph", 0.25),
             case("seed", 0.5), case("asyncmoe-graph", 0.5)]
    estimates = {n: (c[2:4], 0.0, {"accelerate": 100.0, "seed": 300.0}.get(c[2], 50.0)) for n, c, _ in cases}
    estimates["seed@0.5-b1"] = (("seed", 0.5), 0.0, 450.0)
    # the seed at 0.5 with accelerate: 550 s, so the row at 0.5 goes without it (200 s); the row at 0.25 with the
    # seed: 500 s, without it 200 s: the seed goes, not the row
    assert parts.too_long(cases, estimates, 490) == {cases[4][1], cases[2][1]}
    # in 190 s both seeds are too long with accelerate (100 s), and the rows with the resident model and accelerate
    assert parts.too_long(cases, estimates, 190) == {cases[2][1], cases[3][1], cases[4][1], cases[5][1]}


def test_each_part_runs_into_its_own_json(tmp_path):
    todo = {("tiny", "router", "b1"): [[], ROUTER], ("tiny", "trace", "prompt32"): [[], TRACE]}
    parts.run(todo, UNKNOWN, [None, None], 600, tmp_path, "t")  # two workers, as on two GPUs
    for name, nodes in [("t-tiny-router-b1", ROUTER), ("t-tiny-trace-prompt32", TRACE)]:
        run = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert sorted(b["fullname"].split("::")[-1] for b in run["benchmarks"]) == sorted(n.split("::")[-1] for n in nodes)
        assert (tmp_path / f"ids-{name}.txt").read_text().split() == nodes
        assert all(node in (tmp_path / f"bench-{name}.txt").read_text() for node in nodes)  # named as each starts


def test_a_part_running_at_the_limit_is_stopped(tmp_path):
    todo = {("tiny", "router", "b1"): [[], ROUTER], ("tiny", "trace", "prompt32"): [[], TRACE]}
    seconds = parts.EXIT_S + 1  # stopped before pytest has collected
    parts.run(todo, UNKNOWN, [None], seconds, tmp_path, "t", start_s=0)
    assert f"stopped {parts.EXIT_S} s before the {seconds} s limit" in (tmp_path / "bench-t-tiny-router-b1.txt").read_text()
    assert not (tmp_path / "bench-t-tiny-router-b1.json").exists()
    assert not (tmp_path / "ids-t-tiny-trace-prompt32.txt").exists()


def test_a_part_is_stopped_in_time_to_exit_by_the_limit(tmp_path, monkeypatch):
    """A killed part takes seconds to exit (call 17 of 2026-11-30: 577 s for a 572 s limit, cutting the call)."""
    timeouts = []
    monkeypatch.setattr(parts.subprocess, "run", lambda *args, timeout, **kwargs: timeouts.append(timeout))
    parts.run({("tiny", "router", "b1"): [[], ROUTER]}, UNKNOWN, [None], 100, tmp_path, "t", start_s=0)
    assert len(timeouts) == 1 and 100 - parts.EXIT_S - 1 < timeouts[0] <= 100 - parts.EXIT_S


def test_no_part_starts_in_less_time_than_its_start_up(tmp_path):
    parts.run({("tiny", "router", "b1"): [[], ROUTER]}, UNKNOWN, [None], parts.START_S - 1, tmp_path, "t")
    assert list(tmp_path.iterdir()) == []


def test_a_part_takes_its_baselines_and_the_bundles_that_fit():
    estimates = {"u": ("U", 5.0, 5.0), "a": ("A", 10.0, 30.0), "g1": ("G", 30.0, 70.0), "s1": ("S", 0.0, 10.0),
                 "g2": ("G2", 0.0, 300.0), "g3": ("G", 30.0, 50.0)}  # g1 and g3 share a model: one build
    bundles = [["u", "a"], ["g1", "s1"], ["g2"], ["g3"]]
    assert parts.cost(["g1", "g3"], estimates) == 30.0 + 70.0 + 50.0
    assert parts.fitting(bundles, estimates, 250) == ["u", "a", "g3", "g1", "s1"]  # g2 would be stopped: it waits
    dear_first = {"u": ("U", 0.0, 10.0), "d": ("D", 0.0, 100.0), "c1": ("C1", 0.0, 60.0), "c2": ("C2", 0.0, 60.0)}
    assert parts.fitting([["u"], ["d"], ["c1"], ["c2"]], dear_first, 135) == ["u", "c1", "c2"]  # two rows, not one
    assert parts.fitting(bundles, estimates, 49) == []  # nothing but the baselines fits
    assert parts.fitting([[], ["g3"]], estimates, 60, chosen=["g1"]) == []  # beside g1: 150 s
    assert parts.fitting([[], ["g3"]], estimates, 150, chosen=["g1"]) == ["g3"]


def test_a_case_never_measured_runs_alone_beside_its_baselines(tmp_path, monkeypatch):
    """A case with nothing measured to go by is estimated by its copies (`copies_s`), a guess: taken with others,
    it would be the one the limit stops (call 22 of 2026-11-30). It runs with its group's baselines only, where
    nothing else is taken before it and its copies fit; the group's other bundles wait for the next call (a group
    is one process's), which estimates them by it."""
    estimates = {"u": ("U", 5.0, 5.0), "g1": ("G", 30.0, 70.0), "x1": ("X", 30.0, parts.Copies(100.0)),
                 "x2": ("X", 30.0, parts.Copies(100.0)), "o": ("O", 10.0, 10.0)}
    assert parts.fitting([["u"], ["g1"], ["x1"], ["x2"]], estimates, 400) == ["u", "g1"]
    assert parts.fitting([["u"], ["x1"], ["g1"], ["x2"]], estimates, 400) == ["u", "g1"]  # cheapest first
    assert parts.fitting([["u"], ["x1"], ["x2"]], estimates, 400) == ["u", "x1"]
    assert parts.fitting([["u"], ["x1"]], estimates, 139) == []  # its copies do not fit beside the baselines
    assert parts.fitting([[], ["x1"]], estimates, 400, chosen=["o"]) == []  # not beside another group's cases
    todo = {("olmoe-1b-7b", "router", "b8"): [["u"], ["x1"], ["x2"]], ("olmoe-1b-7b", "router", "b32"): [[], ["o"]],
            ("olmoe-1b-7b", "router", "b1"): [["u"], ["g1"]]}
    ran = []
    monkeypatch.setattr(parts.subprocess, "run", lambda cmd, **kw: ran.append([a for a in cmd if a in estimates]))
    parts.run(todo, estimates, [None], 1000, tmp_path, "t", start_s=0)
    assert ran == [["u", "x1"], ["o", "u", "g1"]]  # x2 waits for a call that can estimate it by x1


def test_a_case_never_measured_is_estimated_by_its_copies():
    """Each MoE layer copies, at each step and at the prompt before each round, the experts its tokens reach
    that its slots do not hold. Mixtral at batch 32: a uniform router reaches all 8 experts (1 - 0.75**32 of
    them), 6 copied at 2/8, 4 at 4/8, none with every expert in a slot; accelerate copies all 8 at every call,
    2 steps and the prompt in each of 2 rounds after a warm-up, at its own rate (its measured 9.7 s a step there)."""
    expert_gb = 3 * 4096 * 14336 * 2 / 1e9
    at = lambda system, fraction: parts.copies_s(("mixtral-8x7b-24l", "router", system, fraction, "b32"))
    six = 6 * (32 + 1) * 6 * 24 * expert_gb / parts.H2D_GB_S * parts.COPY_BOUND  # rounds, calls, experts, layers
    assert abs(at("asyncmoe-eager", 0.25) / six - 1) < 1e-3
    assert abs(at("asyncmoe-graph", 0.5) / (six * 4 / 6) - 1) < 1e-3
    assert at("asyncmoe-graph", 1.0) == 0.0 and at("unmodified", 1.0) == 0.0
    accelerate = 3 * (2 + 1) * 8 * 24 * expert_gb / parts.ACCELERATE_GB_S
    assert abs(at("accelerate", 0.25) / accelerate - 1) < 1e-3 and abs(accelerate / 3 / 3 - 9.7) < 0.1  # a call: 9.7 s
    assert parts.copies_s(("mixtral-8x7b-24l", "router", "asyncmoe-eager", 0.25, "b1")) < at("asyncmoe-eager", 0.25) / 3
    assert isinstance(at("asyncmoe-eager", 0.25), parts.Copies)


def test_groups_of_a_shape_and_routing_share_a_process(tmp_path, monkeypatch):
    """A GPU takes the first group that fits, then the other groups of its shape and routing that fit beside it."""
    estimates = {"b1": (("asyncmoe", 16), 30.0, 100.0), "b8": (("asyncmoe", 16), 30.0, 100.0),
                 "trace": (("asyncmoe", 16), 30.0, 10.0), "b32": (("asyncmoe", 16), 30.0, 250.0)}
    todo = {("olmoe-1b-7b", "router", "b1"): [[], ["b1"]], ("olmoe-1b-7b", "trace", "b1"): [[], ["trace"]],
            ("olmoe-1b-7b", "router", "b32"): [[], ["b32"]], ("olmoe-1b-7b", "router", "b8"): [[], ["b8"]]}
    ran = []
    monkeypatch.setattr(parts.subprocess, "run", lambda cmd, **kw: ran.append([a for a in cmd if a in estimates]))
    parts.run(todo, estimates, [None], 300, tmp_path, "t", start_s=0)
    # b32 fits neither beside them (380 s) nor alone: 280 s, of the 300 the margin leaves 273 (`room`)
    assert ran == [["b1", "b8"], ["trace"]]
    ran.clear()  # a margin of 1.0 leaves 290 s: b32 runs alone after them
    parts.run(todo, estimates, [None], 300, tmp_path, "t", start_s=0, margin=1.0)
    assert ran == [["b1", "b8"], ["trace"], ["b32"]]


def test_an_estimate_is_a_build_and_what_the_same_case_took():
    def case(system, size, setup_s, rounds, mean, cache=16):
        kind, n = ("prompt", int(size[6:])) if size.startswith("prompt") else ("batch", int(size[1:]))
        extra = dict(shape="olmoe-1b-7b", routing="router", system=system, cache=cache, setup_s=setup_s, **{kind: n})
        return dict(extra_info=extra, stats=dict(rounds=rounds, mean=mean))

    runs = [{"benchmarks": [case("asyncmoe-graph", "b8", 0.3, 5, 2.0), case("asyncmoe-eager", "b1", 5.0, 5, 1.0, cache=32),
                            case("seed", "prompt512", 40.0, 2, 30.0), {"extra_info": {}, "stats": {}}]}]  # {}: a cut case
    graph = ("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.25, "b8")
    # the asyncmoe model's build (recorded at another cache), then a warm-up and 5 timed rounds
    assert parts.estimate(graph, runs) == (suite.model_key(graph), 5.0, (5 + 1) * 2.0)
    # a seed prompt 4x as long: 4x the calls, no warm-up round
    assert parts.estimate(("olmoe-1b-7b", "trace", "seed", 0.25, "prompt2048"), runs)[1:] == (40.0, 4 * 2 * 30.0)
    assert parts.estimate(("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.5, "b8"), runs)[2] == 12.0  # another cache's
    no_b32 = ("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.5, "b32")  # nothing at batch 32: its copies
    assert parts.estimate(no_b32, runs)[2] == parts.copies_s(no_b32)
    assert parts.unknown(["x"], {"x": parts.estimate(no_b32, runs)})
    # eager's rounds, and with no prefetch model built at this shape, the build of the one without
    assert parts.estimate(("olmoe-1b-7b", "trace", "asyncmoe-graph-prefetch", 0.5, "b1"), runs)[1:] == (5.0, 6.0)


def test_asyncmoes_build_is_one_that_moves_experts_as_this_cache_does():
    """With every expert in a slot asyncmoe copies none to host memory: its build says nothing of a cache that
    moves experts (call 43 of 2026-12-01: Mixtral's eager at 2/8 estimated from the graph's build at 8/8, 8 s,
    took 30 s), nor the other way."""
    row = lambda system, fraction, setup_s: parts.measured(("olmoe-1b-7b", "router", system, fraction, "b1"), setup_s, 1.0)
    runs = [{"benchmarks": [row("asyncmoe-eager", 0.25, 20.0)]}, {"benchmarks": [row("asyncmoe-graph", 1.0, 2.0)]}]
    build = lambda fraction: parts.estimate(("olmoe-1b-7b", "router", "asyncmoe-graph", fraction, "b1"), runs)[1]
    assert (build(0.5), build(1.0)) == (20.0, 2.0)  # not the newest run's 2 s, at 64/64


def test_an_estimate_takes_the_cases_own_routing_first():
    """At batch 8 the random router spreads a step over more experts than the trace: the other routing's time
    only where the case's own routing has nothing to go by."""
    def row(routing, cache, mean):
        extra = dict(shape="olmoe-1b-7b", routing=routing, system="asyncmoe-graph", cache=cache, batch=8, setup_s=0.0)
        return dict(extra_info=extra, stats=dict(rounds=5, mean=mean))

    runs = [{"benchmarks": [row("router", 16, 3.0), row("trace", 16, 2.0), row("trace", 32, 1.0)]}]
    at = lambda routing, fraction: parts.estimate(("olmoe-1b-7b", routing, "asyncmoe-graph", fraction, "b8"), runs)[2]
    assert (at("router", 0.25), at("trace", 0.25)) == (6 * 3.0, 6 * 2.0)
    assert at("trace", 0.5) == 6 * 1.0
    assert at("router", 0.5) == 6 * 3.0  # its own routing at another cache before the trace's at this one


def test_a_graph_row_is_estimated_from_the_other_graph_row_or_eager_at_its_cache():
    """A step's copies at a cache set its time there: a graph row not measured takes about what the other graph
    row took at its cache, else the eager one, not what the same system took at another cache (call 18 of
    2026-11-30: Qwen3's graph at 16/128, batch 8, estimated from 128/128 at 14 s, took 82). Eager is never
    estimated from a graph row, which runs faster."""
    def row(system, cache, mean):
        extra = dict(shape="olmoe-1b-7b", routing="router", system=system, cache=cache, batch=8, setup_s=0.0)
        return dict(extra_info=extra, stats=dict(rounds=5, mean=mean))

    runs = [{"benchmarks": [row("asyncmoe-graph", 64, 0.5), row("asyncmoe-eager", 16, 4.0),
                            row("asyncmoe-graph-prefetch", 32, 2.0), row("asyncmoe-eager", 32, 3.0)]}]
    at = lambda system, fraction: parts.estimate(("olmoe-1b-7b", "router", system, fraction, "b8"), runs)[2]
    assert at("asyncmoe-graph", 0.25) == 6 * 4.0  # eager at 16/64, not the graph at 64/64
    assert at("asyncmoe-graph", 0.5) == 6 * 2.0  # the other graph row before eager
    assert at("asyncmoe-graph-prefetch", 0.25) == 6 * 4.0
    assert at("asyncmoe-eager", 1.0) == 6 * 4.0  # eager at another cache, the longest of the newest run


def test_the_seeds_prompt_at_another_cache_is_scaled_by_its_calls():
    """The seed feeds a prompt `seed_chunk` tokens a call, cache // top-k: at half the slots, twice the calls
    (call 21 of 2026-11-30: Qwen3's seed at 16/128 estimated unscaled from 64/128, took 3.2x). With every
    expert in a slot it takes the prompt in one call, which says nothing of the calls at a smaller cache."""
    def seed(cache, wall_s):
        extra = dict(shape="olmoe-1b-7b", routing="trace", system="seed", cache=cache, prompt=512, setup_s=1.0,
                     wall_s=1.0 + wall_s)
        return dict(extra_info=extra, stats={})

    at = lambda fraction, runs: parts.estimate(("olmoe-1b-7b", "trace", "seed", fraction, "prompt512"), runs)[2]
    assert at(0.25, [{"benchmarks": [seed(32, 10.0)]}]) == 2 * 10.0  # 256 calls of 2 tokens against 128 of 4
    assert at(0.5, [{"benchmarks": [seed(16, 10.0)]}]) == 10.0 / 2
    # one call at 64/64, moving nothing: not comparable, nothing to go by
    assert isinstance(at(0.25, [{"benchmarks": [seed(64, 10.0)]}]), parts.Copies)
    shorter = dict(seed(32, 10.0), extra_info=dict(seed(32, 10.0)["extra_info"], prompt=128))
    assert at(0.25, [{"benchmarks": [shorter]}]) == 8 * 10.0  # 256 calls of 2 tokens against 32 of 4 for 128 tokens


def test_the_seeds_longer_prompt_is_the_slower_of_its_shorter_prompt_and_its_length_at_other_caches():
    """A seed call costs more in a longer prompt on some routings (call 45 of 2026-12-01: Qwen3's router, 2048
    tokens at 64/128, estimated from 512 tokens, took 1.66x), and more where it holds more tokens on others: each
    scaled by its calls, the slower."""
    seed = lambda fraction, prompt, took: parts.measured(("olmoe-1b-7b", "trace", "seed", fraction, f"prompt{prompt}"), 1.0, took)
    at = lambda runs: parts.estimate(("olmoe-1b-7b", "trace", "seed", 0.25, "prompt2048"), runs)[2]
    short = seed(0.25, 512, 10.0)  # 16 slots: 256 calls of 2 tokens; 1024 for 2048
    assert at([{"benchmarks": [short]}]) == 4 * 10.0
    assert at([{"benchmarks": [short, seed(0.5, 2048, 30.0)]}]) == 2 * 30.0  # 512 calls of 4: 58.6 ms a call
    assert at([{"benchmarks": [short, seed(0.5, 2048, 15.0)]}]) == 4 * 10.0
    # each other cache's newest run, not only the newest of them all
    assert at([{"benchmarks": [short, seed(0.5, 2048, 30.0)]}, {"benchmarks": [seed(0.125, 2048, 5.0)]}]) == 2 * 30.0


def test_another_cache_is_a_smaller_one_first_then_a_larger_one_scaled_never_every_expert_in_a_slot():
    """A smaller cache moves at least as many bytes: an upper bound. A larger one moves fewer: its time scaled by
    the experts not held, here over there (call 40 of 2026-11-30: Mixtral's rows at 2/8 estimated unscaled from
    4/8 took 1.50-1.57x, and one was stopped at the limit). With every expert in a slot nothing moves, so
    such a row says nothing of a cache that moves experts (Mixtral's graph at 2/8, router, batch 1, estimated from
    8/8: 2.6 s, where the eager row at 2/8 took ~42 s), and a graph row there takes the resident model's time
    (Qwen3's graph at 128/128, batch 32, estimated from 64/128: 109 s, took 7)."""
    def row(system, cache, took):
        extra = dict(shape="olmoe-1b-7b", routing="router", system=system, cache=cache, batch=8, setup_s=0.0,
                     wall_s=took)
        return dict(extra_info=extra, stats={})

    runs = [{"benchmarks": [row("asyncmoe-graph", 64, 0.5), row("unmodified", 64, 0.25), row("asyncmoe-eager", 16, 4.0),
                            row("asyncmoe-eager", 64, 1.0), row("asyncmoe-eager", 8, 6.0)]}]
    at = lambda system, fraction, runs=runs: parts.estimate(("olmoe-1b-7b", "router", system, fraction, "b8"), runs)[2]
    assert at("asyncmoe-graph", 0.5) == 6.0  # eager at 8/64, the smaller cache, not the graph at 64/64
    assert at("asyncmoe-eager", 0.5) == 6.0  # not 16/64's: the smaller caches' newest run, the longest there
    assert at("asyncmoe-graph-prefetch", 1.0) == 0.5  # the other graph row at 64/64
    without_graph = [{"benchmarks": runs[0]["benchmarks"][1:]}]
    assert at("asyncmoe-graph", 1.0, without_graph) == 0.25  # the resident model's, not eager's
    larger = [{"benchmarks": [row("asyncmoe-eager", 16, 4.0), row("asyncmoe-eager", 64, 9.0)]}]
    assert at("asyncmoe-eager", 0.125, larger) == 4.0 * (64 - 8) / (64 - 16)  # 56 experts not held against 48
    nothing = [{"benchmarks": [row("asyncmoe-graph", 64, 0.5)]}]
    assert isinstance(at("asyncmoe-graph", 0.25, nothing), parts.Copies)


def test_an_estimate_is_the_newest_runs():
    """The code changes what a case takes: the newest run that measured it says, not the slowest of all."""
    def run(setup_s, mean, **wall_s):
        extra = dict(shape="olmoe-1b-7b", routing="trace", system="seed", cache=16, batch=1, setup_s=setup_s, **wall_s)
        return {"benchmarks": [dict(extra_info=extra, stats=dict(rounds=2, mean=mean))]}

    seed = ("olmoe-1b-7b", "router", "seed", 0.25, "b1")
    assert parts.estimate(seed, [run(15.0, 4.0), run(7.0, 2.0), run(6.0, 3.0)])[1:] == (6.0, 3 * 3.0)
    # where the case's wall time is recorded, all of it but the build: its prompts and graph too, not only its rounds
    assert parts.estimate(seed, [run(15.0, 4.0), run(6.0, 3.0, wall_s=20.0)])[1:] == (6.0, 14.0)


def test_the_simulation_measures_what_it_plans_until_nothing_is_left():
    """From nothing measured, every case at its copies: one group's 15 cases in processes of at most a call each,
    then all counted (`measured` writes what `profile_cases` reads)."""
    calls, after, left_over = parts.simulate([], 540, 2, grep="olmoe-1b-7b-router-b1$")
    assert calls and all(0 < t <= 540 for took in calls for t in took)
    assert not parts.plan(after, parts.room(540), grep="olmoe-1b-7b-router-b1$")[0] and left_over == {}
    left = [c for _, c, counted in report.profile_cases(after) if c[:2] + c[4:] == ("olmoe-1b-7b", "router", "b1") and not counted]
    assert left == []


def test_cases_in_out_are_no_longer_missing(tmp_path):
    """A run in `out` counts as a committed one does: an uncounted case, written there with the rest of its group
    (what it compares with), is no longer missing, and nothing outside the group changes. Any uncounted case
    will do, so the test holds however much of the profile docs/results has measured."""
    before = report.profile_cases(parts.measured_runs(tmp_path))
    case = next(c for _, c, counted in before if not counted)
    group = {n: c for n, c, _ in before if c[:2] + c[4:] == case[:2] + case[4:]}
    run = {"datetime": "2026-12-01T00:00:00", "benchmarks": [parts.measured(c, 1.0, 1.0) for c in group.values()]}
    (tmp_path / "bench-t-x.json").write_text(json.dumps(run))
    after = report.profile_cases(parts.measured_runs(tmp_path))
    assert [n for n, _, counted in after if not counted] == [n for n, _, counted in before if not counted and n not in group]


def test_a_short_call_plans_what_the_longest_call_would(capsys):
    """What no call can hold is judged by the longest call, so a short one starts no row without a baseline that
    a longer call could run beside it; `take` then gives it only the bundles that fit its time."""
    runs = parts.measured_runs(pathlib.Path("/nonexistent"))
    longest = parts.plan(runs, parts.room(parts.CALL_S)), capsys.readouterr().out
    assert (parts.plan(runs, parts.room(185)), capsys.readouterr().out) == longest


def test_the_plan_for_the_committed_runs_keeps_every_comparison_in_one_process(capsys):
    """On docs/results as committed: every case left runs in some bundle, with the group's baselines first and the
    seed at its cache in its own bundle; nothing longer than a process is planned, and what is too long is named."""
    runs = parts.measured_runs(pathlib.Path("/nonexistent"))
    cases = report.profile_cases(runs)
    todo, estimates = parts.plan(runs, 490)
    named = capsys.readouterr().out
    planned = {n for bundles in todo.values() for nodes in bundles for n in nodes}
    never = frozenset(c for n, c, _ in cases if n in named)
    for node, case, counted in report.profile_cases(runs, without=never):  # counted without what is never run
        if node in named:
            assert node not in planned
        elif not counted:
            assert node in planned
    profile = {c for _, c, _ in cases}
    node_of = {c: n for n, c, _ in cases}
    for (shape, routing, size), (first, *rest) in todo.items():
        alone = [set(nodes) <= set(first) for nodes in rest]  # a baseline's own bundle, already in `first`
        assert all(alone) or not any(alone)  # runs alone only where no row is left to run it with
        for nodes in rest:
            assert parts.cost(first + nodes, estimates) <= 490
            for node in nodes:
                case = next(c for n, c, _ in cases if n == node)
                assert case[:2] + case[4:] == (shape, routing, size)
                for base in report.bases(case, profile):
                    assert node_of[base] in first + nodes or node_of[base] in named
    assert parts.plan(runs, 490, grep="qwen3.*-b8")[0].keys() <= {("qwen3-30b-a3b", r, "b8") for r in ("router", "trace")}


def test_a_runs_source_digest_names_the_commit_whose_files_it_ran(tmp_path):
    """What a run records (`tree_files` on disk) and what `--digest REV` prints (`commit_files`) agree on the same
    files, in any order, less what runs leave behind; one byte changed, or a file added, and they do not."""
    head = parts.commit_files("HEAD")
    for name, data in head.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "benchmarks" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "benchmarks" / "__pycache__" / "parts.cpython-312.pyc").write_bytes(b"built")
    (tmp_path / "benchmarks" / ".hypothesis").mkdir()
    (tmp_path / "benchmarks" / ".hypothesis" / "db").write_bytes(b"left by a run")
    assert "asyncmoe/__init__.py" in head and "benchmarks/parts.py" in head
    assert parts.source_digest(parts.tree_files(tmp_path)) == parts.source_digest(head)
    (tmp_path / "asyncmoe" / "__init__.py").write_bytes(head["asyncmoe/__init__.py"] + b" ")
    assert parts.source_digest(parts.tree_files(tmp_path)) != parts.source_digest(head)
    (tmp_path / "asyncmoe" / "__init__.py").write_bytes(head["asyncmoe/__init__.py"])
    (tmp_path / "benchmarks" / "untracked.py").write_bytes(b"")
    assert parts.source_digest(parts.tree_files(tmp_path)) != parts.source_digest(head)
