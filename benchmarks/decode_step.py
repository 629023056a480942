"""Decode latency, one model shape: the unmodified model vs asyncmoe, eager and in a hand-captured CUDA graph.

    python benchmarks/decode_step.py --shape olmoe --caches 64 16 32 --out results.json

Random weights (real shapes). The routers are widened (std 1) so tokens spread over experts as trained
routers do; random routing still says nothing about policies, only about the machinery's cost.
Each case: prefill 16 tokens eagerly into a StaticCache, then `--rounds` rounds of `--steps` greedy
decode steps; the reported figure is the median over rounds of ms per token.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import transformers

import asyncmoe

SHAPES = {
    # OLMoE-1B-7B: 16 layers, 64 experts top-8, hidden 2048, expert intermediate 1024
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
    )),
}


def build(shape: str, dtype=torch.bfloat16, layers: int | None = None):
    config_cls, model_cls, kw = SHAPES[shape]
    config = getattr(transformers, config_cls)(**{**kw, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_cls)(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 1.0)
    return model


class Decode:
    """Greedy decoding with a static KV cache; `step()` is eager, `graph()` captures one step."""

    def __init__(self, model, batch: int = 1, prompt: int = 16, max_len: int = 512):
        self.model = model
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
        self.prompt = prompt
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=self.cache, cache_position=torch.arange(prompt, device="cuda")).logits
        self.first = logits[:, -1:].argmax(-1)
        self.tok = self.first.clone()
        self.pos = torch.full((1,), prompt, dtype=torch.long, device="cuda")

    @torch.no_grad()
    def step(self):
        logits = self.model(input_ids=self.tok, past_key_values=self.cache, cache_position=self.pos).logits
        self.tok.copy_(logits[:, -1:].argmax(-1))
        self.pos.add_(1)

    def reset(self):
        self.tok.copy_(self.first)
        self.pos.fill_(self.prompt)

    def graph(self) -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.reset()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.step()
        return g


def ms_per_token(run_step, reset, steps: int, rounds: int) -> tuple[float, list[float]]:
    per_round = []
    for _ in range(rounds):
        reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        per_round.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(per_round), per_round


def measure(model, label: str, steps: int, rounds: int, graph: bool) -> dict:
    d = Decode(model)
    if graph:
        g = d.graph()
        run = g.replay
    else:
        d.step()  # warm-up
        run = d.step
    try:
        asyncmoe.stats(model, reset=True)
    except ValueError:  # the unmodified model
        pass
    med, all_rounds = ms_per_token(run, d.reset, steps, rounds)
    row = {"system": label, "graph": graph, "ms_per_token": med, "rounds": all_rounds}
    try:
        s = asyncmoe.stats(model)
        if s.layers:
            row.update(hit_rate=s.totals["hit_rate"], bytes_per_token=s.totals["bytes_h2d"] / (steps * rounds))
    except ValueError:
        pass
    print(f"{label:<34} {'graph' if graph else 'eager':<6} {med:8.3f} ms/token  (rounds: {', '.join(f'{x:.3f}' for x in all_rounds)})", flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    p.add_argument("--caches", type=int, nargs="+", default=[64, 32, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    base = build(args.shape)
    rows = [measure(base, "unmodified", args.steps, args.rounds, graph=g) for g in (False, True)]
    for cache in args.caches:
        model = asyncmoe.compile(copy.deepcopy(base), cache=cache)
        for g in (False, True):
            rows.append(measure(model, f"asyncmoe cache={cache}", args.steps, args.rounds, graph=g))
        del model
        torch.cuda.empty_cache()
    result = {
        "shape": args.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "transformers": transformers.__version__, "steps": args.steps, "rounds": args.rounds, "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
