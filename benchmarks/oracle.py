"""Gate arrays that predict a trace's routing as well as asked: overlap measured apart from prediction.

`oracle(trace, q)` keeps the trace's routing and replaces what its gate predictor nominated: for every token
and layer but the first, the layer's own routed experts (the oracle, `q=1`), each replaced with probability
1 - q by a random expert the token does not route to there (`q=0.9, 0.8, 0.7`), their probabilities the
router's weights where the trace has them (else 1/k). Replayed (`compile(..., replay=...)`), the gate
predictor then nominates exactly that: with the oracle, every miss prefetch could avoid is predicted, so the
step shows what the copies and their overlap alone cost; the noisy ones show what wrong prefetches cost.
The latency suite routes by them as `oracle` and `oracle-q0.9` (docs/traces.md).
"""

from __future__ import annotations

import numpy as np

from asyncmoe.trace import Trace


def oracle(trace: Trace, q: float = 1.0, seed: int = 0) -> Trace:
    """`trace` with gate arrays [N, L, k] that nominate each layer's routed experts, each kept with probability
    `q` and otherwise replaced by a distinct expert the token does not route to in that layer."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q}: the share of right nominations must be in [0, 1]")
    rng = np.random.default_rng(seed)
    ids = np.asarray(trace.ids)
    N, L, k = ids.shape
    E = trace.num_experts
    if k >= E and q < 1:
        raise ValueError(
            f"every token routes to all {E} experts: nothing is left to nominate wrongly"
        )
    gate = ids.copy()
    wrong = rng.random((N, L, k)) >= q
    for t, l in zip(
        *np.nonzero(wrong.any(axis=2))
    ):  # draw the replacements among the experts not routed
        free = np.setdiff1d(np.arange(E), ids[t, l])
        picks = rng.choice(free, size=int(wrong[t, l].sum()), replace=False)
        gate[t, l, wrong[t, l]] = picks
    probs = (
        np.asarray(trace.weights, dtype=np.float32)
        if trace.weights is not None
        else np.full((N, L, k), 1 / k)
    )
    gate[:, 0], probs = -1, probs.copy()
    probs[:, 0] = 0.0  # nothing before the first MoE layer predicts it
    return Trace(
        ids,
        E,
        starts=trace.starts,
        weights=trace.weights,
        gate_ids=gate,
        gate_probs=probs,
        expert_bytes=trace.expert_bytes,
    )


def parse(routing: str) -> float | None:
    """A latency-suite routing name -> the share of right nominations: `oracle` 1.0, `oracle-q0.8` 0.8; else None."""
    if routing == "oracle":
        return 1.0
    if routing.startswith("oracle-q"):
        return float(routing.removeprefix("oracle-q"))
    return None
