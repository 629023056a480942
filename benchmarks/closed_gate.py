"""Where a closed prefetch gate's cost goes: OLMoE-1B-7B routed by its random router (nothing predicts it, so every
layer's gate closes), 16 of 64 slots, batch-1 graph decode, bf16 and fp8 experts. Four models in one process,
their rounds interleaved and compared as paired ratios to the first:

    none              no prefetch
    prefetch          the default
    no gate scoring   prefetch with the gate's router matmul and scoring taken out (nothing nominated)
    forks only        that, and the decision and its copy taken out: only the side streams' forks and joins

The variants replace package functions while their graph is captured (`patched`), so they measure the package
as it is, less that work.

    python benchmarks/closed_gate.py --out closed_gate.json     # CUDA
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics

import torch

import asyncmoe
import asyncmoe.ops as ops
from asyncmoe.cache import algorithm
from asyncmoe.predict import predictors

from decode_step import h2d_bandwidth
from shapes import random_model

VARIANTS = {  # name: (prefetch, what `patched` takes out)
    "none": (False, {}),
    "prefetch": (True, {}),
    "no gate scoring": (True, {"no_gate": True}),
    "forks only": (True, {"no_gate": True, "no_plan": True}),
}


@contextlib.contextmanager
def patched(no_gate: bool = False, no_plan: bool = False):
    """Take the gate's scoring (`no_gate`) and the prefetch's decision and copy (`no_plan`) out of what runs."""
    gate, plan, copy_in = predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in
    if no_gate:
        predictors.gate_scores = lambda *a, **k: None
    if no_plan:
        ops.predict_and_plan = lambda *a, **k: ()
        algorithm.copy_in = lambda hosts, slots, copies, programs=None: (
            None if copies == () else copy_in(hosts, slots, copies, programs)
        )
    try:
        yield
    finally:
        predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in = gate, plan, copy_in


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "engine_GB_per_s": h2d_bandwidth()}
    for fmt in [None, "fp8"]:
        base = random_model("olmoe-1b-7b", torch.bfloat16, "cuda")
        prompt = torch.randint(1, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
        decoders = {}
        for name, (prefetch, takes_out) in VARIANTS.items():
            with patched(**takes_out):  # the graph is captured in the first decode
                model = asyncmoe.compile(copy.deepcopy(base), cache=16, quantize=fmt, prefetch=prefetch)
                dec = asyncmoe.Decoder(model, batch_size=1, max_length=16 + args.steps + 9, graph=True)
                dec.prefill(prompt)
                dec.decode(8)
            decoders[name] = (model, dec)
        times, moved = {n: [] for n in decoders}, dict.fromkeys(decoders, 0)
        for _ in range(args.rounds):
            for name, (model, dec) in decoders.items():
                dec.prefill(prompt)
                asyncmoe.stats(model, reset=True)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                dec.decode(args.steps)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.steps)
                moved[name] += asyncmoe.stats(model).totals["bytes_h2d"]
        key = fmt or "bf16"
        results[key] = {}
        for name in decoders:
            row = {
                "ms": statistics.median(times[name]),
                "paired_ratio": statistics.median(t / u for t, u in zip(times[name], times["none"], strict=True)),
                "MB_per_token": moved[name] / args.rounds / args.steps / 1e6,
                "rounds": times[name],
            }
            results[key][name] = row
            print(
                f"{key:5} {name:16} {row['ms']:7.3f} ms/token  x none (paired) {row['paired_ratio']:.4f}  "
                f"{row['MB_per_token']:6.1f} MB/token",
                flush=True,
            )
        del decoders, base
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
