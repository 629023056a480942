"""Run the full profile's uncounted cases, one part per GPU at a time, until a time limit; run it again to go on.

    python benchmarks/parts.py --out docs/results/2026-12-01 --tag c1 --seconds 540 [--grep 'qwen3.*trace']

The full profile takes hours (docs/results/coverage.md); a machine lends minutes at a time. Issue 5 asks for
the systems "in the same run", and the report takes a row's ratios (limit ratio, speedups over accelerate and
the seed) from its own run only, so a case counts once one run holds it with every case it compares with
(`report.bases`). A part is one comparison group, a shape, routing and batch or prompt
(`olmoe-1b-7b-trace-b1`): the group's resident model and accelerate, then, per cache size with a case not yet
counted, that case and the seed at its size, all in one pytest run (`report.py --missing` against every run
under docs/results and in `--out`). Each GPU runs one part after another as its own process
(`CUDA_VISIBLE_DEVICES`) with `--cases-json`, so a part stopped by the time limit keeps every case it
finished. A case the limit stops loses every minute it ran, so a part takes only the cache sizes that its
estimates say finish in the time left (`estimate`: what the same case took in any run, on either routing);
the rest wait for a later call, and a case longer than any call is named and never started. On several GPUs
it first records whether their host -> GPU copies slow each other (as `h2d_side_by_side.py` does): every
case is bound by its copies.
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


def estimate(case: tuple, runs: list[dict]) -> float | None:
    """Seconds `case` will take on the GPU: its model's build, the longest any run recorded for that kind of
    model at its shape (`setup_s`; in a part of one batch or prompt nearly every case builds its own), and its
    timed and warm-up rounds, the longest any run took for the same case on either routing (they copy about as
    much: OLMoE and DeepSeek-V2-Lite batch 1, 0.7-1.3x); a prompt of n tokens not measured, at most n / m
    times the same case's prompt of m (the seed's calls, n / chunk, are most of its time). None: no rounds
    to go by."""
    shape, _, system, fraction, size = case
    cache, n, prefill = suite.slots(shape, fraction), int(size.removeprefix("prompt").removeprefix("b")), size.startswith("prompt")
    build, took = 0.0, {}  # took: batch or prompt length -> [seconds of rounds]
    for e, s in ((b["extra_info"], b["stats"]) for run in runs for b in run["benchmarks"]):
        if not e or e["shape"] != shape:
            continue
        if suite.model_kind(e["system"]) == suite.model_kind(system):
            build = max(build, e.get("setup_s", 0.0))
        if (e["system"], e["cache"], "prompt" in e) == (system, cache, prefill):
            rounds = (s["rounds"] + suite.warmup_rounds(system, prefill)) * s["mean"]
            took.setdefault(e["prompt"] if prefill else e["batch"], []).append(rounds)
    if n in took:
        return build + max(took[n])
    shorter = [rounds * n / m for m, times in took.items() if prefill and m < n for rounds in times]
    return build + max(shorter) if shorter else None


def parts(cases: list[tuple[str, tuple, bool]]) -> dict[str, list[list[str]]]:
    """For each comparison group with a case not counted (`report.profile_cases`), its node ids in bundles: first
    the group's baselines that those cases need (the resident model, accelerate), then per cache size the
    uncounted cases and the seed they compare with. A run takes the first bundle and whole others."""
    profile = {case for _, case, _ in cases}
    node_of = {case: node for node, case, _ in cases}
    groups: dict[str, dict[object, dict[str, None]]] = {}  # group -> {"bases" or cache fraction: nodes, ordered}
    for node, case, counted in cases:
        if counted:
            continue
        shape, routing, system, fraction, size = case
        bundles = groups.setdefault(f"{shape}-{routing}-{size}", {"bases": {}})
        for c in [case, *report.bases(case, profile)]:
            at = "bases" if c[2] in ("unmodified", "accelerate") else c[3]
            bundles.setdefault(at, {})[node_of[c]] = None
    return {group: [list(nodes) for nodes in bundles.values()] for group, bundles in groups.items()}


def fitting(bundles: list[list[str]], estimates: dict[str, float | None], seconds: float) -> list[str]:
    """The nodes to run in `seconds`: the first bundle (the group's baselines), then, in order, each bundle that
    finishes by its estimates in what those before it leave; none if no bundle past the first fits (where there
    is one). A node without an estimate counts as none (the limit stops it if it must)."""
    def cost(nodes):
        return sum(estimates.get(n) or 0.0 for n in nodes)

    first, *rest = bundles
    chosen, left = list(first), seconds - cost(first)
    if left < 0:
        return []
    for nodes in rest:
        if cost(nodes) <= left:
            chosen += nodes
            left -= cost(nodes)
    return chosen if len(chosen) > len(first) or not rest else []


def run(todo: dict[str, list[list[str]]], estimates: dict[str, float | None], gpus: list[str | None], seconds: float,
        out: pathlib.Path, tag: str, start_s: float = START_S) -> None:
    """Each GPU (None: no CUDA_VISIBLE_DEVICES) takes the next part with bundles that fit the time left, and runs
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
    p.add_argument("--grep", default="", help="only the parts whose name this regex matches, e.g. 'qwen3.*-b8'")
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
    profile = report.profile_cases(runs)
    estimates = {node: estimate(case, runs) for node, case, _ in profile}
    too_long = {case: node for node, case, _ in profile if (estimates[node] or 0) > args.seconds - START_S}
    for node in too_long.values():
        print(f"longer than this call ({estimates[node]:.0f} s estimated), not started: {node}", flush=True)
    todo = {group: [[n for n in nodes if n not in too_long.values()] for nodes in bundles]
            for group, bundles in parts(report.profile_cases(runs, without=frozenset(too_long))).items()
            if re.search(args.grep, group)}
    print(f"{sum(len(n) for b in todo.values() for n in b)} cases in {len(todo)} parts on {len(gpus)} GPUs "
          f"for {args.seconds:.0f} s", flush=True)
    run(todo, estimates, gpus, args.seconds, args.out, args.tag)


if __name__ == "__main__":
    main()
