"""Eager calls that stop after the waves their experts fill (`stop`) against calls that run the worst case's waves
(`all`: what a captured graph runs, and what every call ran before), alternated on one model in one process:
a prompt at batch 1 and decode steps at a large batch (`--batch 0`: prompts only), both routed by the model's
widened router.

    python benchmarks/wave_ab.py --shape qwen3-30b-a3b --cache 32 --prompt 2048 --batch 32

`all` forces `providers._fixed_shapes` true, so the two differ only in the host read and the waves it skips.
Prints per round the median of `--reps` prompts (CUDA events) and of `--reps` decode runs of `--steps` steps, the
waves a layer computed, and the overall medians with their ratio; it fails if the two modes' logits differ.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import asyncmoe
from asyncmoe import providers
from copy_bandwidth import timed
from shapes import random_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--cache", type=int, default=32)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32, help="0: prompts only")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="prompts, and decode runs, timed a round per mode")
    args = p.parse_args()

    model = asyncmoe.compile(random_model(args.shape, torch.bfloat16, "cuda"), cache=args.cache, prefetch=False)
    layers = len(asyncmoe.stats(model).layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=gen).cuda()
    one = asyncmoe.Decoder(model, batch_size=1, max_length=args.prompt + 1, graph=False)
    if args.batch:
        bids = torch.randint(1, model.config.vocab_size, (args.batch, 16), generator=gen).cuda()
        many = asyncmoe.Decoder(model, batch_size=args.batch, max_length=16 + 1 + args.steps, graph=False)
    modes = {"stop": providers._fixed_shapes, "all": lambda x: True}

    def decode_ms(_):
        many.prefill(bids)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        many.decode(args.steps)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / args.steps

    def waves(run, calls: int) -> float:
        """Waves a layer computed in `calls` untimed forwards, counted at `providers.routed_outputs`."""
        n, routed = [0], providers.routed_outputs
        providers.routed_outputs = lambda *a: (n.__setitem__(0, n[0] + 1), routed(*a))[1]
        try:
            run()
        finally:
            providers.routed_outputs = routed
        return n[0] / (layers * calls)

    got = {m: dict(prompt=[], decode=[]) for m in modes}
    logits = {}
    for r in range(args.rounds):
        for m, fixed in modes.items():
            providers._fixed_shapes = fixed
            one.prefill(ids)  # warm: Triton compiles on the first
            logits[m] = one.logits.clone()
            got[m]["prompt"].append(timed(lambda _: one.prefill(ids), args.reps))
            line = (f"round {r} {m}: prompt {got[m]['prompt'][-1]:.1f} ms "
                    f"({waves(lambda: one.prefill(ids), 1):.2f} waves a layer)")
            if args.batch:
                got[m]["decode"].append(statistics.median(decode_ms(i) for i in range(args.reps)))
                many.prefill(bids)
                line += (f", batch {args.batch} decode {got[m]['decode'][-1]:.2f} ms a step "
                         f"({waves(lambda: many.decode(args.steps), args.steps):.2f} waves a layer)")
            print(line, flush=True)
        assert torch.equal(logits["stop"], logits["all"]), "the two modes' prompt logits differ"
    providers._fixed_shapes = modes["stop"]
    med = {m: {k: statistics.median(v) for k, v in got[m].items() if v} for m in modes}
    line = (f"{args.shape}, cache {args.cache}, {torch.cuda.get_device_name()}, medians of {args.rounds} rounds: "
            f"prompt {args.prompt} stop {med['stop']['prompt']:.1f} / all {med['all']['prompt']:.1f} ms = "
            f"{med['stop']['prompt'] / med['all']['prompt']:.3f}")
    if args.batch:
        line += (f"; batch {args.batch} decode stop {med['stop']['decode']:.2f} / all {med['all']['decode']:.2f} ms "
                 f"a step = {med['stop']['decode'] / med['all']['decode']:.3f}")
    print(line + "; prompt logits equal")


if __name__ == "__main__":
    main()
