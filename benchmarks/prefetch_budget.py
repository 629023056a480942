"""Prefetch budgets against each other and against no prefetch: batch-1 graph decode at 16 of 64 slots, for each
routing (a latency suite routing: trace, oracle, oracle-q0.7) and experts' format, the models of a case in one
process with their rounds interleaved, compared as paired ratios to no prefetch. Per budget it prints what the
nominations past each call's likeliest (the runners-up, gated apart) were worth: the share of them the call
routed to, and how many were copied.

    python benchmarks/prefetch_budget.py --shape deepseek-v2-lite --formats fp8 --budgets 1 2 3 --out budget.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json

import torch

import asyncmoe

from decode_step import h2d_bandwidth, interleaved
from shapes import SHAPES, random_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument("--routings", nargs="+", default=["trace", "oracle", "oracle-q0.7"])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--cache", type=int, default=16)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from test_latency import trace_for  # imports decode_step: not at the top

    results = {"gpu": torch.cuda.get_device_name(), "engine_GB_per_s": h2d_bandwidth(), "case": vars(args)}
    print(f"{args.shape}, {results['gpu']}, copy engine {results['engine_GB_per_s']:.1f} GB/s", flush=True)
    base = random_model(args.shape, torch.bfloat16, "cuda")
    prompt = torch.randint(1, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    for key in args.formats:
        for routing in args.routings:
            decoders = {}
            for budget in [0, *args.budgets]:
                prefetch = asyncmoe.Prefetch(budget=budget) if budget else False
                model = asyncmoe.compile(
                    copy.deepcopy(base),
                    cache=args.cache,
                    quantize=None if key == "bf16" else key,
                    prefetch=prefetch,
                    replay=trace_for(args.shape, routing),
                )
                dec = asyncmoe.Decoder(model, batch_size=1, max_length=16 + args.steps + 9, graph=True)
                dec.prefill(prompt)
                dec.decode(8)
                decoders[f"budget {budget}" if budget else "none"] = (model, dec)
            measured = asyncmoe.stats(decoders[next(reversed(decoders))][0])  # the pace its gates read
            rows = interleaved(decoders, prompt, args.rounds, args.steps)
            results[f"{key} {routing}"] = rows
            print(
                f"{key} {routing}: an expert's copy {measured.copy_ns / 1e3:.0f} us, a layer's window "
                f"{measured.window_ns / 1e3:.0f} us",
                flush=True,
            )
            for name, row in rows.items():
                n = row["counters"]
                looked_up = max(n["hits"] + n["misses"], 1)
                runners = f"{n['runners_up_paid'] / n['runners_up']:.2f}" if n.get("runners_up") else "-"
                print(
                    f"  {name:9} {row['ms']:7.3f} ms/token  x none {row['paired_ratio']:.4f}  "
                    f"{row['MB_per_token']:6.1f} MB/token  hit {100 * n['hits'] / looked_up:5.1f}%  "
                    f"prefetched/token {n['prefetched'] / args.rounds / args.steps:5.2f}  runners-up routed {runners}",
                    flush=True,
                )
            del decoders
            gc.collect()
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
