"""parts.py on the CPU, with the smoke profile's cases: parts by shape and routing, each run as its own pytest
process into its own JSON, stopped at the time limit, cases chosen by what their estimates leave time for,
and what is in --out no longer missing."""

import json

import parts
import test_latency as suite

ROUTER = ["test_latency.py::test_decode[tiny-router-unmodified-cache1-b1]"]
TRACE = ["test_latency.py::test_prefill[tiny-trace-unmodified-cache1-prompt32]"]


def test_parts_are_a_shape_and_routing_each():
    a, b, c = [(f"node {i}", case) for i, case in enumerate([("olmoe-1b-7b", "trace", "seed", 0.25, "b1"),
                                                             ("olmoe-1b-7b", "router", "seed", 0.25, "b1"),
                                                             ("olmoe-1b-7b", "trace", "asyncmoe-eager", 0.5, "prompt512")])]
    assert parts.parts([a, b, c]) == {"olmoe-1b-7b-trace": ["node 0", "node 2"], "olmoe-1b-7b-router": ["node 1"]}


def test_each_part_runs_into_its_own_json(tmp_path):
    parts.run({"tiny-router": ROUTER, "tiny-trace": TRACE}, {}, [None, None], 600, tmp_path, "t")  # two workers, as on two GPUs
    for name, nodes in [("t-tiny-router", ROUTER), ("t-tiny-trace", TRACE)]:
        run = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert sorted(b["fullname"].split("::")[-1] for b in run["benchmarks"]) == sorted(n.split("::")[-1] for n in nodes)
        assert (tmp_path / f"ids-{name}.txt").read_text().split() == nodes


def test_a_part_running_at_the_limit_is_stopped(tmp_path):
    parts.run({"tiny-router": ROUTER, "tiny-trace": TRACE}, {}, [None], 1, tmp_path, "t", start_s=0)  # before pytest has collected
    assert "stopped at the 1 s limit" in (tmp_path / "bench-t-tiny-router.txt").read_text()
    assert not (tmp_path / "bench-t-tiny-router.json").exists()
    assert not (tmp_path / "ids-t-tiny-trace.txt").exists()


def test_no_part_starts_in_less_time_than_its_start_up(tmp_path):
    parts.run({"tiny-router": ROUTER}, {}, [None], parts.START_S - 1, tmp_path, "t")
    assert list(tmp_path.iterdir()) == []


def test_cases_run_only_where_their_estimates_fit():
    estimates = {"a": 100.0, "b": None, "c": 300.0, "d": 50.0}
    assert parts.fitting(["a", "b", "c", "d"], estimates, 200) == ["a", "b", "d"]  # c would be stopped: it waits
    assert parts.fitting(["c"], estimates, 299) == []


def test_an_estimate_is_what_the_same_case_took_on_either_routing():
    def case(system, size, setup_s, rounds, mean, routing="router"):
        kind, n = ("prompt", int(size[6:])) if size.startswith("prompt") else ("batch", int(size[1:]))
        extra = dict(shape="olmoe-1b-7b", routing=routing, system=system, cache=16, setup_s=setup_s, **{kind: n})
        return dict(extra_info=extra, stats=dict(rounds=rounds, mean=mean))

    runs = [{"benchmarks": [case("asyncmoe-graph", "b8", 5.0, 5, 2.0), case("seed", "prompt512", 40.0, 2, 30.0),
                            {"extra_info": {}, "stats": {}}]}]  # a case cut before it finished
    trace = ("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.25, "b8")
    assert parts.estimate(trace, runs) == 5.0 + (5 + 1) * 2.0  # its build, then a warm-up and 5 timed rounds
    # a seed prompt 4x as long: 4x the calls, no warm-up round; the build once
    assert parts.estimate(("olmoe-1b-7b", "trace", "seed", 0.25, "prompt2048"), runs) == 40.0 + 4 * 2 * 30.0
    assert parts.estimate(("olmoe-1b-7b", "trace", "asyncmoe-graph", 0.5, "b8"), runs) is None  # other cache


def test_a_case_in_out_is_no_longer_missing(tmp_path):
    before = parts.missing(parts.measured_runs(tmp_path))
    node, (shape, routing, system, fraction, size) = next((node, case) for node, case in before if case[2] != "seed")
    kind = "prompt" if size.startswith("prompt") else "batch"
    extra = {"shape": shape, "routing": routing, "system": system, "cache": suite.slots(shape, fraction),
             kind: int(size.removeprefix("prompt").removeprefix("b"))}
    (tmp_path / "bench-t-x.json").write_text(json.dumps({"benchmarks": [{"extra_info": extra}]}))
    after = parts.missing(parts.measured_runs(tmp_path))
    assert node not in dict(after) and len(after) == len(before) - 1
