"""Run the full profile's uncounted cases, a process per GPU at a time, until a time limit; run it again to go on.

    python benchmarks/parts.py --out docs/results/2026-12-01 --tag c1 --seconds 540 [--grep 'qwen3.*trace']
    python benchmarks/parts.py --seconds 540 --simulate 2     # CPU: the calls of 2 GPUs the rest would take
    python benchmarks/parts.py --digest d0941ac               # the source_sha256 a run of that commit records

The full profile takes hours (docs/results/coverage.md); a machine lends minutes at a time. Issue 5 asks for
the systems "in the same run", and the report takes a row's ratios (limit ratio, speedups over accelerate and
the seed) from its own run only, so a case counts once one run holds it with every case it compares with
(`report.bases`). The unit is a comparison group, a shape, routing and batch or prompt (`olmoe-1b-7b-trace-b1`):
its uncounted cases in bundles (`parts`), the group's resident model and accelerate first, then each case with
the seed at its cache (rows at one cache share their seed where they fit: `merged`). Each GPU runs one pytest
process after another (`CUDA_VISIBLE_DEVICES`, `--cases-json`, so a process stopped by the time limit keeps
every case it finished), each with the groups of one shape and routing that fit, so their models are built
once. A case the limit stops loses every minute it ran, so a process takes only the bundles whose estimates
(`estimate`: the model's build at that shape, the rounds the same case took in the newest run, its routing first) fit
the time left; the rest wait for a later call, and a case that cannot fit any call with what it compares
with (`too_long`) is named and never started. What is in `--out` counts as measured, so a second call goes
on where the first stopped. On several GPUs it first records whether their host -> GPU copies slow each
other (`h2d_side_by_side.side_by_side`): every case is bound by its copies.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import threading
import time

import torch

import report
import test_latency as suite

HERE = pathlib.Path(__file__).parent
# a process's start-up: python, pytest's collection, the unmodified model's references. The seventh session
# saw ~50 s; the 69 whole processes of docs/results/2026-11-30 took 17-42 s beyond their cases' wall_s (median 26)
START_S = 40
MARGIN = 1.1  # processes took 0.86-1.05x their estimates plus START_S (tenth session's, estimated from the runs before)
CALL_S = 575  # the longest --seconds a device call of 600 s holds with parts.py's imports and the results' copy
EXIT_S = 10  # a part killed at the limit takes seconds to exit (call 17 of 2026-11-30: 577 s for a 572 s limit)
H2D_GB_S = 55.0  # pinned host -> GPU copies on the H200, measured in every run (55.3-55.5 GB/s)
COPY_BOUND = 1.3  # Mixtral's asyncmoe rows at 2/8 took 1.19-1.30x their copies (batch 1 and prompts, 2026-11-30)
ACCELERATE_GB_S = 7.0  # accelerate's steps, every expert from pageable memory: Mixtral 67.6 GB in 9.7 s, Qwen3 58 in ~8
# a graph row not yet measured takes about what the other graph row or the eager one took at its cache: the copies
# set a step's time there, and eager is never faster (an upper bound); the same system at another cache moves other
# bytes (call 18 of 2026-11-30: Qwen3's graph at 16/128, batch 8, estimated from it at 128/128: 14 s, took 82); with
# every expert in a slot, the resident model's graph, which moves nothing either (call 22: Qwen3's graph at 128/128,
# batch 32, estimated from 64/128: 109 s, took 7)
GRAPH_FROM = {"asyncmoe-graph": ("asyncmoe-graph-prefetch", "unmodified", "asyncmoe-eager"),
              "asyncmoe-graph-prefetch": ("asyncmoe-graph", "unmodified", "asyncmoe-eager")}


def source_digest(files: dict[str, bytes]) -> str:
    """sha256 of the code a run measures, asyncmoe/ and benchmarks/ (`tree_files`). The device's copy of .git can
    name a stale commit (pytest-benchmark's `commit_info`, and its `git log`, twenty-eighth session), and a tag is
    typed by hand (three wrong in the twenty-ninth), so each run records what it ran and `--digest REV` says
    whether that was commit REV (`commit_files`)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()


def tree_files(root: pathlib.Path) -> dict[str, bytes]:
    """asyncmoe/ and benchmarks/ under `root` as they are on disk, untracked files too (the device runs them),
    less what runs leave there (__pycache__, .pytest_cache, .hypothesis, .benchmarks)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for d in ("asyncmoe", "benchmarks")
            for p in (root / d).rglob("*")
            if p.is_file() and not any(s == "__pycache__" or s.startswith(".") for s in p.relative_to(root).parts)}


def commit_files(rev: str) -> dict[str, bytes]:
    """asyncmoe/ and benchmarks/ at commit `rev` of the repository holding this file."""
    archive = subprocess.run(["git", "archive", rev, "asyncmoe", "benchmarks"], cwd=HERE.parent, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def room(seconds: float, start_s: float = START_S, margin: float = MARGIN) -> float:
    """The estimated seconds of cases that a process with `seconds` left may take: less its start-up and the
    EXIT_S it is stopped before the limit, and a margin for what estimates miss (rounds vary from run to run; a
    case's untimed work, its prompt before each round, its Decoder and graph, is not in them)."""
    return (seconds - start_s - EXIT_S) / margin


def measured_runs(out: pathlib.Path) -> list[dict]:
    """Every run under docs/results and in `out`, oldest first."""
    paths = [*(HERE.parent / "docs" / "results").glob("**/bench-*.json"), *out.glob("bench-*.json")]
    runs = [json.loads(text) for text in (p.read_text() for p in paths) if text]  # "": a run that wrote nothing
    return sorted(runs, key=lambda run: run["datetime"])


def estimate(case: tuple, runs: list[dict]) -> tuple[tuple, float, float]:
    """What `case` will take on the GPU: (its model's `test_latency.model_key`, that model's build in seconds, its
    rounds in seconds), each from the newest of `runs` (oldest first) that has one, the longest there: the code
    changes what a case takes (the seed's build halved at 61d7a2d, accelerate's rounds too, tenth session). The
    build: recorded for that kind of model at that shape (`setup_s`; cases of one key share it; asyncmoe's from a
    cache that, like this one, moves experts or holds them all), else for asyncmoe with prefetch, without it, and
    the other way (one `asyncmoe.compile`: 0.6-1.2x in one run). The rest of the case (`wall_s` less the build;
    before the tenth session's runs, its rounds, timed and warm-up): the same case's; the seed's prompt fed in
    calls, the slowest call measured near it (`per_call`); a prompt of n tokens not measured, the same case's prompt
    of m tokens times n/m; for asyncmoe's graph systems, `GRAPH_FROM` at the same cache; else the system's at
    another cache (`elsewhere`: a smaller one first, else a larger one scaled by its copies; the seed's prompt
    scaled by its calls, `calls`), or for the graph systems the eager one's there (the graph's step is the eager
    step's copies and kernels, captured); each from the case's own routing first, then the other's (they copy about
    as much at batch 1, 0.7-1.3x, but at batches 8 and 32 the random router spreads a step over more experts:
    asyncmoe's rows 1.0-2.6x the trace's, median 1.5, OLMoE and DeepSeek-V2-Lite, eleventh session); with nothing to
    go by, its copies' time (`copies_s`), as `Copies`."""
    shape, routing, system, fraction, size = case
    (prefill, n), cache, experts = report.parse_size(size), suite.slots(shape, fraction), suite.routing_shape(shape)[0]
    build, other, took = (-1, 0.0), (-1, 0.0), {}  # builds: (run, seconds); took: (routing, system, cache, size) -> [...]
    for i, e, s in ((i, b["extra_info"], b["stats"]) for i, run in enumerate(runs) for b in run["benchmarks"]):
        if not e or e["shape"] != shape:
            continue
        kind, setup = suite.model_kind(e["system"]), e.get("setup_s")  # None: not recorded (the first runs), not 0 s
        if kind.startswith("asyncmoe") and (e["cache"] < experts) != (cache < experts):
            setup = None  # with every expert in a slot asyncmoe copies none to host memory: 2.4 s on Qwen3, 21-43 below
        if setup is not None and kind == suite.model_kind(system):
            build = max(build, (i, setup))  # the newest run, the longest there
        elif setup is not None and kind.startswith("asyncmoe") and system.startswith("asyncmoe"):
            other = max(other, (i, setup))
        if ("prompt" in e) == prefill:
            rounds = e["wall_s"] - e["setup_s"] if "wall_s" in e else (s["rounds"] + suite.warmup_rounds(e["system"], prefill)) * s["mean"]
            key = (e["routing"], e["system"], e["cache"], e["prompt"] if prefill else e["batch"])
            took.setdefault(key, []).append((i, rounds))

    def newest(found: list[tuple[int, float]]) -> list[float]:
        return [t for i, t in found if i == max(i for i, _ in found)] if found else []

    chunked = system == "seed" and prefill and cache < experts  # the seed's prompt in calls of `seed_chunk` tokens

    def calls(other: int, m: int) -> float:
        """The seed's calls for this prompt here over its calls for a prompt of m tokens at `other`: they are most
        of its time (call 21 of 2026-11-30: at 16/128, 256 calls of 2 tokens, estimated from 64 calls of 8 at
        64/128 unscaled, took 3.2x)."""
        return math.ceil(n / suite.seed_chunk(shape, 1, cache)) / math.ceil(m / suite.seed_chunk(shape, 1, other))

    def elsewhere(y: str, seen: dict[tuple, list[tuple[int, float]]]) -> list[float]:
        """What y took at other caches: smaller ones first, which move at least as many bytes (an upper bound),
        then larger ones that still move experts, scaled up by the experts a layer does not hold, here over there
        (`copies_s`' uniform routing misses in proportion; a lower bound unscaled: call 40 of 2026-11-30 gave
        Mixtral's rows at 2/8, router, batch 1, their time at 4/8, took 1.50-1.57x it, and stopped one); never
        one with every expert in a slot, where nothing moves (Mixtral's graph at 2/8 and 4/8 estimated from 8/8:
        2.6 s). The seed's prompt there, scaled by `calls`, also from a shorter prompt (it goes by calls either way)."""
        scale = lambda c, m: calls(c, m) if chunked else max(1.0, (experts - cache) / (experts - c))  # 1 if smaller
        at = lambda keep: newest([(i, t * scale(c, m)) for (z, c, m), ts in seen.items()
                                  if z == y and (m == n or chunked and m < n) and keep(c) for i, t in ts])
        return at(lambda c: c < cache) or at(lambda c: cache < c < experts)

    def per_call(seen: dict[tuple, list[tuple[int, float]]]) -> list[float]:
        """The seed's prompt fed in calls (`chunked`): its shorter prompt at this cache and this prompt at the other
        caches that move experts (each cache's newest run), scaled by the calls here over its calls there (`calls`),
        the longest (`estimate` takes the max). A call costs more in a longer prompt on some routings (Qwen3's router
        at 64/128: 96 ms a call for 512 tokens, 160 ms for 2048; call 45 of 2026-12-01 took 1.66x its estimate from
        512 tokens, 0.86-1.17x on the other shapes' pairs), and more where it holds more tokens on others
        (DeepSeek-V2-Lite's router at 512 tokens: 118 ms a call of 1 token at 8/64, 222 ms a call of 5 at 32/64), so
        neither alone bounds it."""
        shorter = newest([(i, t * calls(c, m)) for (y, c, m), ts in seen.items()
                          if (y, c) == (system, cache) and m < n for i, t in ts])
        return shorter + [t * calls(c, m) for (y, c, m), ts in seen.items()
                          if y == system and c not in (cache, experts) and m == n for t in newest(ts)]

    def guess(seen: dict[tuple, list[tuple[int, float]]]) -> list[float]:  # seen: (system, cache, size) -> [(run, seconds)]
        return (newest(seen.get((system, cache, n), []))
                or (per_call(seen) if chunked else [])
                or newest([(i, t * n / m) for (y, c, m), ts in seen.items() if (y, c) == (system, cache) and prefill and m < n
                           for i, t in ts])
                or next(filter(None, (newest(seen.get((y, cache, n), [])) for y in GRAPH_FROM.get(system, ()))), [])
                or elsewhere(system, seen)
                or (elsewhere("asyncmoe-eager", seen) if "graph" in system else []))

    either: dict[tuple, list[tuple[int, float]]] = {}
    for (r, *key), ts in took.items():
        either.setdefault(tuple(key), []).extend(ts)
    times = guess({tuple(key): ts for (r, *key), ts in took.items() if r == routing}) or guess(either)
    return suite.model_key(case), (build if build[0] >= 0 else other)[1], max(times) if times else copies_s(case)


class Copies(float):
    """Seconds estimated for a case with nothing like it measured: its copies' time (`copies_s`), a guess."""


def copies_s(case: tuple) -> Copies:
    """What a decode case takes by its copies, for a case nothing like which was measured: each MoE layer, at
    each step and at the prompt before each round (warm-up and timed), copies the experts its tokens reach that
    its slots do not hold, at H2D_GB_S, times COPY_BOUND. Routing taken as uniform: B tokens of k experts each
    reach E * (1 - (1 - k/E)**B) of E, a fraction cache/E of them held. That over-counts a trace's reuse
    (Mixtral's trace at batch 1, 2/8: 10.1 GB copied a token, 12.7 by this) and is what a random router does at
    batches 8 and 32, reaching every expert. Accelerate copies every expert at every call, at its own rate.
    The decode rows measured with their wall time took, over this: asyncmoe's on the router at batches 8 and
    32 0.80-1.07x on OLMoE and DeepSeek-V2-Lite, 0.24-0.97x on Qwen3 (0.58-0.80x on its trace); accelerate's
    0.83-1.30x; at batch 1 and the seed's, whose steps are more than their copies, up to 3.2x.
    Before this a case never measured cost none and was started in whatever a process had left: call 38 of
    2026-11-30 gave Mixtral's eager row at 2/8, batch 32, its last ~136 s and stopped it (by this, 237 s). A
    prompt: 0 (every prompt case has another cache or a shorter prompt to go by)."""
    shape, routing, system, fraction, size = case
    prefill, batch = report.parse_size(size)
    if prefill:
        return Copies(0.0)
    config, (experts, k) = suite.SHAPES[shape][1], suite.routing_shape(shape)
    intermediate = config.get("moe_intermediate_size", config["intermediate_size"])
    expert_bytes = 3 * config["hidden_size"] * intermediate * 2  # gate, up and down projections, bf16
    layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    held = suite.slots(shape, fraction) / experts
    misses = lambda tokens: experts * (1 - (1 - k / experts) ** tokens) * (1 - held)  # a layer's, one call of `tokens`
    seconds_per_GB = COPY_BOUND / H2D_GB_S
    if system == "accelerate":  # every expert every call, at its step's rate
        misses, seconds_per_GB = lambda tokens: experts, 1 / ACCELERATE_GB_S
    p = suite.decode_profile(system, suite.FULL)
    per_round = p["steps"] * misses(batch) + misses(batch * suite.PROMPT)
    rounds = p["rounds"] + suite.warmup_rounds(system, False)
    return Copies(rounds * per_round * layers * expert_bytes / 1e9 * seconds_per_GB)


def cost(nodes: list[str], estimates: dict[str, tuple]) -> float:
    """The estimated seconds of running `nodes` in one process: each model built once, every case's rounds."""
    nodes = dict.fromkeys(nodes)
    builds = {key: build for key, build, _ in (estimates[n] for n in nodes)}
    return sum(builds.values()) + sum(estimates[n][2] for n in nodes)


def too_long(cases: list[tuple[str, tuple, bool]], estimates: dict[str, tuple], seconds: float) -> set[tuple]:
    """The cases no call of `seconds` can count, never to be started: first the baselines that cannot finish with
    what they compare with (a seed with accelerate); then for each asyncmoe row that cannot finish with its
    baselines, the seed at its cache where the row fits without it (asyncmoe's row is the one the table is for;
    the rows at that cache then count without the seed), else the row itself."""
    profile, node_of, out = {c for _, c, _ in cases}, {c: n for n, c, _ in cases}, set()
    for node, case, _ in sorted(cases, key=lambda c: c[1][2].startswith("asyncmoe")):
        bases = report.bases(case, profile - out)
        if cost([node, *(node_of[b] for b in bases)], estimates) <= seconds:
            continue
        seed = [b for b in bases if b[2] == "seed"]
        if seed and cost([node, *(node_of[b] for b in bases if b not in seed)], estimates) <= seconds:
            out.update(seed)
        else:
            out.add(case)
    return out


def parts(cases: list[tuple[str, tuple, bool]], skip: set[tuple] = frozenset()) -> dict[tuple, list[list[str]]]:
    """For each comparison group (shape, routing, batch or prompt) with a case not counted (`report.profile_cases`)
    nor in `skip`, its node ids in bundles: first the group's baselines that those cases need (the resident
    model, accelerate), then each uncounted case with the seed it compares with. A run takes the first bundle
    and whole others."""
    profile, node_of = {c for _, c, _ in cases} - skip, {c: n for n, c, _ in cases}
    groups: dict[tuple, list[dict[str, None]]] = {}
    for node, case, counted in cases:
        if counted or case in skip:
            continue
        bases = report.bases(case, profile)
        bundles = groups.setdefault((case[0], case[1], case[4]), [{}])
        bundles[0].update(dict.fromkeys(node_of[b] for b in bases if b[2] in ("unmodified", "accelerate")))
        bundles.append(dict.fromkeys([node, *(node_of[b] for b in bases if b[2] == "seed")]))
    return {group: [list(nodes) for nodes in bundles] for group, bundles in groups.items()}


def merged(bundles: list[list[str]], estimates: dict[str, tuple], seconds: float) -> list[list[str]]:
    """The bundles, those that share a case (the seed at one cache) as one where it still fits `seconds` beside
    the group's baselines: the seed then runs once for all the rows at its cache."""
    first, *rest = bundles
    out: list[list[str]] = []
    for nodes in rest:
        into = next((m for m in out if set(m) & set(nodes) and cost(first + m + nodes, estimates) <= seconds), None)
        if into is None:
            out.append(list(nodes))
        else:
            into += [n for n in nodes if n not in into]
    return [first, *out]


def unknown(nodes: list[str], estimates: dict[str, tuple]) -> bool:
    """Whether a case of `nodes` has nothing measured to estimate it by, only its copies."""
    return any(isinstance(estimates[n][2], Copies) for n in nodes)


def fitting(bundles: list[list[str]], estimates: dict[str, tuple], left: float, chosen: list[str] = ()) -> list[str]:
    """The nodes of one group to run in `left` seconds besides `chosen` (other groups' in the same process, whose
    builds they share): the first bundle (the group's baselines), then, cheapest first, each bundle that fits
    what those before it leave; none if no bundle past the first fits. Cheapest first: most of a call is a group's
    baselines, and the cheap rows beside them leave room for more (call 48 of 2026-12-01 took Mixtral's graph row
    at 2/8, batch 8, estimated 219 s, alone with its baselines; cheapest first, the prefetch row at 4/8, 154 s,
    and two prompt rows of that routing, 30 and 10 s, fit with theirs; replayed over the committed runs, 27
    calls of 555 s are left instead of 28). A bundle with a case never measured (`cost`
    counts its copies, `copies_s`: a guess) runs alone beside its baselines, where they and its copies fit, with
    all the time the process has: taken with others, it is the case the limit stops, and it stays unmeasured
    (call 22 of 2026-11-30: Mixtral's six asyncmoe rows at batch 8 in one process, the first stopped after
    ~120 s). The group's other bundles wait for a later call, which estimates them by it."""
    first, *rest = bundles
    picked, added = [*chosen, *first], False
    for nodes in sorted(rest, key=lambda nodes: cost(picked + nodes, estimates)):
        alone = unknown(nodes, estimates)
        if alone and (added or chosen):
            continue
        if cost(picked + nodes, estimates) <= left:
            picked += [n for n in nodes if n not in picked]
            added = True
            if alone:
                break
    return picked[len(chosen):] if added else []


def take(todo: list[tuple[tuple, list[list[str]]]], estimates: dict[str, tuple], left: float) -> tuple[list[str], list[tuple]]:
    """The next process's nodes and groups, taken out of `todo`: the first group with bundles that fit `left`
    seconds, and the other groups of its shape and routing that fit beside it (its models built once for all)."""
    nodes, taken = [], []
    for i, (group, bundles) in enumerate(todo if left > 0 else []):
        if taken and group[:2] != todo[taken[0]][0][:2]:
            continue
        new = fitting(bundles, estimates, left, nodes)
        if new:
            nodes, taken = nodes + new, taken + [i]
            if unknown(new, estimates):  # alone beside its baselines (`fitting`)
                break
    groups = [todo[i][0] for i in taken]
    todo[:] = [item for i, item in enumerate(todo) if i not in taken]
    return nodes, groups


def run(todo: dict[tuple, list[list[str]]], estimates: dict[str, tuple], gpus: list[str | None], seconds: float,
        out: pathlib.Path, tag: str, start_s: float = START_S, margin: float = MARGIN) -> None:
    """Each GPU (None: no CUDA_VISIBLE_DEVICES) runs what `take` gives it for the time left, and goes on until
    `seconds` have passed; a part still running EXIT_S before then is killed, its finished cases already in its
    JSON, so that it has exited by then."""
    deadline, lock, todo = time.monotonic() + seconds, threading.Lock(), list(todo.items())

    def worker(gpu):
        while True:
            with lock:
                nodes, groups = take(todo, estimates, room(deadline - time.monotonic(), start_s, margin))
            if not nodes:
                return
            part = "-".join([*groups[0][:2], *(size for *_, size in groups)])  # qwen3-30b-a3b-trace-b8-b32
            name = f"{tag}-{part}"
            (out / f"ids-{name}.txt").write_text("\n".join(nodes) + "\n")
            # -v: pytest names each case as it starts, so the log of a part the limit stops names the case it cut
            cmd = [sys.executable, "-m", "pytest", *nodes, "--benchmark-only", "-p", "no:cacheprovider", "-v", "-rs",
                   f"--cases-json={(out / f'bench-{name}.json').resolve()}"]
            env = dict(os.environ) if gpu is None else dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
            start = time.monotonic()
            with open(out / f"bench-{name}.txt", "w") as log:
                try:
                    subprocess.run(cmd, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   timeout=max(1.0, deadline - EXIT_S - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.write(f"\nparts.py: stopped {EXIT_S} s before the {seconds:.0f} s limit\n")
            result = out / f"bench-{name}.json"
            done = len(json.loads(result.read_text())["benchmarks"]) if result.exists() else 0
            print(f"GPU {gpu}: {name}, {done} of {len(nodes)} cases in {time.monotonic() - start:.0f} s", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def plan(runs: list[dict], seconds: float, grep: str = "") -> tuple[dict[tuple, list[list[str]]], dict[str, tuple]]:
    """What is left to run after `runs`, for processes of at most `seconds`: the groups whose name `grep` matches,
    in bundles, and every case's estimate. Prints the cases no such process can hold with what they compare with.
    What no call can hold is judged by the longest call (CALL_S) however short this one is: judged by a short
    call, a row would count without a baseline a longer call holds, and run without it (call 14 of 2026-11-30,
    185 s, ran Qwen3's rows without accelerate); a short call takes fewer bundles instead."""
    seconds = max(seconds, room(CALL_S))
    cases = report.profile_cases(runs)
    estimates = {node: estimate(case, runs) for node, case, _ in cases}
    never = too_long(cases, estimates, seconds)
    for node, case, _ in cases:
        if case in never:
            print(f"too long for a process of {seconds:.0f} s with what it compares with, not started: {node}", flush=True)
    todo = {}
    for group, bundles in parts(report.profile_cases(runs, without=frozenset(never)), never).items():
        first, *rest = merged(bundles, estimates, seconds)
        for nodes in rest:
            if cost(first + nodes, estimates) > seconds:
                print(f"too long for a process of {seconds:.0f} s beside its group's baselines, not started: {' '.join(nodes)}",
                      flush=True)
        rest = [nodes for nodes in rest if cost(first + nodes, estimates) <= seconds]
        # a baseline's own bundle (the resident model or accelerate, uncounted) is in `first` already: it runs
        # alone only where no row is left to run it with (call 13 of 2026-11-30 ran Qwen3's two alone, 160 s)
        rest = [nodes for nodes in rest if not set(nodes) <= set(first)] or rest
        if rest and re.search(grep, "-".join(group)):
            todo[group] = [first, *rest]
    return todo, estimates


def simulate(runs: list[dict], seconds: float, gpus: int, grep: str = "") -> tuple[list[list[float]], list[dict], dict]:
    """The seconds of each process parts.py would start, call after call, until nothing is left, and the runs
    then: the processes `take` gives, each its start-up and its cases' estimates (a case never measured, which
    `take` runs alone beside its baselines: its copies, `copies_s`), each case then measured as estimated. For
    the device time the rest of the profile needs (docs/results/coverage.md); what it counts is what `plan`
    plans, so the cases too long for a call are not in it, nor those left for a longer call: the third value,
    what the last plan held that no call of `seconds` took (`plan` plans for the longest call)."""
    runs, calls = list(runs), []
    while True:
        with contextlib.redirect_stdout(io.StringIO()):  # plan names what is too long, call after call
            todo, estimates = plan(runs, room(seconds), grep)
        case_by_node = {n: c for n, c, _ in report.profile_cases(runs)}
        todo, clock, took = list(todo.items()), [0.0] * gpus, []
        while True:
            gpu = min(range(gpus), key=clock.__getitem__)
            nodes, _ = take(todo, estimates, room(seconds - clock[gpu]))
            if not nodes:
                break
            took.append(START_S + cost(nodes, estimates))
            clock[gpu] += took[-1]
            runs.append({"benchmarks": [measured(case_by_node[n], *estimates[n][1:]) for n in nodes]})
        if not took:
            return calls, runs, dict(todo)
        calls.append(took)


def measured(case: tuple, build: float, took: float) -> dict:
    """A pytest-benchmark entry for `case` as `profile_cases` and `estimate` read one: built in `build` seconds,
    the rest of it in `took`."""
    shape, routing, system, fraction, size = case
    (prefill, n), slots = report.parse_size(size), suite.slots(shape, fraction)
    extra = dict(shape=shape, routing=routing, system=system, cache=slots, setup_s=build, wall_s=build + took,
                 **{"prompt" if prefill else "batch": n})
    if prefill and system == "seed":
        extra["tokens_per_call"] = suite.seed_chunk(shape, 1, slots) or n
    return {"extra_info": extra, "stats": {}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path, help="where the parts' JSON, ids and output go")
    p.add_argument("--tag", help="names this run's files, e.g. the call and commit: c1-d81205b")
    p.add_argument("--seconds", type=float,
                   help="stop every part this long after parts.py starts (its imports not counted)")
    p.add_argument("--grep", default="", help="only the parts whose name this regex matches, e.g. 'qwen3.*-b8'")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help="what a process's estimate is multiplied by to fit its time (`room`); less risks a part cut "
                   "at the limit, for a bundle whose estimate rests on a measurement of its own cases' kind")
    p.add_argument("--digest", metavar="REV",
                   help="run nothing: print commit REV's `source_digest`, to match a run's env-<tag>.json")
    p.add_argument("--simulate", type=int, metavar="GPUS",
                   help="run nothing: print the calls of --seconds on GPUS GPUs the rest would take (`simulate`)")
    args = p.parse_args()
    if args.digest:
        print(source_digest(commit_files(args.digest)))
        return
    if args.seconds is None:
        p.error("--seconds: how long the call may run (or --digest REV)")
    if args.simulate:
        calls, _, left = simulate(measured_runs(pathlib.Path("/nonexistent")), args.seconds, args.simulate, args.grep)
        busy = sum(map(sum, calls))
        print(f"{len(calls)} calls of {args.seconds:.0f} s on {args.simulate} GPUs, {sum(map(len, calls))} processes, "
              f"{busy / 3600:.1f} GPU-hours busy, {len(calls) * args.seconds * args.simulate / 3600:.1f} held")
        if left:
            cases = {n for bundles in left.values() for nodes in bundles[1:] for n in nodes}
            print(f"left for calls longer than {args.seconds:.0f} s (up to {CALL_S} s): {len(cases)} cases in {len(left)} groups")
        return
    if args.out is None or args.tag is None:
        p.error("--out and --tag name what a run writes")
    deadline = time.monotonic() + args.seconds  # the H2D measurement and the plan too (~15-20 s; call 14 was cut)
    gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        sys.exit("parts.py runs the full profile, which needs CUDA GPUs; the CPU runs the smoke profile: pytest benchmarks/")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
           if d.metadata["Name"] in ("torch", "transformers", "triton", "accelerate", "pytest-benchmark")}
    env["gpus"] = [torch.cuda.get_device_name(int(g)) for g in gpus]
    env["source_sha256"] = source_digest(tree_files(HERE.parent))
    (args.out / f"env-{args.tag}.json").write_text(json.dumps(env))
    if len(gpus) > 1:
        from h2d_side_by_side import side_by_side

        (args.out / f"side-by-side-{args.tag}.json").write_text(json.dumps(side_by_side(list(range(len(gpus))))))
    todo, estimates = plan(measured_runs(args.out), room(deadline - time.monotonic(), margin=args.margin), args.grep)
    print(f"{len({n for b in todo.values() for ns in b for n in ns})} cases in {len(todo)} groups on {len(gpus)} GPUs "
          f"for {args.seconds:.0f} s", flush=True)
    run(todo, estimates, gpus, deadline - time.monotonic(), args.out, args.tag, margin=args.margin)


if __name__ == "__main__":
    main()
