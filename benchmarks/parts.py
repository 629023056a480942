"""Run the full profile's unmeasured cases, one part per GPU at a time, until a time limit; run it again to go on.

    python benchmarks/parts.py --out docs/results/2026-12-01 --tag c1 --seconds 540 [--grep qwen3]

The full profile takes hours (docs/results/coverage.md); a machine lends minutes at a time. A part is the
unmeasured cases of one shape and routing (`report.py --missing` against every run under docs/results and what is
already in `--out`), so a part builds its unmodified reference once and its cases share builds as in any
run (conftest.py). Each GPU runs one part after another as its own pytest process (`CUDA_VISIBLE_DEVICES`),
with `--cases-json`, so a part stopped by the time limit keeps every case it finished and the next run
starts from the cases left. On several GPUs it first records whether their host -> GPU copies slow each
other (as `h2d_side_by_side.py` does): every case is bound by its copies.
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

import report

HERE = pathlib.Path(__file__).parent


def missing(out: pathlib.Path) -> list[tuple[str, tuple]]:
    """(node id, case) of the full profile's cases that no run under docs/results, nor any in `out`, measured."""
    paths = [*(HERE.parent / "docs" / "results").glob("**/bench-*.json"), *out.glob("bench-*.json")]
    runs = [json.loads(text) for text in (p.read_text() for p in paths) if text]  # "": a run that wrote nothing
    return [(node, case) for node, case, measured in report.profile_cases(runs) if not measured]


def parts(cases: list[tuple[str, tuple]]) -> dict[str, list[str]]:
    """Node ids by shape and routing (`olmoe-1b-7b-trace`), the parts in the order of their first case."""
    groups: dict[str, list[str]] = {}
    for node, (shape, routing, *_) in cases:
        groups.setdefault(f"{shape}-{routing}", []).append(node)
    return groups


def run(todo: dict[str, list[str]], gpus: list[str | None], seconds: float, out: pathlib.Path, tag: str) -> None:
    """Each GPU (None: no CUDA_VISIBLE_DEVICES) takes the next part until `seconds` have passed; a part still
    running then is killed, its finished cases already in its JSON."""
    deadline, lock, todo = time.monotonic() + seconds, threading.Lock(), list(todo.items())

    def worker(gpu):
        while True:
            with lock:
                if not todo or time.monotonic() >= deadline:
                    return
                part, nodes = todo.pop(0)
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
    import torch

    gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        sys.exit("parts.py runs the full profile, which needs CUDA GPUs; the CPU runs the smoke profile: pytest benchmarks/")
    args.out.mkdir(parents=True, exist_ok=True)
    if len(gpus) > 1:
        from decode_step import h2d_bandwidths

        alone = {d: h2d_bandwidths([d], reps=20)[d] for d in range(len(gpus))}
        together = h2d_bandwidths(list(alone), reps=20)
        (args.out / f"side-by-side-{args.tag}.json").write_text(json.dumps(dict(alone=alone, together=together)))
    todo = parts([(node, case) for node, case in missing(args.out) if re.search(args.grep, node)])
    print(f"{sum(map(len, todo.values()))} cases in {len(todo)} parts on {len(gpus)} GPUs for {args.seconds:.0f} s", flush=True)
    run(todo, gpus, args.seconds, args.out, args.tag)


if __name__ == "__main__":
    main()
