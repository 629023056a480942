"""The suite's synthetic traces with and without the cross-layer lift, on the CPU.

    python benchmarks/diagnostics/synthetic_before_after.py

Per shape (trace_for: 6 layers, 4096 tokens, seed 0) and cache: the statistics `synthetic.stats` states, the hit
rates of asyncmoe's cache (lfru, the default) and of the seed's (lru), what the transition predictor alone
prefetches, and the Belady floor in misses per layer and decode step at batches 1, 8 and 32 (as the suite's
`belady_misses_per_step`); then the Belady floor at batch 1 over seeds 0-2, the seed-to-seed spread.
"""

import pathlib
import sys

from asyncmoe.trace.simulate import simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import belady_misses_per_step as belady_per_step
from synthetic import stats, synthetic

BEFORE = dict(keep=0.215, skew=0.70, follow=0.0)  # independent layers: no cross-layer lift


print(
    "| experts, top-k | trace | reuse | top-quarter share | cross-layer lift |\n|---|---|---|---|---|"
)
traces = {}
for E, k in ((128, 8), (8, 2)):
    for name, kw in (("before", BEFORE), ("after", {})):
        traces[E, name] = synthetic(E, k, layers=6, tokens=4096, **kw)
        s = stats(traces[E, name])
        print(
            f"| {E}, {k} | {name} | {s['reuse']:.1%} | {s['top_quarter_share']:.1%} | {s['cross_layer_lift']:.3f} |"
        )

print(
    "\n| experts | cache | trace | lfru hits | lru hits | transition alone: prefetched / token, recall | "
    "Belady misses / layer / step, batch 1, 8, 32 |\n|---|---|---|---|---|---|---|"
)
for E, caches in ((128, (16, 32, 64)), (8, (2, 4))):
    for cache in caches:
        for name in ("before", "after"):
            t = traces[E, name]
            lfru, lru = (simulate(t, cache, p).totals["hit_rate"] for p in ("lfru", "lru"))
            tr = simulate(t, cache, "lfru", prefetch=("transition",)).totals
            floors = ", ".join(f"{belady_per_step(t, b, cache):.3f}" for b in (1, 8, 32))
            print(
                f"| {E} | {cache} | {name} | {lfru:.1%} | {lru:.1%} | {tr['prefetched_per_token']:.3f}, "
                f"{tr['prefetch_recall']:.2%} | {floors} |",
                flush=True,
            )

print(
    "\n| experts | trace | seed | Belady misses / layer / token at caches 16, 32, 64 |\n|---|---|---|---|"
)
for name, kw in (("before", BEFORE), ("after", {})):
    for seed in (0, 1, 2):
        t = synthetic(128, 8, layers=6, tokens=4096, seed=seed, **kw)
        print(
            f"| 128 | {name} | {seed} | {', '.join(f'{belady_per_step(t, 1, c):.3f}' for c in (16, 32, 64))} |"
        )
