"""How close history-based eviction scores come to Belady's bytes on a routing trace (one layer at a time).

    python scripts/eviction_study.py                                  # the embedded model's held-out trace
    python scripts/eviction_study.py --trace run.npz --cache 16 --tokens 2000

Each score keeps the experts with the highest freq / (1 + age) ** p, freq decayed by `decay` each call (LFRU is
decay 15/16, p 1; LFU p 0; a pure recency order p large), plus a reuse-distance score that keeps the expert
whose next use, last use + a running mean of its gaps, comes soonest. Misses against Belady's, summed over
layers: what a policy in the runtime's integer form could reach at best, before prefetch.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from asyncmoe.trace import Trace
from asyncmoe.trace.simulate import belady_misses

DEMO = pathlib.Path(__file__).parents[1] / "benchmarks" / "traces" / "demo_val.npz"


def misses(ids: np.ndarray, cache: int, num_experts: int, keep) -> int:
    """Misses of a `cache`-slot cache on one layer's `ids` [N, k] evicting the lowest `keep(expert, t, state)`."""
    resident: set[int] = set()
    last, freq, gap = np.full(num_experts, -1.0), np.zeros(num_experts), np.full(num_experts, float(len(ids)))
    count = 0
    for t, row in enumerate(ids):
        need = set(row.tolist())
        for e in need - resident:
            count += 1
            if len(resident) >= cache:
                resident.discard(min(resident - need, key=lambda x: keep(x, t, last, freq, gap)))
            resident.add(e)
        for e in need:
            if last[e] >= 0:
                gap[e] += 0.1 * (t - last[e] - gap[e])
            last[e] = t
        keep.decay(freq)
        for e in need:
            freq[e] += 1
    return count


def frequency_recency(decay: float, p: float):
    def keep(x, t, last, freq, gap):
        return freq[x] / (1 + t - last[x]) ** p

    keep.decay = lambda freq: freq.__imul__(decay)
    return keep


def reuse_distance():
    def keep(x, t, last, freq, gap):
        return -(last[x] + gap[x])

    keep.decay = lambda freq: None
    return keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEMO))
    p.add_argument("--cache", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2000)
    args = p.parse_args()
    trace = Trace.load(args.trace)
    ids = trace.ids[: args.tokens]
    belady = sum(belady_misses(ids[:, l], args.cache) for l in range(trace.layers))
    scores = {
        f"decay {d:g}, p {q:g}": frequency_recency(d, q) for d in (15 / 16, 0.98, 0.995, 1.0) for q in (0, 0.5, 1, 2)
    }
    scores["reuse distance"] = reuse_distance()
    print(f"{args.trace}: {len(ids)} tokens, {trace.layers} layers, {trace.num_experts} experts, cache {args.cache}")
    print("| score | misses / Belady's |\n|---|---|")
    for name, keep in scores.items():
        total = sum(misses(ids[:, l], args.cache, trace.num_experts, keep) for l in range(trace.layers))
        print(f"| {name} | {total / belady:.3f} |")


if __name__ == "__main__":
    main()
