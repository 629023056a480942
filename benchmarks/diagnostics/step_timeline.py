"""Where a graph decode step's time goes: the profiler's kernel timeline of the Decoder's CUDA graph, split into
time the link is copying, time only compute runs, and time the GPU idles.

    python benchmarks/diagnostics/step_timeline.py --shape olmoe-1b-7b --cache 16 --routings trace oracle --budgets 1 8
    python benchmarks/diagnostics/step_timeline.py --routings oracle --budgets 1 --quantize fp8    # fp8 experts

Per case, per token: ms (CUDA events around the profiled steps); "copying": the union of the gather-copy
kernels' spans (the link is busy); "compute only": kernels running while no copy runs; "idle": neither. The
copies' speed in the step is bytes / copying, against the copy engine's (pinned `copy_`, same run). The kernels
that fill "compute only" are listed by their share of it: what a longer prefetch would have to hide.
With the hybrid on (`--hybrid on`, compile's default `auto` decides by itself), "waiting for the CPU" is the
receive kernels' time (they spin until the CPU's rows are in), and the CPU's own figures come from its worker: ms
computing a token and the weights it read per second of that, against what the link moved per second of copying.
Routing as the latency suite's (`trace`: the embedded model's, `oracle`: its gate arrays nominate each layer's
own experts, benchmarks/oracle.py; `router`: the random-weight model's own); `--budgets 0` is no prefetch.
`--out` keeps each case's figures and its last three steps' GPU events, to read offline.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import asyncmoe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import gpu_events, h2d_bandwidth, prompt, trace_for
from shapes import random_model

COPY_KERNEL = "_gather_copy_kernel"
RECEIVE_KERNEL = (
    "_receive"  # the hybrid's and cache=0's receive kernels: they spin until the CPU's rows are in
)
HYBRID = {"off": False, "on": True, "auto": None}
SHORT_GAP_US = (
    20.0  # a hole between two copies shorter than this is a kernel boundary, not compute waited for
)
WHOLE_LAYER_US = (
    200.0  # a hole longer than this spans a layer's whole compute (OLMoE-1B-7B's: ~0.27 ms)
)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def outside(span: tuple[float, float], covered: list[tuple[float, float]]) -> float:
    """Length of `span` not inside the sorted, disjoint `covered` spans."""
    a, b = span
    inside = sum(max(0.0, min(b, y) - max(a, x)) for x, y in covered if x < b and y > a)
    return (b - a) - inside


def gaps(spans: list[tuple[float, float]]) -> list[float]:
    """The holes between consecutive sorted, disjoint spans."""
    return [b[0] - a[1] for a, b in zip(spans, spans[1:])]


def copy_spans(events: list[dict]) -> list[tuple[float, float]]:
    """When the copy kernels run: the union of their spans (the link is busy)."""
    return union([(e["start"], e["end"]) for e in events if e["name"].startswith(COPY_KERNEL)])


def long_holes(holes: list[float], steps: int) -> dict:
    """The holes between copies longer than a kernel boundary, per step: those under WHOLE_LAYER_US (compute a
    prefetch's copy did not cover) and those over it (a layer's whole compute with nothing to copy, or a step's
    tail and the next one's head), each as a count and ms."""
    part = [g for g in holes if SHORT_GAP_US <= g < WHOLE_LAYER_US]
    whole = [g for g in holes if g >= WHOLE_LAYER_US]
    return {
        "partial": len(part) / steps,
        "partial_ms": sum(part) / steps / 1e3,
        "whole": len(whole) / steps,
        "whole_ms": sum(whole) / steps / 1e3,
    }


def timeline(model, steps: int, ids: torch.Tensor) -> dict:
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=ids.shape[1] + steps + 9, graph=True)
    dec.prefill(ids)
    dec.decode(8)  # capture and warm up
    asyncmoe.stats(model, reset=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start.record()
        dec.decode(steps)
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    events = gpu_events(prof)
    ks = [(e["name"], e["start"], e["end"]) for e in events if e["cat"] == "kernel"]
    if not ks:
        raise RuntimeError(
            "the profiler recorded no kernels of the graph: this CUDA/CUPTI does not trace graph nodes"
        )
    copying = copy_spans(events)
    busy = union([(a, b) for _, a, b in ks])
    copy_us = sum(b - a for a, b in copying)
    busy_us = sum(b - a for a, b in busy)
    exposed = collections.Counter()
    for n, a, b in ks:
        if not n.startswith(COPY_KERNEL):
            exposed[n[:60]] += outside((a, b), copying)
    holes = gaps(copying)
    short = [g for g in holes if g < SHORT_GAP_US]
    totals = asyncmoe.stats(model).totals
    moved = totals["bytes_h2d"]
    receiving = union([(a, b) for n, a, b in ks if RECEIVE_KERNEL in n])
    return {
        "ms_per_token": ms,
        "MB_per_token": moved / steps / 1e6,
        "copying_ms": copy_us / steps / 1e3,
        "compute_only_ms": (busy_us - copy_us) / steps / 1e3,
        "idle_ms": ms - busy_us / steps / 1e3,
        "copy_launches": sum(n.startswith(COPY_KERNEL) for n, _, _ in ks) / steps,
        "short_gaps": len(short) / steps,  # between copies, per token: kernel boundaries
        "short_gaps_ms": sum(short) / steps / 1e3,
        # the longest hole of each step's share: where a step ends and the next begins (tail and head)
        "largest_gaps_ms": sum(sorted(holes)[-steps:]) / steps / 1e3,
        "long_holes": long_holes(holes, steps),  # between copies: waiting for compute
        "copy_GB_per_s": moved / (copy_us / 1e6) / 1e9 if copy_us else None,
        "hit_rate": totals["hit_rate"],
        "cpu_wait_ms": sum(b - a for a, b in receiving) / steps / 1e3,
        "cpu_experts": totals["cpu_experts"] / steps,
        "cpu_ms": totals["cpu_ns"] / steps / 1e6,
        "cpu_GB_per_s": totals["cpu_bytes"] / totals["cpu_ns"] if totals["cpu_ns"] else None,
        "cost_model_ms": totals["cost_ns"] / steps / 1e6,
        "exposed_top": [(n, us / steps / 1e3) for n, us in exposed.most_common(12)],
        "last_events": events[
            -len(events) // steps * 3 :
        ],  # about the last 3 steps', for reading offline
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b")
    p.add_argument("--cache", type=int, default=16)
    p.add_argument("--routings", nargs="+", default=["trace", "oracle"])
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 1, 8])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument(
        "--quantize",
        choices=["fp8", "mxfp4", "int4"],
        default=None,
        help="the experts' format (bf16)",
    )
    p.add_argument(
        "--hybrid", choices=sorted(HYBRID), default="auto", help="the CPU computing some misses"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = random_model(args.shape, torch.bfloat16, "cuda")
    ids = prompt(args.shape, 1, seed=0)
    engine = h2d_bandwidth()
    fmt = args.quantize or "bf16"
    print(
        f"{torch.cuda.get_device_name()}: copy engine {engine:.1f} GB/s; {args.shape} {fmt}, cache {args.cache}"
    )
    rows = []
    for routing in args.routings:
        for budget in args.budgets:
            model = asyncmoe.compile(
                copy.deepcopy(base),
                cache=args.cache,
                quantize=args.quantize,
                prefetch=asyncmoe.Prefetch(budget=budget) if budget else False,
                replay=None if routing == "router" else trace_for(args.shape, routing),
                hybrid=HYBRID[args.hybrid],
            )
            r = {"routing": routing, "budget": budget, **timeline(model, args.steps, ids)}
            r["copy_share_of_engine"] = r["copy_GB_per_s"] / engine if r["copy_GB_per_s"] else None
            r["ratio_to_engine_bytes"] = r["ms_per_token"] / (
                r["MB_per_token"] / engine
            )  # MB / (GB/s) = ms
            rows.append(r)
            print(
                f"{routing:<8} budget {budget}: {r['ms_per_token']:.2f} ms/token, {r['MB_per_token']:.0f} MB, "
                f"hit {100 * r['hit_rate']:.1f}%; copying {r['copying_ms']:.2f} ms at {r['copy_GB_per_s']:.1f} GB/s "
                f"({100 * r['copy_share_of_engine']:.1f}% of the engine), compute only {r['compute_only_ms']:.2f} ms, "
                f"idle {r['idle_ms']:.2f} ms; time / (bytes at the engine's speed) {r['ratio_to_engine_bytes']:.2f}",
                flush=True,
            )
            print(
                f"    between copies: {r['short_gaps']:.0f} holes under {SHORT_GAP_US:.0f} us, "
                f"{r['short_gaps_ms']:.3f} ms; {r['copy_launches']:.0f} copy launches"
            )
            if r["cpu_ms"]:
                print(
                    f"    CPU: {r['cpu_experts']:.1f} experts, computing {r['cpu_ms']:.2f} ms at"
                    f" {r['cpu_GB_per_s']:.1f} GB/s of weights; the GPU waiting for it {r['cpu_wait_ms']:.2f} ms;"
                    f" the cost model's misses"
                    f" {r['cost_model_ms']:.2f} ms"
                )
            h = r["long_holes"]
            print(
                f"    longer holes a step: {h['partial']:.1f} under {WHOLE_LAYER_US:.0f} us, {h['partial_ms']:.3f} ms; "
                f"{h['whole']:.1f} over it, {h['whole_ms']:.3f} ms, the longest one {r['largest_gaps_ms']:.3f} ms"
            )
            for n, ms in r["exposed_top"]:
                print(f"    {ms:7.3f} ms  {n}")
            del model
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "engine_GB_per_s": engine, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
