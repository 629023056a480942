"""GPU time per kernel of asyncmoe's decode steps, or of one long prompt, from the profiler: what
each launch of the cache and the prefetch costs beside the model's own kernels (a CUDA graph replays
the same kernels; the profiler times them in eager steps, where it can name them).

    python benchmarks/diagnostics/profile_step.py --shape olmoe-1b-7b --cache 32 --steps 16
    python benchmarks/diagnostics/profile_step.py --shape qwen3-30b-a3b --cache 32 --prompt 2048 --no-prefetch
    python benchmarks/diagnostics/profile_step.py --shape gpt-oss-120b --random-mxfp4 --cache 18 --prompt 2048

Prints, per kernel name: launches per token, mean µs per launch and µs per token, sorted by the
last. With `--prompt N` the unit is one prompt, and a line before the table gives its wall time
(median of 5, CUDA events), the bytes it copied and how long its layers waited for their own misses
(`time_stalls`, the GPU clock). That splits a prompt's time into its copies, its compute and what
the waves add around both. The model routes by its own router, widened, as the latency suite's
`router` cases; `--cache` at or above the experts runs the unmodified model, for the compute alone.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import asyncmoe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import PROMPT, cuda_ms, prompt
from shapes import SHAPES, random_model, random_mxfp4_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument("--cache", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--prompt", type=int, help="profile one prompt of this many tokens instead of decode steps"
    )
    p.add_argument(
        "--random-mxfp4",
        action="store_true",
        help="random MXFP4 experts made in host memory (shapes.random_mxfp4_model: gpt-oss-120b)",
    )
    args = p.parse_args()

    build = random_mxfp4_model if args.random_mxfp4 else random_model
    model = asyncmoe.compile(
        build(args.shape, torch.bfloat16, "cuda"),
        cache=args.cache,
        prefetch=not args.no_prefetch,
        time_stalls=bool(args.prompt),
        quantize="mxfp4" if args.random_mxfp4 else None,
    )
    if args.prompt:
        return profile_prompt(model, args)
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=PROMPT + 2 * args.steps + 1, graph=False)
    dec.prefill(prompt(args.shape, 1, seed=0))
    dec.decode(args.steps)  # warm: Triton compiles, the cache fills
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(args.steps)
        torch.cuda.synchronize()
    print(
        f"{args.shape}, cache {args.cache}, prefetch {'off' if args.no_prefetch else 'on'}, "
        f"{args.steps} eager steps, "
        f"{torch.cuda.get_device_name()}:"
    )
    print_kernels(prof, args.steps, "token", args.top)


def profile_prompt(model, args) -> None:
    """One prompt of `args.prompt` random tokens, timed five times after a warm-up (Triton
    compiles), then profiled once."""
    ids = prompt(args.shape, 1, args.prompt, seed=0)
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=args.prompt + 1, graph=False)
    cached = asyncmoe.stats(model).layers  # [] where every layer is resident
    ms = cuda_ms(lambda: dec.prefill(ids), 5)
    gpu = torch.cuda.get_device_name()
    line = f"{args.shape}, cache {args.cache}, prompt {args.prompt}, {gpu}: {ms:.1f} ms a prompt"
    if cached:  # one more prompt, untimed, for its own counters
        asyncmoe.stats(model, reset=True)
        dec.prefill(ids)
        totals = asyncmoe.stats(model).totals
        line += (
            f", {totals['bytes_h2d'] / 1e9:.2f} GB copied, its layers waited "
            f"{totals['ensure_ns'] / 1e6:.1f} ms "
            f"for their own misses and {totals['wait_ns'] / 1e6:.1f} ms for prefetches"
        )
    print(line)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.prefill(ids)
        torch.cuda.synchronize()
    print_kernels(prof, 1, "prompt", args.top)


def print_kernels(prof, units: int, unit: str, top: int) -> None:
    rows = [
        (e.key, e.count, e.self_device_time_total)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[2])
    print(f"{sum(r[2] for r in rows) / units:.1f} µs of kernels per {unit}")
    print(f"{'kernel':<90} {'per ' + unit:>10} {'µs each':>8} {'µs/' + unit:>10}")
    for name, count, us in rows[:top]:
        print(f"{name[:90]:<90} {count / units:>10.1f} {us / count:>8.2f} {us / units:>10.1f}")


if __name__ == "__main__":
    main()
