"""Run the full profile's unmeasured cases, one part per GPU at a time, until a time limit; run it again to go on.

    python benchmarks/parts.py --out docs/results/2026-12-01 --tag c1 --seconds 540 [--grep qwen3]

The full profile takes hours (docs/results/coverage.md); a machine lends minutes at a time. A part is the
unmeasured cases of one shape and routing (`report.py --missing` against every run under docs/results and what is
already in `--out`), so a part builds its unmodified reference once and its cases share builds as in any
run (conftest.py). Each GPU runs one part after another as its own pytest process (`CUDA_VISIBLE_DEVICES`),
with `--cases-json`, so a part stopped by the time limit keeps every case it finished and the next run
starts from the cases left. A case the limit stops loses every minute it ran, so a part runs only the cases
that its estimates say finish in the time left (`estimate`: what the same case took in any run, on either
routing); the rest wait for a later call, and one longer than any call is named, never started. On several
GPUs it first records whether their host -> GPU copies slow each other (as `h2d_side_by_side.py` does):
every case is bound by its copies.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import torch

import report
import test_latency as suite

HERE = pathlib.Path(__file__).parent
START_S = 50  # a part's pytest start-up: collection, the unmodified model's references (~50 s a run, seventh session)


def measured_runs(out: pathlib.Path) -> list[dict]:
    """Every run under docs/results and in `out`."""
    paths = [*(HERE.parent / "docs" / "results").glob("**/bench-*.json"), *out.glob("bench-*.json")]
    return [json.loads(text) for text in (p.read_text() for p in paths) if text]  # "": a run that wrote nothing


def missing(runs: list[dict]) -> list[tuple[str, tuple]]:
    """(node id, case) of the full profile's cases that none of `runs` measured."""
    return [(node, case) for node, case, measured in report.profile_cases(runs) if not measured]


def estimate(case: tuple, runs: list[dict]) -> float | None:
    """Seconds `case` will take on the GPU: the longest any run took for it, on either routing (they copy about
    as much: OLMoE and DeepSeek-V2-Lite batch 1, 0.7-1.3x), as its build (where recorded: `setup_s`) plus its
    timed and warm-up rounds; a prompt of n tokens not measured, at most n / m times the same case's prompt
    of m (the seed's calls, n / chunk, are most of its time). None: nothing to go by."""
    shape, _, system, fraction, size = case
    cache, n = suite.slots(shape, fraction), int(size.removeprefix("prompt").removeprefix("b"))
    took: dict[int, list[tuple[float, float]]] = {}  # batch or prompt length -> [(build s, rounds s)]
    for e, s in ((b["extra_info"], b["stats"]) for run in runs for b in run["benchmarks"]):
        prefill = "prompt" in e
        if e and (e["shape"], e["system"], e["cache"], prefill) == (shape, system, cache, size.startswith("prompt")):
            rounds = (s["rounds"] + suite.warmup_rounds(system, prefill)) * s["mean"]
            took.setdefault(e["prompt"] if prefill else e["batch"], []).append((e.get("setup_s", 0.0), rounds))
    if n in took:
        return max(build + rounds for build, rounds in took[n])
    shorter = [build + rounds * n / m for m, times in took.items() if size.startswith("prompt") and m < n
               for build, rounds in times]
    return max(shorter, default=None)


def parts(cases: list[tuple[str, tuple]]) -> dict[str, list[str]]:
    """Node ids by shape and routing (`olmoe-1b-7b-trace`), the parts in the order of their first case."""
    groups: dict[str, list[str]] = {}
    for node, (shape, routing, *_) in cases:
        groups.setdefault(f"{shape}-{routing}", []).append(node)
    return groups


def fitting(nodes: list[str], estimates: dict[str, float | None], seconds: float) -> list[str]:
    """The nodes to run in `seconds`: in order, each that finishes by its estimate in what those before it leave.
    One without an estimate runs (the limit stops it if it must)."""
    chosen, left = [], seconds
    for node in nodes:
        if estimates.get(node) is None or estimates[node] <= left:
            chosen.append(node)
            left -= estimates.get(node) or 0.0
    return chosen


def run(todo: dict[str, list[str]], estimates: dict[str, float | None], gpus: list[str | None], seconds: float,
        out: pathlib.Path, tag: str, start_s: float = START_S) -> None:
    """Each GPU (None: no CUDA_VISIBLE_DEVICES) takes the next part with cases that fit the time left, and runs
    those, until `seconds` have passed; a part still running then is killed, its finished cases already in its JSON."""
    deadline, lock, todo = time.monotonic() + seconds, threading.Lock(), list(todo.items())

    def worker(gpu):
        while True:
            with lock:
                left = deadline - time.monotonic() - start_s
                fit = [(i, fitting(nodes, estimates, left)) for i, (_, nodes) in enumerate(todo)] if left > 0 else []
                i, nodes = next(((i, nodes) for i, nodes in fit if nodes), (None, None))
                if nodes is None:
                    return
                part = todo.pop(i)[0]
            name = f"{tag}-{part}"
            (out / f"ids-{name}.txt").write_text("\n".join(nodes) + "\n")
            cmd = [sys.executable, "-m", "pytest", *nodes, "--benchmark-only", "-p", "no:cacheprovider", "-q", "-rs",
                   f"--cases-json={(out / f'bench-{name}.json').resolve()}"]
            env = dict(os.environ) if gpu is None else dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
            start = time.monotonic()
            with open(out / f"bench-{name}.txt", "w") as log:
                try:
                    subprocess.run(cmd, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.write(f"\nparts.py: stopped at the {seconds:.0f} s limit\n")
            result = out / f"bench-{name}.json"
            done = len(json.loads(result.read_text())["benchmarks"]) if result.exists() else 0
            print(f"GPU {gpu}: {name}, {done} of {len(nodes)} cases in {time.monotonic() - start:.0f} s", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path, required=True, help="where the parts' JSON, ids and output go")
    p.add_argument("--tag", required=True, help="names this run's files, e.g. the call and commit: c1-d81205b")
    p.add_argument("--seconds", type=float, required=True, help="stop every part this long after the start")
    p.add_argument("--grep", default="", help="only the node ids this regex matches, e.g. 'qwen3|mixtral.*-b8'")
    args = p.parse_args()
    gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        sys.exit("parts.py runs the full profile, which needs CUDA GPUs; the CPU runs the smoke profile: pytest benchmarks/")
    args.out.mkdir(parents=True, exist_ok=True)
    if len(gpus) > 1:
        from decode_step import h2d_bandwidths

        alone = {d: h2d_bandwidths([d], reps=20)[d] for d in range(len(gpus))}
        together = h2d_bandwidths(list(alone), reps=20)
        (args.out / f"side-by-side-{args.tag}.json").write_text(json.dumps(dict(alone=alone, together=together)))
    runs = measured_runs(args.out)
    cases = [(node, case) for node, case in missing(runs) if re.search(args.grep, node)]
    estimates = {node: estimate(case, runs) for node, case in cases}
    for node, seconds in estimates.items():
        if seconds is not None and seconds > args.seconds - START_S:
            print(f"longer than this call ({seconds:.0f} s estimated), not started: {node}", flush=True)
    todo = parts(cases)
    print(f"{len(cases)} cases in {len(todo)} parts on {len(gpus)} GPUs for {args.seconds:.0f} s", flush=True)
    run(todo, estimates, gpus, args.seconds, args.out, args.tag)


if __name__ == "__main__":
    main()
