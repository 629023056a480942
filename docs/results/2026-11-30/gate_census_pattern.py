"""gate_census.py under decode_step.py's pattern: 5 rounds of (prefill 16 tokens, decode 64), one Decoder, OLMoE widths.

    cd <prefetch-switch checkout> && PYTHONPATH=. python gate_census_pattern.py 4   # MoE layers
"""
import sys
import torch
sys.path.insert(0, "benchmarks")
import shapes
import asyncmoe
layers = int(sys.argv[1])
shapes.SHAPES["census"] = ("OlmoeConfig", dict(shapes.SHAPES["olmoe-1b-7b"][1], num_hidden_layers=layers))
model = asyncmoe.compile(shapes.random_model("census", torch.bfloat16, "cpu"), cache=32)
dec = asyncmoe.Decoder(model, max_length=16 + 64 + 1)
chosen = []
choose = dec._prefetch_now
dec._prefetch_now = lambda: chosen.append(choose()) or chosen[-1]
prompt = torch.randint(1, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
for r in range(5):
    dec.prefill(prompt)
    dec.decode(64)
    print(f"round {r}: steps with prefetch {sum(chosen[-64:])} of 64", flush=True)
