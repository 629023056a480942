"""How often the branch prefetch-switch's Decoder could skip the prefetch: a census of the prefetch gates.

    cd <prefetch-switch checkout> && PYTHONPATH=. python gate_census.py

An OLMoE-routing model (64 experts, top-8; hidden 64, or the OLMoE widths with fewer layers, to fit a CPU), random weights
with the routers widened as in benchmarks/shapes.py, cache 32, greedy decode. Per step: whether any of
the prefetch targets (every MoE layer but the first) has its gate open or explores (`prefetch_due(..., calls=1)`), and how many of the
Decoder's 16-step windows it ran with prefetch (its own choice, `Decoder._prefetch_now`).
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import shapes  # noqa: E402

import asyncmoe  # noqa: E402
from asyncmoe.cache.expert_cache import prefetch_due  # noqa: E402
from asyncmoe.integrations.transformers import find_experts  # noqa: E402

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
WIDE = len(sys.argv) > 2 and sys.argv[2] == "olmoe"  # the OLMoE-1B-7B widths (bf16), else hidden 64 (fp32)
config = dict(shapes.SHAPES["olmoe-1b-7b"][1], num_hidden_layers=LAYERS) if WIDE else dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=4, num_experts=64, num_experts_per_tok=8)
shapes.SHAPES["census"] = ("OlmoeConfig", config)
model = asyncmoe.compile(shapes.random_model("census", torch.bfloat16 if WIDE else torch.float32, "cpu"), cache=32)
targets = [m.asyncmoe.cache for _, m in find_experts(model)][1:]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 512
dec = asyncmoe.Decoder(model, max_length=16 + steps + 1)
chosen = []
choose = dec._prefetch_now
dec._prefetch_now = lambda: chosen.append(choose()) or chosen[-1]
dec.prefill(torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(0)))
due, open_layers = [], []
for _ in range(steps):
    outcomes, clock = torch.stack([c.outcomes for c in targets]), torch.cat([c.clock for c in targets])
    due.append(prefetch_due(outcomes, clock, 1))
    used, wasted = outcomes[:, 1], outcomes[:, 0]
    open_layers.append(int(((used + 1) >= 0.5 * (used + wasted + 2)).sum()))
    dec.decode(1)
print(f"steps: {steps}; a gate open or exploring (prefetch_due, 1 call): {sum(due)}; "
      f"mean open gates of {len(targets)}: {sum(open_layers) / steps:.2f}; "
      f"steps the Decoder ran with prefetch (16-step windows): {sum(chosen)}")
