"""scripts/cuda_tests.py's plan: each file's tests in shards of about the target's recorded seconds,
the longest process first; and the seconds read back from pytest's durations report."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from cuda_tests import UNKNOWN_S, durations, shards  # noqa: E402


def test_a_file_is_cut_by_its_seconds_and_the_longest_process_starts_first():
    ids = [f"tests/a.py::t{i}" for i in range(5)] + ["tests/b.py::t", "tests/c.py::t"]
    seconds = {"tests/a.py::t0": 50, "tests/a.py::t1": 30, "tests/a.py::t2": 25}
    seconds |= {"tests/a.py::t3": 5, "tests/a.py::t4": 5, "tests/b.py::t": 70, "tests/c.py::t": 1}
    jobs = shards(ids, 60, seconds)
    # a.py's 115 s in two: 50 + 5 + 5 and 30 + 25, dealt longest first to the least loaded
    assert jobs == [
        ("tests/b.py", ["tests/b.py::t"]),
        ("tests/a.py [1/2]", ["tests/a.py::t0", "tests/a.py::t3", "tests/a.py::t4"]),
        ("tests/a.py [2/2]", ["tests/a.py::t1", "tests/a.py::t2"]),
        ("tests/c.py", ["tests/c.py::t"]),
    ]


def test_unknown_tests_count_their_default_and_no_shard_is_empty():
    ids = [f"tests/a.py::t{i}" for i in range(3)] + ["tests/b.py::t"]
    jobs = shards(ids, UNKNOWN_S / 2, {"tests/b.py::t": 1})
    assert [name for name, _ in jobs] == [
        "tests/a.py [1/3]", "tests/a.py [2/3]", "tests/a.py [3/3]", "tests/b.py",
    ]  # fmt: skip
    assert all(len(part) == 1 for _, part in jobs)
    assert sorted(i for _, part in jobs for i in part) == sorted(ids)


def test_durations_sum_each_tests_phases_from_the_report():
    log = """
============================= slowest durations ==============================
12.50s call     tests/x.py::test_a[4-olmoe fp8]
0.75s setup    tests/x.py::test_a[4-olmoe fp8]
3.00s call     tests/x.py::test_b
0.01s teardown tests/x.py::test_b
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
2 passed in 16.3s
"""
    assert durations(log) == {"tests/x.py::test_a[4-olmoe fp8]": 13.25, "tests/x.py::test_b": 3.01}
