"""parts.py on the CPU, with the smoke profile's cases: parts by shape and routing, each run as its own pytest
process into its own JSON, none started past the time limit, and what is in --out no longer missing."""

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
    parts.run({"tiny-router": ROUTER, "tiny-trace": TRACE}, [None, None], 600, tmp_path, "t")  # two workers, as on two GPUs
    for name, nodes in [("t-tiny-router", ROUTER), ("t-tiny-trace", TRACE)]:
        run = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert sorted(b["fullname"].split("::")[-1] for b in run["benchmarks"]) == sorted(n.split("::")[-1] for n in nodes)
        assert (tmp_path / f"ids-{name}.txt").read_text().split() == nodes


def test_no_part_starts_past_the_time_limit(tmp_path):
    parts.run({"tiny-router": ROUTER, "tiny-trace": TRACE}, [None], 1, tmp_path, "t")  # killed before pytest has collected
    assert "stopped at the 1 s limit" in (tmp_path / "bench-t-tiny-router.txt").read_text()
    assert not (tmp_path / "bench-t-tiny-router.json").exists()
    assert not (tmp_path / "ids-t-tiny-trace.txt").exists()


def test_a_case_in_out_is_no_longer_missing(tmp_path):
    before = parts.missing(tmp_path)
    node, (shape, routing, system, fraction, size) = next((node, case) for node, case in before if case[2] != "seed")
    kind = "prompt" if size.startswith("prompt") else "batch"
    extra = {"shape": shape, "routing": routing, "system": system, "cache": suite.slots(shape, fraction),
             kind: int(size.removeprefix("prompt").removeprefix("b"))}
    (tmp_path / "bench-t-x.json").write_text(json.dumps({"benchmarks": [{"extra_info": extra}]}))
    after = parts.missing(tmp_path)
    assert node not in dict(after) and len(after) == len(before) - 1
