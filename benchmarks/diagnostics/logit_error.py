"""How far a cached model's logits are from float32's, beside the unmodified bf16 model's.

On random weights two logits often nearly tie, so greedy tokens part at the first step where bf16 rounding
crosses a tie, and the latency suite's "tokens agree" cannot tell a rounding difference from a bug. This decodes
greedily with the unmodified bf16 model, feeds those tokens to it, to asyncmoe (bf16, eager) and to the same
weights in float32, all routed by the replayed trace (as the suite's trace cases), and prints per step each bf16
model's largest logit error against float32, float32's top-2 gap, and which models' greedy token is float32's.

    python benchmarks/diagnostics/logit_error.py [--shape olmoe-1b-7b] [--cache 16] [--steps 32]
"""

import argparse
import copy
import pathlib
import sys

import torch
from transformers import DynamicCache

import asyncmoe
from asyncmoe.integrations.replay import replay_routing, rewind_replay
from asyncmoe.runtime.decoder import kv_keyword

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import PROMPT, prompt, trace_for
from shapes import random_model


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The prompt and `steps` greedy tokens: [1, PROMPT + steps]."""
    rewind_replay(model)
    return (
        asyncmoe.Decoder(model, 1, PROMPT + steps, graph=False)
        .generate(ids, steps)
        .tokens[:, : PROMPT + steps]
    )


@torch.no_grad()
def logits_along(model, seq: torch.Tensor) -> torch.Tensor:
    """The next-token logits after the prompt and after each later token of `seq`, fed one at a time: [T, V]."""
    rewind_replay(model)
    kv = {kv_keyword(model): DynamicCache(config=model.config)}
    rows = [model(seq[:, :PROMPT], **kv).logits[0, -1].float()]
    for t in range(PROMPT, seq.shape[1] - 1):
        rows.append(model(seq[:, t : t + 1], **kv).logits[0, -1].float())
    return torch.stack(rows)


def agree(a: torch.Tensor, b: torch.Tensor) -> int:
    """Generated tokens before the first that differs."""
    return int((a == b).all(0).cumprod(0).sum()) - PROMPT


def measure(shape: str, cache: int, steps: int, device: str) -> dict:
    """Greedy tokens of each model, and fed the unmodified model's: each bf16 model's largest logit error against
    float32 per step [T], whether its greedy token is float32's [T], and float32's top-2 gap [T]."""
    bf16 = random_model(shape, torch.bfloat16, device)
    models = {
        "unmodified": bf16,
        "asyncmoe": asyncmoe.compile(copy.deepcopy(bf16), cache=cache, prefetch=False),
        "float32": copy.deepcopy(bf16).float(),  # the same weights, exactly
    }
    for m in models.values():
        replay_routing(m, trace_for(shape), device)
    ids = prompt(shape, 1)
    tokens = {name: greedy(m, ids, steps) for name, m in models.items()}
    logits = {name: logits_along(m, tokens["unmodified"]) for name, m in models.items()}
    ref = logits.pop("float32")
    top2 = ref.topk(2, dim=-1).values
    return dict(
        tokens=tokens,
        error={name: (x - ref).abs().amax(-1) for name, x in logits.items()},
        same={name: x.argmax(-1) == ref.argmax(-1) for name, x in logits.items()},
        gap=top2[:, 0] - top2[:, 1],
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="olmoe-1b-7b")
    p.add_argument("--cache", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 is the reference
    steps = args.steps + 1
    r = measure(args.shape, args.cache, steps, device)
    tokens, err, same, gap = r["tokens"], r["error"], r["same"], r["gap"]
    print(f"{args.shape}, {args.cache} slots, {device}: greedy tokens agreeing, of {steps}")
    for name, t in tokens.items():
        with_bf16, with_fp32 = agree(t, tokens["unmodified"]), agree(t, tokens["float32"])
        print(f"  {name:<10} with unmodified {with_bf16:>3}, with float32 {with_fp32}")
    print(
        "\nfed the unmodified model's tokens: largest |logit - float32's| per step; float32's top-2 gap"
    )
    print(f"{'step':>4} {'gap':>7} {'unmodified':>10} {'asyncmoe':>9}  greedy token = float32's")
    for t in range(len(gap)):
        marks = " ".join(name for name in err if same[name][t])
        print(
            f"{t:>4} {gap[t]:>7.4f} {err['unmodified'][t]:>10.4f} {err['asyncmoe'][t]:>9.4f}  {marks}"
        )
    for name in err:
        e, hits = err[name], int(same[name].sum())
        print(
            f"{name:<10} error median {e.median():.4f} max {e.max():.4f}; float32's token {hits}/{steps}"
        )


if __name__ == "__main__":
    main()
