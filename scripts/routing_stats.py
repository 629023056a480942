"""Routing statistics of a MoE model on held-out text, against what uniform random routing would give.

    python scripts/routing_stats.py                      # the embedded demo model, its validation files
    python scripts/routing_stats.py --trace demo.npz     # also save the routing as a trace (docs/traces.md)

Per MoE layer, over `--sequences` windows of `--seq` tokens from the validation split of
scripts/train_demo_model.py (the same hash rule; the files come from the running Python's stdlib):
  reuse       share of a token's k experts that the previous token of the sequence also used (random: k/E)
  top-25%     share of routed pairs that go to the layer's E/4 most used experts (random: 25%)
  entropy     entropy of the expert load over log E (random: ~1.0)
  gate recall share of layer l+1's k experts found in the top-k of layer l+1's router applied to
              layer l's MoE input, the runtime's `gate` predictor (random: k/E)
and, pooled over layers, the same with layer l+d's router for d = 1, 2, 3: how far ahead the gate sees.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import transformers

import asyncmoe
from asyncmoe.prefetch.predictors import gate_top

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_demo_model import corpus_files, encode, split  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: asyncmoe.demo_model_path()")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--trace", default=None, help="save the routing to this .npz")
    args = p.parse_args()
    path = args.model or asyncmoe.demo_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    _, val_texts = split(corpus_files())
    data = encode(tokenizer, val_texts)
    n = min(args.sequences, data.numel() // args.seq)
    batch = data[: n * args.seq].view(n, args.seq)

    k = model.config.num_experts_per_tok
    rec = asyncmoe.record(model, gate=True)  # gate: layer l's router on layer l-1's MoE input
    inputs = [
        [] for _ in rec.experts
    ]  # each MoE layer's input [T, H], to score the gate further ahead than the runtime does
    hooks = [
        m.register_forward_pre_hook(
            lambda _, a, kw, l=l: inputs[l].append(a[0] if a else kw["hidden_states"]),
            with_kwargs=True,
        )
        for l, m in enumerate(rec.experts)
    ]
    with torch.no_grad(), rec:
        for row in batch:
            rec.new_sequence()
            model(row[None])
    for h in hooks:
        h.remove()
    trace = rec.trace
    if args.trace:
        trace.save(args.trace)
    ids = torch.as_tensor(trace.ids).long().view(n, args.seq, trace.layers, -1)  # [S, T, L, k]
    predicted = torch.as_tensor(trace.gate_ids).long().view(n, args.seq, trace.layers, -1)
    E = trace.num_experts

    def overlap(a, b):  # [..., k] x [..., k] -> share of a's ids in b
        return (a[..., :, None] == b[..., None, :]).any(-1).float().mean().item()

    print(
        f"model {path}: {trace.layers} MoE layers, {E} experts, top-{k}; {n} x {args.seq} validation tokens\n"
    )
    print(
        f"| layer | reuse (random {k / E:.1%}) | top-25% share (random 25%) | load entropy / log E "
        f"| gate recall l-1 -> l (random {k / E:.1%}) |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for l in range(trace.layers):
        reuse = overlap(ids[:, 1:, l], ids[:, :-1, l])
        load = torch.bincount(ids[:, :, l].flatten(), minlength=E).float()
        top = load.sort(descending=True).values[: E // 4].sum().item() / load.sum().item()
        prob = load / load.sum()
        entropy = -(prob[prob > 0] * prob[prob > 0].log()).sum().item() / math.log(E)
        recall = overlap(ids[:, :, l], predicted[:, :, l]) if l > 0 else float("nan")
        rows.append((reuse, top, entropy, recall))
        print(
            f"| {l} | {reuse:.1%} | {top:.1%} | {entropy:.3f} | {'-' if l == 0 else f'{recall:.1%}'} |"
        )
    mean = [
        sum(r[i] for r in rows if not math.isnan(r[i])) / sum(not math.isnan(r[i]) for r in rows)
        for i in range(4)
    ]
    print(f"| mean | {mean[0]:.1%} | {mean[1]:.1%} | {mean[2]:.3f} | {mean[3]:.1%} |")

    # how far ahead the gate sees: layer l's router on layer l-d's MoE input, against layer l's routing
    x = [torch.cat(i) for i in inputs]
    print(
        "\n| gate d layers ahead | recall of the k routed experts | its likeliest guess routed |\n|---|---|---|"
    )
    for d in (1, 2, 3):
        hits = torch.cat(
            [
                (
                    gate_top(x[l - d], *rec.routers[l], k).indices[:, :, None]
                    == ids.flatten(0, 1)[:, l, None, :]
                )
                .any(-1)
                .float()
                for l in range(d, trace.layers)
            ]
        )  # [T * (L - d), k]
        print(f"| {d} | {hits.mean().item():.1%} | {hits[:, 0].mean().item():.1%} |")


if __name__ == "__main__":
    main()
