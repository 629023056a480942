"""The oracle and noisy gate arrays (oracle.py): right where asked, wrong among the experts not routed."""

import numpy as np
import pytest

from asyncmoe.trace.simulate import simulate

from oracle import oracle, parse
from synthetic import synthetic


@pytest.mark.parametrize("q", [1.0, 0.9, 0.7])
def test_nominations_are_right_with_probability_q(q):
    trace = synthetic(32, 4, layers=3, tokens=3000)
    got = oracle(trace, q, seed=1)
    assert np.array_equal(got.ids, trace.ids) and (got.gate_ids[:, 0] == -1).all()
    gate, ids = got.gate_ids[:, 1:], trace.ids[:, 1:]
    right = (gate[..., :, None] == ids[..., None, :]).any(-1)  # [N, L-1, k]
    assert abs(right.mean() - q) < 0.02
    assert all(
        len(set(row)) == 4 for row in gate.reshape(-1, 4)
    )  # distinct nominations per token and layer
    assert np.array_equal(
        gate[right], ids[right]
    )  # a right nomination is the routed expert in its place


def test_the_oracle_gate_prefetches_more_than_a_noisy_one():
    trace = synthetic(32, 4, layers=3, tokens=300)  # recalls 0.29 and 0.04, as at 1500 tokens
    recall = {
        q: simulate(oracle(trace, q), 8, prefetch=("gate",), budget=4, compiled=False).totals[
            "prefetch_recall"
        ]
        for q in (1.0, 0.7)
    }
    assert recall[1.0] > recall[0.7] > 0


def test_bad_input():
    trace = synthetic(8, 2, layers=2, tokens=10)
    with pytest.raises(
        ValueError, match=r"q=1.5: the share of right nominations must be in \[0, 1\]"
    ):
        oracle(trace, 1.5)
    assert parse("oracle") == 1.0 and parse("oracle-q0.8") == 0.8 and parse("trace") is None
