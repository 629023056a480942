"""How close eviction scores come to Belady's misses on a routing trace (one layer at a time).

    python scripts/eviction_study.py                                  # the embedded model's held-out trace
    python scripts/eviction_study.py --trace run.npz --cache 16 --tokens 2000
    python scripts/eviction_study.py --synthetic 128 8 --cache 16 32  # benchmarks/synthetic.py's generator

Scores that see only the past: freq / (1 + age) ** p with freq decayed by `decay` each call (LFRU is decay
15/16, p 1; LFU p 0; a pure recency order p large); a reuse-distance score that keeps the expert whose next use,
last use + a running mean of its gaps, comes soonest; and a transition score, learned online, that keeps the
experts the current token's experts were most often followed by in the next token (LFRU breaks its ties).
Scores that see the future: the next token's experts in the layer, exactly (LFRU among the rest), the bound for
any predictor of the next call; and the next `w` tokens' experts, Belady's rule within them (how far ahead a
policy must see to come near Belady). `--admit A`: each score also with bypass, a miss not cached when its score
is below 1/A of the expert it would evict, beside Belady's bound when misses may bypass. Misses against
Belady's, summed over layers, before prefetch.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from asyncmoe.trace import Trace
from asyncmoe.trace.simulate import belady_misses, next_uses

DEMO = pathlib.Path(__file__).parents[1] / "benchmarks" / "traces" / "demo_val.npz"


class History:
    """Per-expert last use, decayed frequency and mean reuse gap; `keep` is the frequency-recency score."""

    def __init__(self, ids: np.ndarray, num_experts: int, decay: float = 15 / 16, p: float = 1.0):
        self.ids, self.decay, self.p = ids, decay, p
        self.last, self.freq = np.full(num_experts, -1.0), np.zeros(num_experts)
        self.gap = np.full(num_experts, float(len(ids)))

    def before(self, t: int, need: set[int]) -> None:
        pass

    def after(self, t: int, need: set[int]) -> None:
        for e in need:
            if self.last[e] >= 0:
                self.gap[e] += 0.1 * (t - self.last[e] - self.gap[e])
            self.last[e] = t
        self.freq *= self.decay
        for e in need:
            self.freq[e] += 1

    def keep(self, x: int, t: int) -> float:
        return self.freq[x] / (1 + t - self.last[x]) ** self.p


class ReuseDistance(History):
    def keep(self, x, t):
        return -(self.last[x] + self.gap[x])


class LookaheadKnown(History):
    """The next `window` tokens known exactly: keep the expert used soonest within them (Belady's rule inside the
    window), LFRU among the rest. window=1: the next token known; a window as long as the trace is Belady."""

    def __init__(self, ids, num_experts, window: int = 1):
        super().__init__(ids, num_experts)
        self.window = window
        self.next_use = np.full(
            (len(ids) + 1, num_experts), np.iinfo(np.int64).max
        )  # [t, e]: first use after t
        for t in range(len(ids) - 1, -1, -1):
            self.next_use[t] = self.next_use[t + 1]
            self.next_use[t, ids[t]] = t
        self.next_use = self.next_use[1:]  # [t]: first use at t + 1 or later

    def keep(self, x, t):
        ahead = self.next_use[t, x] - t  # >= 1
        return (ahead <= self.window) * 1e9 * (self.window + 1 - ahead) + super().keep(x, t)


class Transition(History):
    """counts[a, b]: how often b followed a in the next token, decayed by `forget` a call."""

    def __init__(self, ids, num_experts, forget: float = 0.99, weight: float = 10.0):
        super().__init__(ids, num_experts)
        self.counts, self.forget, self.weight = np.zeros((num_experts, num_experts)), forget, weight
        self.previous: list[int] = []
        self.likely = np.zeros(num_experts)

    def before(self, t, need):
        rows = self.counts[sorted(need)]
        self.likely = (
            rows.sum(0) / max(rows.sum(), 1e-9) * len(need)
        )  # expected uses in the next token

    def after(self, t, need):
        self.counts *= self.forget
        for a in self.previous:
            self.counts[a, sorted(need)] += 1
        self.previous = sorted(need)
        super().after(t, need)

    def keep(self, x, t):
        lfru = super().keep(x, t)
        return self.weight * self.likely[x] + lfru / (1 + lfru)


def misses(ids: np.ndarray, cache: int, score: History, admit: float | None = None) -> int:
    """Misses of a `cache`-slot cache on one layer's `ids` [N, k], evicting the lowest `score.keep`. With `admit`,
    a miss whose score times `admit` is below the one it would evict is served from host memory and not cached
    (a bypass: the same bytes cross the link, nothing is evicted)."""
    resident: set[int] = set()
    count = 0
    for t, row in enumerate(ids):
        need = set(row.tolist())
        score.before(t, need)
        for e in need - resident:
            count += 1
            if len(resident) >= cache:
                victim = min(resident - need, key=lambda x: score.keep(x, t))
                if admit is not None and admit * score.keep(e, t) < score.keep(victim, t):
                    continue
                resident.discard(victim)
            resident.add(e)
        score.after(t, need)
    return count


def belady_bypass_misses(ids: np.ndarray, cache: int) -> int:
    """Belady's misses when a miss may bypass the cache: after each row keep the `cache` experts, used by it or
    not, used soonest again (a bound for caches that can compute an expert from host memory)."""
    rows, next_use = next_uses(ids)
    resident: dict[int, float] = {}
    count = 0
    for t, need in enumerate(rows):
        count += sum(e not in resident for e in need)
        resident.update((e, next_use[t][e]) for e in need)
        resident = dict(sorted(resident.items(), key=lambda item: item[1])[:cache])
    return count


SCORES = {
    **{
        f"decay {d:g}, p {q:g}": lambda ids, E, d=d, q=q: History(ids, E, d, q)
        for d in (15 / 16, 0.98, 0.995, 1.0)
        for q in (0, 0.5, 1, 2)
    },
    "reuse distance": ReuseDistance,
    "transition, forget 0.99": Transition,
    "transition, forget 0.95": lambda ids, E: Transition(ids, E, forget=0.95),
    "next token known (a bound, not a policy)": LookaheadKnown,
    **{
        f"next {w} tokens known": lambda ids, E, w=w: LookaheadKnown(ids, E, w)
        for w in (2, 4, 8, 16, 64)
    },
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEMO))
    p.add_argument(
        "--synthetic", type=int, nargs=2, metavar=("EXPERTS", "TOP_K"), help="6 layers, seed 0"
    )
    p.add_argument("--cache", type=int, nargs="+", default=[16])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument(
        "--scores", nargs="+", default=None, help="names of SCORES to run (default: all)"
    )
    p.add_argument(
        "--admit", type=float, nargs="+", default=[], help="also run each score with these bypasses"
    )
    args = p.parse_args()
    if args.synthetic:
        sys.path.insert(0, str(DEMO.parents[1]))
        from synthetic import synthetic

        trace, source = (
            synthetic(*args.synthetic, layers=6, tokens=args.tokens),
            f"synthetic {args.synthetic}",
        )
    else:
        trace, source = Trace.load(args.trace), args.trace
    ids = trace.ids[: args.tokens]
    names = args.scores or list(SCORES)
    print(
        f"{source}: {len(ids)} tokens, {trace.layers} layers, {trace.num_experts} experts, top-{trace.top_k}"
    )
    print("| score | " + " | ".join(f"{c} slots" for c in args.cache) + " |")
    print("|---" * (len(args.cache) + 1) + "|")
    belady = {c: sum(belady_misses(ids[:, l], c) for l in range(trace.layers)) for c in args.cache}
    for name, admit in [(n, a) for n in names for a in [None, *args.admit]]:
        ratios = []
        for c in args.cache:
            total = sum(
                misses(ids[:, l], c, SCORES[name](ids[:, l], trace.num_experts), admit)
                for l in range(trace.layers)
            )
            ratios.append(f"{total / belady[c]:.3f}")
        label = name if admit is None else f"{name}, bypass below {admit:g}x the victim"
        print(f"| {label} | " + " | ".join(ratios) + " |", flush=True)
    if args.admit:
        bound = [
            sum(belady_bypass_misses(ids[:, l], c) for l in range(trace.layers)) / belady[c]
            for c in args.cache
        ]
        print("| Belady with bypass (a bound) | " + " | ".join(f"{r:.3f}" for r in bound) + " |")


if __name__ == "__main__":
    main()
