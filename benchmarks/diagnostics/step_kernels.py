"""What the cache itself costs a graph decode step where nearly every expert is resident: the resident model against
the cached one without and with prefetch, kernel by kernel, and one layer's kernels side by side.

    python benchmarks/diagnostics/step_kernels.py --shape olmoe-1b-7b --cache 60 --out kernels.json

Each case is its own copy of one random-weight bf16 model, routed by the latency suite's trace, in the Decoder's
CUDA graph. ms/token: CUDA events around `--steps` steps, median of 4 rounds. Then one profiled round: GPU time per
kernel name per token, and where the prefetch case's layer differs from the no-prefetch one's. A layer is taken from
one `ensure` decision to the next (the `_cache_step` followed by the layer's GEMV); its kernels are aligned by name,
and the table lists the kernels only the prefetch case runs and the shared ones whose start or length moved.
`--out` keeps the per-kernel tables and one step's events of each case.
"""

from __future__ import annotations

import argparse
import collections
import copy
import difflib
import json
import pathlib
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import asyncmoe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import gpu_events, prompt, trace_for
from shapes import random_model, routing_shape

CASES = {
    "resident": dict(resident=True, prefetch=False),
    "cached": dict(prefetch=False),
    "cached+prefetch": {},
}


def measure(model, ids: torch.Tensor, steps: int) -> dict:
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=ids.shape[1] + 8 + steps * 6, graph=True)
    dec.prefill(ids)
    dec.decode(8)  # capture and warm up
    times = []
    for _ in range(4):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        dec.decode(steps)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(steps)
        torch.cuda.synchronize()
    events = [e for e in gpu_events(prof) if e["cat"] == "kernel"]
    per_kernel = collections.defaultdict(float)
    for e in events:
        per_kernel[e["name"][:70]] += (e["end"] - e["start"]) / steps
    middle = events[0]["start"] + (events[-1]["end"] - events[0]["start"]) / 2
    return {
        "ms": statistics.median(times),
        "rounds": times,
        "per_kernel_us": sorted(per_kernel.items(), key=lambda kv: -kv[1]),
        "events": [e for e in events if e["start"] >= middle][
            : len(events) // steps
        ],  # about one step
    }


def layer(events: list[dict], which: int = 3) -> list[dict]:
    """The kernels of one layer: from an `ensure` decision (a `_cache_step` whose next GEMV follows within 12 us)
    to the next."""
    starts = []
    for e in events:
        if e["name"].startswith("_cache_step"):
            gemv = next((x for x in events if x["start"] > e["end"] and "gemv" in x["name"]), None)
            if gemv is not None and gemv["start"] - e["end"] < 12:
                starts.append(e["start"])
    a, b = starts[which], starts[which + 1]
    return [e for e in events if a <= e["start"] < b]


def compare_layers(base: list[dict], other: list[dict]) -> list[str]:
    """`other`'s layer against `base`'s: the kernels only `other` runs, and the shared kernels that waited or ran
    more than 1 us longer there (the wait: from the previous shared kernel's end to this one's start)."""
    names = [e["name"][:40] for e in base], [e["name"][:40] for e in other]
    lines = [
        f"layer: {base[-1]['end'] - base[0]['start']:.1f} -> {other[-1]['end'] - other[0]['start']:.1f} us"
    ]
    before = None  # the previous shared pair
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
        a=names[0], b=names[1], autojunk=False
    ).get_opcodes():
        if tag != "equal":
            start = other[0]["start"]
            lines += [f"  only here  {b['name'][:48]:<48} at {b['start'] - start:6.1f}  {b['end'] - b['start']:5.1f} us"
                      for b in other[j1:j2]]  # fmt: skip
            continue
        for a, b in zip(base[i1:i2], other[j1:j2]):
            if before is not None:
                waited = (b["start"] - before[1]["end"]) - (a["start"] - before[0]["end"])
                longer = (b["end"] - b["start"]) - (a["end"] - a["start"])
                if waited > 1.0 or longer > 1.0:
                    lines.append(
                        f"  shared     {a['name'][:48]:<48} waited {waited:+5.1f}  ran {longer:+5.1f} us"
                    )
            before = (a, b)
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b")
    p.add_argument("--cache", type=int, default=60)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = random_model(args.shape, torch.bfloat16, "cuda")
    ids = prompt(args.shape, 1, seed=0)
    print(
        f"{torch.cuda.get_device_name()}: {args.shape}, {args.cache} slots, trace routing, ms/token"
    )
    results = {}
    for name, kw in CASES.items():
        cache = routing_shape(args.shape)[0] if kw.get("resident") else args.cache
        model = asyncmoe.compile(
            copy.deepcopy(base),
            cache=cache,
            prefetch=kw.get("prefetch"),
            replay=trace_for(args.shape, "trace"),
        )
        r = results[name] = measure(model, ids, args.steps)
        print(
            f"{name:<16} {r['ms']:.3f}  (rounds {', '.join(f'{t:.3f}' for t in r['rounds'])})",
            flush=True,
        )
        for kernel, us in r["per_kernel_us"][: args.top]:
            print(f"    {us:7.1f} us/token  {kernel}")
        del model
        torch.cuda.empty_cache()
    print(
        "\n".join(
            compare_layers(
                layer(results["cached"]["events"]), layer(results["cached+prefetch"]["events"])
            )
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "shape": args.shape,
                    "cache": args.cache,
                    **results,
                },
                f,
            )


if __name__ == "__main__":
    main()
