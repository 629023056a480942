"""Prefetch on real routing: the embedded model, 16 of 64 slots (--cache), greedy decode on the CPU, per predictor set.

    python scripts/prefetch_study.py [--cache 8]

Six 32-token prompts from the validation split (scripts/train_demo_model.py), 64 greedy tokens each.
Per decoded token: demand misses (copies the compute waits for), experts prefetched, prefetched but
evicted unused, and prefetch recall. The CPU runs the same cache and predictor code as the GPU; only
the timing differs. Results: docs/routing.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import transformers

import asyncmoe

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_demo_model import corpus_files, encode, split  # noqa: E402

KEYS = ("hits", "misses", "prefetched", "wasted", "prefetch_hits")


def run(
    plan: asyncmoe.Prefetch | None, prompts: list[torch.Tensor], cache: int, new_tokens: int = 64
) -> dict:
    model = asyncmoe.from_pretrained(
        asyncmoe.demo_model_path(), cache=cache, dtype=torch.float32, device="cpu", prefetch=plan
    )
    dec = asyncmoe.Decoder(model, 1, prompts[0].shape[1] + new_tokens + 1, graph=False)
    total = dict.fromkeys(KEYS, 0)
    for ids in prompts:
        dec.prefill(ids)
        asyncmoe.stats(model, reset=True)
        dec.decode(new_tokens)
        t = asyncmoe.stats(model).totals
        total = {k: total[k] + t[k] for k in KEYS}
    n, looked_up = new_tokens * len(prompts), total["hits"] + total["misses"]
    return dict(
        hit_rate=total["hits"] / looked_up,
        misses=total["misses"] / n,
        prefetched=total["prefetched"] / n,
        wasted=total["wasted"] / n,
        recall=total["prefetch_hits"] / looked_up,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=int, default=16, help="slots per MoE layer (of 64)")
    p.add_argument(
        "--budget", type=int, default=1, help="experts prefetched per layer per call, at most"
    )
    args = p.parse_args()
    cache, budget = args.cache, args.budget
    tokenizer = transformers.AutoTokenizer.from_pretrained(asyncmoe.demo_model_path())
    data = encode(tokenizer, split(corpus_files())[1])
    prompts = [data[i * 997 : i * 997 + 32][None] for i in range(6)]
    print(
        "| prefetch | hit rate | demand misses / token | prefetched / token | unused / token | recall |"
    )
    print("|---|---|---|---|---|---|")
    for label, plan in [
        ("off", None),
        (f"default ({'+'.join(asyncmoe.Prefetch().sources)})", asyncmoe.Prefetch(budget=budget)),
        ("gate+transition", asyncmoe.Prefetch(sources=("gate", "transition"), budget=budget)),
        (
            "gate+temporal+transition",
            asyncmoe.Prefetch(sources=("gate", "temporal", "transition"), budget=budget),
        ),
        (
            "temporal+transition",
            asyncmoe.Prefetch(sources=("temporal", "transition"), budget=budget),
        ),
    ]:
        r = run(plan, prompts, cache)
        print(
            f"| {label} | {r['hit_rate']:.1%} | {r['misses']:.2f} | {r['prefetched']:.2f} | {r['wasted']:.2f} "
            f"| {r['recall']:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
