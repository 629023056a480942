"""Routing traces for the tests: random skewed routing, and the embedded model's held-out routing."""

from __future__ import annotations

import pathlib

import numpy as np

from asyncmoe.trace import Trace


def random_trace(seed, N=120, L=3, E=12, k=2, skew=1.3) -> Trace:
    """N tokens of L layers, each routed to k distinct of E experts, skewed towards low ids like real routers."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, E + 1) ** skew
    ids = np.stack(
        [
            np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(L)])
            for _ in range(N)
        ]
    )
    return Trace(ids, E)


def demo_trace(tokens: int) -> Trace:
    """The embedded model's first `tokens` held-out tokens of routing, with what its gate predicted."""
    demo = Trace.load(pathlib.Path(__file__).parents[1] / "benchmarks" / "traces" / "demo_val.npz")
    return Trace(
        demo.ids[:tokens],
        demo.num_experts,
        gate_ids=demo.gate_ids[:tokens],
        gate_probs=demo.gate_probs[:tokens],
    )
