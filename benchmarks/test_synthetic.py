"""The synthetic traces have the statistics they claim: those of the embedded model's held-out routing."""

import numpy as np
import pytest

from asyncmoe.trace import Trace

from harness import DEMO_TRACE
from synthetic import stats, synthetic


def test_synthetic_trace_matches_the_embedded_models_reuse_skew_and_cross_layer_lift():
    want = stats(
        Trace.load(DEMO_TRACE)
    )  # 8192 tokens, 6 layers: the lift is fitted in-sample, so the same size
    got = stats(synthetic(64, 8, layers=6, tokens=8192, seed=1))
    assert want["cross_layer_lift"] > 0.05  # the embedded model's layers are not independent
    for stat in ("reuse", "top_quarter_share", "cross_layer_lift"):
        assert got[stat] == pytest.approx(want[stat], abs=0.02), stat


def test_independent_layers_have_no_cross_layer_lift():
    assert (
        abs(stats(synthetic(64, 8, layers=3, tokens=4000, follow=0.0, seed=1))["cross_layer_lift"])
        < 0.01
    )


def test_synthetic_trace_is_a_valid_trace():
    t = synthetic(128, 8, layers=3, tokens=200)
    assert t.ids.shape == (200, 3, 8) and t.num_experts == 128
    assert all(
        len(set(row)) == 8 for row in t.ids.reshape(-1, 8).tolist()
    )  # k distinct experts per token
    assert np.asarray(t.ids).min() >= 0 and np.asarray(t.ids).max() < 128
