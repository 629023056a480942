"""GPU time per kernel of asyncmoe's decode steps, from the profiler: what each launch of the cache and the
prefetch costs beside the model's own kernels (a CUDA graph replays the same kernels; the profiler
times them in eager steps, where it can name them).

    python benchmarks/profile_step.py --shape olmoe-1b-7b --cache 32 --steps 16

Prints, per kernel name: launches per token, mean µs per launch and µs per token, sorted by the last.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import asyncmoe
from shapes import SHAPES, random_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument("--cache", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    model = asyncmoe.compile(random_model(args.shape, torch.bfloat16, "cuda"), cache=args.cache, prefetch=not args.no_prefetch)
    prompt = torch.randint(1, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=16 + 2 * args.steps + 1, graph=False)
    dec.prefill(prompt)
    dec.decode(args.steps)  # warm: Triton compiles, the cache fills
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(args.steps)
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"{args.shape}, cache {args.cache}, prefetch {'off' if args.no_prefetch else 'on'}, {args.steps} eager steps, "
          f"{torch.cuda.get_device_name()}: {total / args.steps:.1f} µs of kernels per token")
    print(f"{'kernel':<90} {'per token':>9} {'µs each':>8} {'µs/token':>9}")
    for name, count, us in rows[: args.top]:
        print(f"{name[:90]:<90} {count / args.steps:>9.1f} {us / count:>8.2f} {us / args.steps:>9.1f}")


if __name__ == "__main__":
    main()
