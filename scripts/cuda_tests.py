"""The CUDA-marked tests on one GPU: several pytest processes side by side, one per test file (a long
file in shards), each one's result printed as it finishes; the tests marked `timing` run after them,
alone, since other processes' threads would be timed too. Exits 1 if any test failed.

A process per file also keeps a trapped CUDA context (the CPU executor's loud timeout) from failing
the files after it. Each process side by side runs on cores of its own, two by default (its CPU
executor's threads follow its affinity), so that the processes' thread pools do not crowd one
another. Processes are planned from each test's seconds in the last recorded run
(`tests/cuda_durations.json`; `--record` rewrites it from pytest's durations; a test it does not know
counts `UNKNOWN_S`): a file is cut into shards of about `--shard` seconds, each shard's tests dealt
longest first to its least loaded process, and the longest processes start first, so that no long
one starts last and runs alone.

usage: python scripts/cuda_tests.py [--jobs N] [--shard S] [--logs DIR] [--record] [pytest args...]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import queue
import re
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
DURATIONS = ROOT / "tests" / "cuda_durations.json"  # {node id: seconds} of the last recorded run
UNKNOWN_S = 10.0  # a test the record does not know
# a line of pytest's --durations report: "1.23s call     tests/x.py::test_y[a]"
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+::\S.*)$")


def collect(marks: str) -> list[str]:
    """The node ids of the tests that `marks` selects."""
    run = subprocess.run(
        [*PYTEST, "--collect-only", "-q", "-m", marks, "tests"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode not in (0, 5):  # 5: nothing selected
        sys.exit(f"collecting the CUDA tests failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
    return [line for line in run.stdout.splitlines() if "::" in line]


def shards(
    ids: list[str], target_s: float, seconds: dict[str, float] | None = None
) -> list[tuple[str, list[str]]]:
    """(name, node ids), the longest first: each file's tests in about total / `target_s` processes
    (at least one, at most one a test), dealt longest first by `seconds` to the least loaded."""
    known = seconds or {}
    files = defaultdict(list)
    for i in ids:
        files[i.split("::")[0]].append(i)
    out = []
    for f, tests in files.items():
        cost = {i: known.get(i, UNKNOWN_S) for i in tests}
        n = min(len(tests), max(1, round(sum(cost.values()) / target_s)))
        loads = [(0.0, s, []) for s in range(n)]  # (seconds, shard, its tests)
        for i in sorted(tests, key=lambda i: -cost[i]):  # stable: file order among equals
            load, s, part = heapq.heappop(loads)
            heapq.heappush(loads, (load + cost[i], s, part + [i]))
        for load, s, part in sorted(loads, key=lambda x: x[1]):
            out.append((load, f if n == 1 else f"{f} [{s + 1}/{n}]", sorted(part, key=tests.index)))
    return [(name, part) for _, name, part in sorted(out, key=lambda job: (-job[0], job[1]))]


def durations(log: str) -> dict[str, float]:
    """Each test's seconds (setup, call and teardown) from pytest's --durations report in `log`."""
    out = defaultdict(float)
    for line in log.splitlines():
        m = DURATION.match(line.strip())
        if m:
            out[m.group(2)] += float(m.group(1))
    return dict(out)


def core_sets(jobs: int) -> queue.Queue:
    """Disjoint sets of this process's cores, one a process side by side."""
    cores = sorted(os.sched_getaffinity(0))
    size = max(1, len(cores) // jobs)
    sets = queue.Queue()
    for i in range(jobs):
        sets.put(set(cores[i * size : (i + 1) * size]) or set(cores))
    return sets


def run(
    name: str, ids: list[str], args: list[str], logs: Path, cores: queue.Queue | None = None
) -> tuple[str, int, str, float]:
    start = time.perf_counter()
    mine = cores.get() if cores is not None else set(os.sched_getaffinity(0))
    pinned = (
        f"import os, sys, pytest; os.sched_setaffinity(0, {sorted(mine)}); sys.exit(pytest.main())"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", pinned, "-p", "no:cacheprovider", "-q", "-rfE", *args, *ids],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        if cores is not None:
            cores.put(mine)
    log = done.stdout + done.stderr
    (
        logs / (name.replace("/", "_").replace(" ", "").replace("[", "-").strip("]") + ".txt")
    ).write_text(log)
    return name, done.returncode, log, time.perf_counter() - start


def report(name: str, rc: int, log: str, seconds: float) -> bool:
    lines = [line for line in log.splitlines() if line.strip()]
    print(f"{name}: {lines[-1] if lines else 'no output'} ({seconds:.0f} s wall)", flush=True)
    if rc not in (0, 5):
        print("\n".join(lines[-60:]), flush=True)
    return rc in (0, 5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="pytest processes side by side (default: one each two cores)",
    )
    parser.add_argument(
        "--shard", type=float, default=60, help="about this many recorded seconds a process"
    )
    parser.add_argument(
        "--logs", type=Path, default=Path("/tmp/cuda-tests"), help="each process's log"
    )
    parser.add_argument(
        "--record", action="store_true", help=f"write each test's seconds to {DURATIONS.name}"
    )
    opts, pytest_args = parser.parse_known_args()
    opts.logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        side_by_side, alone = pool.map(collect, ["cuda and not timing", "cuda and timing"])
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    jobs = shards(side_by_side, opts.shard, known)
    print(
        f"{len(side_by_side)} tests in {len(jobs)} processes, {opts.jobs} at a time; {len(alone)} timed alone"
    )
    ok = True
    with ThreadPoolExecutor(opts.jobs) as pool:
        cores = core_sets(opts.jobs)
        args = ["--durations=0", "--durations-min=0", *pytest_args]
        futures = [pool.submit(run, name, ids, args, opts.logs, cores) for name, ids in jobs]
        planned = set(side_by_side)
        for f in as_completed(futures):
            name, rc, log, wall = f.result()
            ok &= report(name, rc, log, wall)
            if opts.record:  # as each process ends: a run cut short keeps what it timed
                took = {i: round(s, 1) for i, s in durations(log).items() if i in planned}
                known = {i: s for i, s in (known | took).items() if i in planned}
                DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    if alone:
        ok &= report(*run("timing", alone, pytest_args, opts.logs))
    print(f"{'passed' if ok else 'FAILED'}: {time.perf_counter() - start:.0f} s wall in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
