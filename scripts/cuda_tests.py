"""The CUDA-marked tests on one GPU: several pytest processes side by side, one per test file (a long
file in shards), each one's result printed as it finishes; the tests marked `timing` run after them,
alone, since other processes' threads would be timed too. Exits 1 if any test failed.

A process per file also keeps a trapped CUDA context (the CPU executor's loud timeout) from failing
the files after it. Each process side by side runs on cores of its own (its CPU executor's threads
follow its affinity), so that the processes' thread pools do not crowd one another. The longest
processes start first, by the seconds each took in the last run recorded in `tests/cuda_durations.json`
(`--record` rewrites it; a process it does not know starts before every known one), so that no long
one starts last and runs alone.

usage: python scripts/cuda_tests.py [--jobs N] [--shard N] [--logs DIR] [--record] [pytest args...]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
DURATIONS = (
    ROOT / "tests" / "cuda_durations.json"
)  # {process name: seconds} of the last recorded run


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
    ids: list[str], size: int, seconds: dict[str, float] | None = None
) -> list[tuple[str, list[str]]]:
    """(name, node ids): each file's tests, in runs of at most `size`, the longest first by `seconds`
    (those it does not name first, the most tests first among them)."""
    files = defaultdict(list)
    for i in ids:
        files[i.split("::")[0]].append(i)
    out = []
    for f, tests in files.items():
        n = -(-len(tests) // size)
        for s in range(n):
            out.append((f if n == 1 else f"{f} [{s + 1}/{n}]", tests[s::n]))
    known = seconds or {}
    return sorted(out, key=lambda job: (job[0] in known, -known.get(job[0], 0), -len(job[1])))


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
    parser.add_argument("--jobs", type=int, default=6, help="pytest processes side by side")
    parser.add_argument("--shard", type=int, default=12, help="at most this many tests a process")
    parser.add_argument(
        "--logs", type=Path, default=Path("/tmp/cuda-tests"), help="each process's log"
    )
    parser.add_argument(
        "--record", action="store_true", help=f"write each process's seconds to {DURATIONS.name}"
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
        futures = [pool.submit(run, name, ids, pytest_args, opts.logs, cores) for name, ids in jobs]
        took = {}
        for f in as_completed(futures):
            name, *rest = f.result()
            ok &= report(name, *rest)
            took[name] = round(rest[-1])
    if opts.record:
        DURATIONS.write_text(json.dumps(dict(sorted(took.items())), indent=1) + "\n")
    if alone:
        ok &= report(*run("timing", alone, pytest_args, opts.logs))
    print(f"{'passed' if ok else 'FAILED'}: {time.perf_counter() - start:.0f} s wall in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
