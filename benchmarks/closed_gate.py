"""Where a closed prefetch gate's cost goes: by default OLMoE-1B-7B routed by its random router (nothing predicts it,
so every layer's gate closes), 16 of 64 slots, batch-1 graph decode, bf16 and fp8 experts; `--shape` and
`--replay` (a latency suite routing: trace, oracle, oracle-q0.7) choose another case. Models in one process,
their rounds interleaved and compared as paired ratios to the first:

    none              no prefetch
    prefetch          the default: the step captured without prefetch replays while every gate is closed
    every step        prefetch in every step, the gates not read (the Decoder's `Gates` emptied)
    no gate scoring   every step, with the gate's router matmul and scoring taken out (nothing nominated)
    forks only        that, and the decision and its copy taken out: only the side streams' forks and joins

The last two replace package functions while their graph is captured (`patched`), so they measure the package
as it is, less that work.

    python benchmarks/closed_gate.py --out closed_gate.json     # CUDA
    python benchmarks/closed_gate.py --variants none prefetch "every step" --shape deepseek-v2-lite --replay oracle-q0.7
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json

import torch

import asyncmoe
import asyncmoe.ops as ops
from asyncmoe.cache import algorithm
from asyncmoe.predict import predictors

from decode_step import h2d_bandwidth, interleaved
from shapes import SHAPES, random_model

VARIANTS = {  # name: (prefetch, whether the Decoder reads the gates, what `patched` takes out)
    "none": (False, True, {}),
    "prefetch": (True, True, {}),
    "every step": (True, False, {}),
    "no gate scoring": (True, False, {"no_gate": True}),
    "forks only": (True, False, {"no_gate": True, "no_plan": True}),
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
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="the first: the base")
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument(
        "--replay", default=None, help="a latency suite routing (trace, oracle, oracle-q0.7); default: the router"
    )
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    replay = None
    if args.replay:
        from test_latency import trace_for  # imports decode_step: not at the top

        replay = trace_for(args.shape, args.replay)
    results = {"gpu": torch.cuda.get_device_name(), "engine_GB_per_s": h2d_bandwidth(), "case": vars(args)}
    for key in args.formats:
        fmt = None if key == "bf16" else key
        base = random_model(args.shape, torch.bfloat16, "cuda")
        prompt = torch.randint(1, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
        decoders = {}
        for name in args.variants:
            prefetch, gates, takes_out = VARIANTS[name]
            with patched(**takes_out):  # the graphs are captured in the first prefill
                model = asyncmoe.compile(copy.deepcopy(base), cache=16, quantize=fmt, prefetch=prefetch, replay=replay)
                dec = asyncmoe.Decoder(model, batch_size=1, max_length=16 + args.steps + 9, graph=True)
                if not gates:
                    dec.gates.flags = []
                dec.prefill(prompt)
                dec.decode(8)
            decoders[name] = (model, dec)
        base_name = args.variants[0]
        results[key] = interleaved(decoders, prompt, args.rounds, args.steps)
        for name, row in results[key].items():
            print(
                f"{key:5} {name:16} {row['ms']:7.3f} ms/token  x {base_name} (paired) {row['paired_ratio']:.4f}  "
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
