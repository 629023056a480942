"""fp8 experts at 16 of 64 slots: prefetch budget 1, 2, 3 against none, trace / oracle / q0.7 routing, one process."""
import copy, gc, json, os, sys, time
import torch
sys.path.insert(0, "benchmarks")
import asyncmoe
from decode_step import h2d_bandwidth, measure
from shapes import random_model
from test_latency import trace_for

out = os.environ["OUT"]
rows = []
bw = h2d_bandwidth()
print(f"engine {bw:.1f} GB/s", flush=True)
fmt = sys.argv[1] if len(sys.argv) > 1 else "fp8"
for shape in sys.argv[2:] or ["olmoe-1b-7b", "deepseek-v2-lite"]:
    base = random_model(shape, torch.bfloat16, "cuda")
    prompt = torch.randint(1, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    cases = [("trace", None)] + [(r, b) for r in ("trace", "oracle") for b in (1, 2, 3)] + [("oracle-q0.7", b) for b in (1, 2)]
    for routing, budget in cases:
        t0 = time.time()
        model = asyncmoe.compile(copy.deepcopy(base), cache=16, quantize=fmt,
                                 prefetch=asyncmoe.Prefetch(budget=budget) if budget else False,
                                 replay=trace_for(shape, routing))
        r = measure(model, f"{shape} {fmt} {routing} budget {budget}", True, 32, 5, prompt)
        r.update(shape=shape, routing=routing, budget=budget, engine=bw, wall=time.time() - t0)
        rows.append(r)
        with open(f"{out}/budget-{fmt}.json", "w") as f:
            json.dump(rows, f, indent=1)
        del model; gc.collect(); torch.cuda.empty_cache()
    del base; gc.collect(); torch.cuda.empty_cache()
