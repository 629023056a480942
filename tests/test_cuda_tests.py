"""scripts/cuda_tests.py's plan: each file's tests in shards, the longest process first by the recorded seconds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from cuda_tests import shards  # noqa: E402


def test_the_longest_recorded_process_starts_first_and_an_unknown_one_before_it():
    ids = [f"tests/a.py::t{i}" for i in range(5)] + [
        "tests/b.py::t",
        "tests/c.py::t",
        "tests/d.py::t",
    ]
    jobs = shards(
        ids, 3, {"tests/a.py [1/2]": 20, "tests/a.py [2/2]": 19, "tests/b.py": 70, "tests/c.py": 5}
    )
    assert [name for name, _ in jobs] == [
        "tests/d.py", "tests/b.py", "tests/a.py [1/2]", "tests/a.py [2/2]", "tests/c.py",
    ]  # fmt: skip
    assert sorted(i for _, part in jobs for i in part) == sorted(ids)
    # nothing recorded: the most tests first
    assert [name for name, _ in shards(ids, 3)][:2] == ["tests/a.py [1/2]", "tests/a.py [2/2]"]
