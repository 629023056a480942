"""Synthetic routing traces whose statistics are stated, for shapes the embedded model's trace does not fit.

Per layer, independently (no cross-layer correlation: gate and transition predictors find nothing here):
  popularity  expert of popularity rank r (a random order per layer) is drawn with weight (r + 1) ** -skew
  reuse       each of the previous token's experts is kept with probability `keep`; the rest of the
              token's k experts are drawn by popularity, without repeats
Defaults match the embedded model's held-out routing (docs/routing.md): 35.7% of a token's experts
reused from the previous token, the busiest quarter of the experts taking 51.7% of the pairs;
`stats` measures both on any trace.
"""

from __future__ import annotations

import numpy as np

from asyncmoe.trace import Trace

KEEP, SKEW = 0.215, 0.70  # fitted to reuse 35.7%, top-quarter share 51.7% at E=64, k=8 (test_synthetic.py)


def synthetic(num_experts: int, k: int, layers: int, tokens: int, keep: float = KEEP, skew: float = SKEW, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, layers, k), dtype=np.int64)
    weight = (np.arange(num_experts) + 1.0) ** -skew
    for l in range(layers):
        p = np.empty(num_experts)
        p[rng.permutation(num_experts)] = weight / weight.sum()
        previous: list[int] = []
        for t in range(tokens):
            chosen = [e for e in previous if rng.random() < keep]
            rest = np.delete(np.arange(num_experts), chosen)
            q = p[rest] / p[rest].sum()
            chosen += rng.choice(rest, size=k - len(chosen), replace=False, p=q).tolist()
            ids[t, l] = chosen
            previous = chosen
    return Trace(ids, num_experts)


def stats(trace: Trace) -> dict:
    """Reuse of the previous token's experts and the busiest quarter's share, averaged over layers."""
    ids = np.asarray(trace.ids)
    reuse = np.mean([(ids[1:, l, :, None] == ids[:-1, l, None, :]).any(-1).mean() for l in range(trace.layers)])
    share = []
    for l in range(trace.layers):
        load = np.sort(np.bincount(ids[:, l].ravel(), minlength=trace.num_experts))[::-1]
        share.append(load[: trace.num_experts // 4].sum() / load.sum())
    return dict(reuse=float(reuse), top_quarter_share=float(np.mean(share)))
