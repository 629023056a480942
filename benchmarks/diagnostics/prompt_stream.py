"""A prompt's time against the link's floor: one eager forward of `--tokens` tokens through asyncmoe at `--cache`
slots, beside the same model with every expert resident, and the bytes the prompt moved over the copy engine's
bandwidth measured in the same run (GPU).

    python benchmarks/diagnostics/prompt_stream.py --shape deepseek-v2-lite --cache 16 --replay trace
    python benchmarks/diagnostics/prompt_stream.py --shape deepseek-v2-lite --quantize fp8 --no-resident

Each length: `--rounds` forwards (`logits_to_keep=1`, no KV cache), the counters reset before each, after one
untimed forward; ms is the median wall time to the end of the GPU's work. floor = max(resident ms, bytes moved /
the pinned host -> GPU copy_'s bandwidth); ratio = ms / floor. Random weights of the shape (shapes.py), routed by
the random router or, with `--replay trace`, as the latency suite's trace cases (harness.trace_for; the
resident model by its router).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import asyncmoe
from asyncmoe.integrations.replay import rewind_replay

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import h2d_bandwidth, prompt, trace_for
from shapes import SHAPES, random_model


def forward_ms(model, ids: torch.Tensor, rounds: int, cached: bool) -> tuple[float, int]:
    """Median wall ms of one eager forward over `rounds` (after one untimed), and the bytes the last round moved
    host -> GPU (0 unless `cached`)."""
    times, moved = [], 0
    for r in range(rounds + 1):
        if cached:
            rewind_replay(model)
            asyncmoe.stats(model, reset=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        if r:
            times.append((time.perf_counter() - start) * 1e3)
        moved = asyncmoe.stats(model).totals["bytes_h2d"] if cached else 0
    return statistics.median(times), moved


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v2-lite", choices=sorted(SHAPES))
    p.add_argument("--cache", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 2048, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantize", choices=["fp8", "mxfp4", "int4"], default=None)
    p.add_argument(
        "--replay", choices=["trace"], default=None, help="route as the suite's trace cases"
    )
    p.add_argument(
        "--no-resident", action="store_true", help="no resident row (the floor: bytes alone)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    bandwidth = h2d_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}; pinned host->GPU copy_: {bandwidth:.1f} GB/s", flush=True
    )
    base = random_model(args.shape, torch.bfloat16, "cuda")
    ids = {n: prompt(args.shape, 1, n, seed=n) for n in args.tokens}
    resident = {}
    if not args.no_resident:
        resident = {n: forward_ms(base, ids[n], args.rounds, False)[0] for n in args.tokens}
    replay = trace_for(args.shape, args.replay) if args.replay else None
    model = asyncmoe.compile(
        base, cache=args.cache, device="cuda", quantize=args.quantize, hybrid=False, replay=replay
    )  # the resident model's experts go to host memory: one copy of the weights at a time
    print(
        "| tokens | ms | resident ms | GB moved | floor ms | ms / floor |\n|--:|--:|--:|--:|--:|--:|"
    )
    rows = []
    for n in args.tokens:
        ms, moved = forward_ms(model, ids[n], args.rounds, True)
        floor = max(resident.get(n, 0.0), moved / (bandwidth * 1e6))
        rows.append(dict(tokens=n, ms=ms, resident_ms=resident.get(n), bytes=moved, floor_ms=floor))
        res = f"{resident[n]:.1f}" if n in resident else ""
        print(
            f"| {n} | {ms:.1f} | {res} | {moved / 1e9:.2f} | {floor:.1f} | {ms / floor:.3f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    vars(args),
                    device=torch.cuda.get_device_name(),
                    h2d_GB_per_s=bandwidth,
                    rows=rows,
                ),
                f,
            )


if __name__ == "__main__":
    main()
