"""Synthetic routing traces whose statistics are stated, for shapes the embedded model's trace does not fit.

Per token and layer, in this order, until the token has its k experts:
  reuse        each of the previous token's experts in this layer is kept with probability `keep`
  cross-layer  each of this token's experts in the layer before is followed with probability `follow` by its
               partner here, the expert of the same popularity rank (so following keeps the popularity)
  popularity   the rest are drawn without repeats, the expert of popularity rank r (a random order per layer)
               with weight (r + 1) ** -skew
The defaults match the embedded model's held-out routing (docs/routing.md): 35.7% of a token's experts reused
from the previous token, the busiest quarter of the experts taking 51.7% of the pairs, and a token's experts in
one layer predicting 10.6 points more of its experts in the next than popularity alone does; `stats` measures
all three on any trace. Without `follow` the layers are independent, and no predictor finds anything across them.
"""

from __future__ import annotations

import numpy as np

from asyncmoe.trace import Trace

KEEP, SKEW, FOLLOW = (
    0.115,
    0.735,
    0.845,
)  # fitted to the embedded model's routing at E=64, k=8 (test_synthetic.py)


def synthetic(
    num_experts: int,
    k: int,
    layers: int,
    tokens: int,
    keep: float = KEEP,
    skew: float = SKEW,
    follow: float = FOLLOW,
    seed: int = 0,
) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, layers, k), dtype=np.int64)
    weight = (np.arange(num_experts) + 1.0) ** -skew
    rank_before = None  # [E]: each expert's popularity rank in the layer before
    for layer in range(layers):
        expert_of_rank = rng.permutation(num_experts)
        p = np.empty(num_experts)
        p[expert_of_rank] = weight / weight.sum()
        previous: list[int] = []
        for t in range(tokens):
            chosen = [e for e in previous if rng.random() < keep]
            if rank_before is not None:
                partners = expert_of_rank[rank_before[ids[t, layer - 1]]]
                chosen += [e for e in partners if rng.random() < follow and e not in chosen][
                    : k - len(chosen)
                ]
            rest = np.delete(np.arange(num_experts), chosen)
            q = p[rest] / p[rest].sum()
            chosen += rng.choice(rest, size=k - len(chosen), replace=False, p=q).tolist()
            ids[t, layer] = chosen
            previous = chosen
        rank_before = np.argsort(expert_of_rank)
    return Trace(ids, num_experts)


def stats(trace: Trace) -> dict:
    """Reuse of the previous token's experts and the busiest quarter's share, averaged over layers, and the
    cross-layer lift, averaged over adjacent layers."""
    ids = np.asarray(trace.ids)
    reuse = np.mean(
        [
            (ids[1:, layer, :, None] == ids[:-1, layer, None, :]).any(-1).mean()
            for layer in range(trace.layers)
        ]
    )
    share = []
    for layer in range(trace.layers):
        load = np.sort(np.bincount(ids[:, layer].ravel(), minlength=trace.num_experts))[::-1]
        share.append(load[: trace.num_experts // 4].sum() / load.sum())
    lift = np.mean(
        [
            cross_layer_lift(ids[:, layer], ids[:, layer + 1], trace.num_experts)
            for layer in range(trace.layers - 1)
        ]
    )
    return dict(
        reuse=float(reuse), top_quarter_share=float(np.mean(share)), cross_layer_lift=float(lift)
    )


def cross_layer_lift(before: np.ndarray, after: np.ndarray, num_experts: int) -> float:
    """How much more of each token's experts `after` [N, k] its experts `before` [N, k] (the layer before)
    predict than popularity does: the share of them in the top k of the transition table P(after | before)
    summed over the token's experts before, less the share in the k most popular, both fitted on the trace
    itself. What the transition predictor could find (asyncmoe/prefetch); 0 for independent layers."""
    k = after.shape[1]
    counts = np.zeros((num_experts, num_experts))
    np.add.at(counts, (np.repeat(before, k, axis=1).ravel(), np.tile(after, (1, k)).ravel()), 1)
    transition = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    predicted = np.argpartition(-transition[before].sum(1), k - 1, axis=1)[:, :k]  # [N, k]
    popular = np.argsort(-np.bincount(after.ravel(), minlength=num_experts))[:k]
    return float(
        (predicted[:, :, None] == after[:, None, :]).any(-1).mean() - np.isin(after, popular).mean()
    )
