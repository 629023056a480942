"""Where a closed prefetch gate's cost goes, OLMoE-1B-7B random router (nothing predicts), 16/64, graph decode.
Variants in one process, rounds interleaved: none / prefetch / prefetch without the gate's scoring /
prefetch without scoring, decision and copy (only the side streams' forks and joins)."""
import contextlib, copy, gc, json, os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import asyncmoe
import asyncmoe.ops as ops
from asyncmoe.cache import algorithm
from asyncmoe.predict import predictors
from decode_step import h2d_bandwidth
from shapes import random_model

out = os.environ["OUT"]
STEPS, ROUNDS = 48, 15

@contextlib.contextmanager
def patched(no_gate=False, no_plan=False):
    g, p, c = predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in
    if no_gate:
        predictors.gate_scores = lambda *a, **k: None
    if no_plan:
        ops.predict_and_plan = lambda *a, **k: ()
        algorithm.copy_in = lambda h, s, cp, pr=None: None if cp == () else c(h, s, cp, pr)
    try:
        yield
    finally:
        predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in = g, p, c

results = {"engine_GB_per_s": h2d_bandwidth(), "gpu": torch.cuda.get_device_name()}
for fmt in [None, "fp8"]:
    base = random_model("olmoe-1b-7b", torch.bfloat16, "cuda")
    prompt = torch.randint(1, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    decs = {}
    for name, pf, patch in [("none", False, {}), ("prefetch", True, {}), ("no gate scoring", True, {"no_gate": True}),
                            ("forks only", True, {"no_gate": True, "no_plan": True})]:
        with patched(**patch):
            m = asyncmoe.compile(copy.deepcopy(base), cache=16, quantize=fmt, prefetch=pf)
            d = asyncmoe.Decoder(m, batch_size=1, max_length=16 + STEPS + 9, graph=True)
            d.prefill(prompt); d.decode(8)
        decs[name] = (m, d)
    times = {n: [] for n in decs}; moved = {n: 0 for n in decs}
    for r in range(ROUNDS):
        for n, (m, d) in decs.items():
            d.prefill(prompt)
            asyncmoe.stats(m, reset=True)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(); a.record(); d.decode(STEPS); b.record(); b.synchronize()
            times[n].append(a.elapsed_time(b) / STEPS)
            moved[n] += asyncmoe.stats(m).totals["bytes_h2d"]
    key = fmt or "bf16"
    results[key] = {}
    for n in decs:
        ratio = statistics.median(t / u for t, u in zip(times[n], times["none"]))
        results[key][n] = {"ms": statistics.median(times[n]), "paired_ratio": ratio,
                           "MB_per_token": moved[n] / ROUNDS / STEPS / 1e6, "rounds": times[n]}
        print(f"{key:5} {n:16} {statistics.median(times[n]):7.3f} ms/token  x none (paired) {ratio:.4f}  "
              f"{moved[n] / ROUNDS / STEPS / 1e6:6.1f} MB/token", flush=True)
    with open(f"{out}/closed.json", "w") as f:
        json.dump(results, f, indent=1)
    del decs, base; gc.collect(); torch.cuda.empty_cache()
