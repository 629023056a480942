"""parts.py on the CPU, with the smoke profile's cases: parts by shape and routing, each run as its own pytest
process into its own JSON, stopped at the time limit, cases chosen by what their estimates leave time for,
and what is in --out no longer missing."""

import json

import parts
import report
import test_latency as suite

ROUTER = ["test_latency.py::test_decode[tiny-router-unmodified-cache1-b1]"]
TRACE = ["test_latency.py::test_prefill[tiny-trace-unmodified-cache1-prompt32]"]


def test_a_part_is_a_comparison_group_in_bundles():
    """A part: the uncounted cases of one shape, routing and batch, each with what it compares with: the group's
    resident model and accelerate first, then per cache size its cases and the seed there, counted or not."""
    def case(system, fraction, counted, size="b1"):
        c = ("olmoe-1b-7b", "trace", system, fraction, size)
        return f"{system}@{fraction}-{size}", c, counted

    cases = [case("unmodified", 1.0, True), case("accelerate", 0.25, True), case("seed", 0.25, True),
             case("asyncmoe-graph", 0.25, False), case("seed", 0.5, True), case("asyncmoe-graph", 0.5, False),
             case("asyncmoe-graph", 0.125, True), case("unmodified", 1.0, True, "b8")]
    assert parts.parts(cases) == {"olmoe-1b-7b-trace-b1": [["unmodified@1.0-b1", "accelerate@0.25-b1"],
                                                           ["asyncmoe-graph@0.25-b1", "seed@0.25-b1"],
                                                           ["asyncmoe-graph@0.5-b1", "seed@0.5-b1"]]}


def test_each_part_runs_into_its_own_json(tmp_path):
    parts.run({"tiny-router": [ROUTER], "tiny-trace": [TRACE]}, {}, [None, None], 600, tmp_path, "t")  # two workers, as on two GPUs
    for name, nodes in [("t-tiny-router", ROUTER), ("t-tiny-trace", TRACE)]:
        run = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert sorted(b["fullname"].split("::")[-1] for b in run["benchmarks"]) == sorted(n.split("::")[-1] for n in nodes)
        assert (tmp_path / f"ids-{name}.txt").read_text().split() == nodes


def test_a_part_running_at_the_limit_is_stopped(tmp_path):
    parts.run({"tiny-router": [ROUTER], "tiny-trace": [TRACE]}, {}, [None], 1, tmp_path, "t", start_s=0)  # before pytest has collected
    assert "stopped at the 1 s limit" in (tmp_path / "bench-t-tiny-router.txt").read_text()
    assert not (tmp_path / "bench-t-tiny-router.json").exists()
    assert not (tmp_path / "ids-t-tiny-trace.txt").exists()


def test_no_part_starts_in_less_time_than_its_start_up(tmp_path):
    parts.run({"tiny-router": [ROUTER]}, {}, [None], parts.START_S - 1, tmp_path, "t")
    assert list(tmp_path.iterdir()) == []


def test_a_part_takes_its_baselines_and_the_bundles_that_fit():
    estimates = {"u": 10.0, "a": 40.0, "g1": 100.0, "s1": None, "g2": 300.0, "g3": 50.0}
    bundles = [["u", "a"], ["g1", "s1"], ["g2"], ["g3"]]
    assert parts.fitting(bundles, estimates, 250) == ["u", "a", "g1", "s1", "g3"]  # g2 would be stopped: it waits
    assert parts.fitting(bundles, estimates, 49) == []  # nothing but the baselines fits
    assert parts.fitting([["u", "a"]], estimates, 60) == ["u", "a"]  # only they are left to measure


def test_an_estimate_is_a_build_and_what_the_same_case_took_on_either_routing():
    def case(system, size, setup_s, rounds, mean, cache=16):
        kind, n = ("prompt", int(size[6:])) if size.startswith("prompt") else ("batch", int(size[1:]))
        extra = dict(shape="olmoe-1b-7b", routing="router", system=system, cache=cache, setup_s=setup_s, **{kind: n})
        return dict(extra_info=extra, stats=dict(rounds=rounds, mean=mean))

    runs = [{"benchmarks": [case("asyncmoe-graph", "b8", 0.3, 5, 2.0), case("asyncmoe-eager", "b1", 5.0, 5, 1.0, cache=32),
                            case("seed", "prompt512", 40.0, 2, 30.0), {"extra_info": {}, "stats": {}}]}]  # {}: a cut case
    trace = ("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.25, "b8")
    assert parts.estimate(trace, runs) == 5.0 + (5 + 1) * 2.0  # the asyncmoe model's build, a warm-up and 5 timed rounds
    # a seed prompt 4x as long: 4x the calls, no warm-up round; the build once
    assert parts.estimate(("olmoe-1b-7b", "trace", "seed", 0.25, "prompt2048"), runs) == 40.0 + 4 * 2 * 30.0
    assert parts.estimate(("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.5, "b8"), runs) is None  # other cache


def test_a_case_in_out_is_no_longer_missing(tmp_path):
    before = report.profile_cases(parts.measured_runs(tmp_path))
    node, (shape, routing, system, fraction, size), _ = next(c for c in before if c[1][2] == "unmodified" and not c[2])
    kind = "prompt" if size.startswith("prompt") else "batch"
    extra = {"shape": shape, "routing": routing, "system": system, "cache": suite.slots(shape, fraction),
             kind: int(size.removeprefix("prompt").removeprefix("b"))}
    (tmp_path / "bench-t-x.json").write_text(json.dumps({"benchmarks": [{"extra_info": extra}]}))
    after = report.profile_cases(parts.measured_runs(tmp_path))
    assert [n for n, _, counted in after if not counted] == [n for n, _, counted in before if not counted and n != node]
