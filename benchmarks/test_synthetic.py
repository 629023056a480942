"""The synthetic traces have the statistics they claim: those of the embedded model's held-out routing."""

import numpy as np
import pytest

from asyncmoe.trace import Trace
from synthetic import stats, synthetic
from test_latency import DEMO_TRACE


def test_synthetic_trace_matches_the_embedded_models_reuse_and_skew():
    want = stats(Trace.load(DEMO_TRACE))
    got = stats(synthetic(64, 8, layers=4, tokens=4000, seed=1))
    assert got["reuse"] == pytest.approx(want["reuse"], abs=0.02)
    assert got["top_quarter_share"] == pytest.approx(want["top_quarter_share"], abs=0.02)


def test_synthetic_trace_is_a_valid_trace():
    t = synthetic(128, 8, layers=3, tokens=200)
    assert t.ids.shape == (200, 3, 8) and t.num_experts == 128
    assert all(len(set(row)) == 8 for row in t.ids.reshape(-1, 8).tolist())  # k distinct experts per token
    assert np.asarray(t.ids).min() >= 0 and np.asarray(t.ids).max() < 128
