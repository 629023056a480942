"""Routing replayed from a trace (integrations/replay.py): every layer routes exactly by it, shapes must match,
the recorded gate feeds the gate predictor, and an uncompiled model replays and rewinds too."""

import warnings

import numpy as np
import pytest
import torch

import asyncmoe
from asyncmoe.integrations.replay import Replay, replay_routing, rewind_replay
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.prefetch.predictors import recorded_gate_scores
from asyncmoe.trace.simulate import gate_scores

from models import tiny
from traces import random_trace


@torch.no_grad()
def decode_like(model, tokens):
    """One token per call, as decoding does."""
    for t in tokens:
        model(torch.tensor([[t]]), use_cache=False)


def test_replay_routes_exactly_by_the_trace():
    trace = random_trace(1, N=40, L=1, E=16, k=2)  # one trace layer: every model layer replays it
    model = asyncmoe.compile(tiny("olmoe"), cache=4, replay=trace, prefetch=True)
    tokens = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    with asyncmoe.record(model) as rec, pytest.warns(UserWarning, match="40 tokens are used up"):
        decode_like(model, tokens)
    got = rec.trace.ids  # [50, 2, 2]: wraps after 40 tokens
    want = np.concatenate([trace.ids, trace.ids[:10]])[:, 0]
    assert np.array_equal(got[:, 0], want) and np.array_equal(got[:, 1], want)


@pytest.mark.parametrize("cache", [0, 16], ids=["cpu", "resident"])
def test_replay_routes_every_cache_by_the_trace(cache):
    """cache=0 (every expert on the CPU) and a resident cache route by the trace too; a trace of
    more layers than the model's gives MoE layer i its layer i."""
    trace = random_trace(3, N=20, L=3, E=16, k=2)
    model = asyncmoe.compile(tiny("olmoe"), cache=cache, replay=trace)
    with asyncmoe.record(model) as rec:
        decode_like(model, range(6))
    assert np.array_equal(rec.trace.ids, trace.ids[:6, :2])


def test_a_trace_shorter_than_the_run_warns_once_where_it_wraps():
    trace = random_trace(4, N=8, L=2, E=16, k=2)
    model = asyncmoe.compile(tiny("olmoe"), cache=4, replay=trace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_like(model, range(8))  # the whole trace: no wrap yet
        assert caught == []
        decode_like(model, range(12))
    wrapped = [str(w.message) for w in caught]
    assert len(wrapped) == 2  # once for each layer, at its ninth token
    assert (
        "replay: the trace's 8 tokens are used up, and the replay wraps to its first" in wrapped[0]
    )
    rewind_replay(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_like(model, range(8))
    assert caught == []


def test_replay_needs_matching_shape():
    with pytest.raises(ValueError, match=r"routes 2 of 16 experts but the trace has 2 of 12"):
        asyncmoe.compile(tiny("olmoe"), cache=4, replay=random_trace(0))


def test_replay_feeds_the_recorded_gate_to_the_gate_predictor():
    """A model replaying a trace predicts with the trace's recorded gate, not with its own router."""
    recorded = tiny("olmoe", seed=3)
    with torch.no_grad(), asyncmoe.record(recorded, gate=True) as rec:
        decode_like(recorded, [5, 9, 17])
    trace = rec.trace
    model = asyncmoe.compile(
        tiny("olmoe"), cache=4, replay=trace, prefetch=asyncmoe.Prefetch(sources=("gate",))
    )
    _, second = find_experts(model)[1]
    decode_like(model, [1])  # the first layer's prefetch scores the second for trace row 0
    torch.testing.assert_close(second.asyncmoe.prefetch.gate, gate_scores(trace)[0, 1])
    assert gate_scores(trace)[0, 1].sum() > 0


def test_an_uncompiled_model_replays_and_rewinds():
    trace = random_trace(2, N=30, L=2, E=16, k=2)
    model = tiny("olmoe")
    replay_routing(model, trace, "cpu")
    runs = []
    for _ in range(2):
        with asyncmoe.record(model) as rec:
            decode_like(model, range(12))
        runs.append(rec.trace.ids)
        rewind_replay(model)
        assert all(m.asyncmoe_replay.cursor.item() == 0 for _, m in find_experts(model))
    assert np.array_equal(runs[0], trace.ids[:12]) and np.array_equal(runs[1], runs[0])


def test_replay_walks_its_cursor_and_predicts_the_recorded_gate():
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    gate_ids, gate_probs = (
        torch.tensor([[1, 2], [3, -1], [0, 1]]),
        torch.tensor([[0.6, 0.4], [0.9, 0.0], [0.5, 0.5]]),
    )
    replay = Replay(ids, gate_ids, gate_probs)
    out = torch.zeros(4)
    recorded_gate_scores(
        replay.recorded_gate(), 2, 2, out
    )  # rows 0 and 1, before the forward moves the cursor
    assert out.tolist() == pytest.approx([0, 0.3, 0.2, 0.45])
    assert torch.equal(replay(torch.zeros(2, 2, dtype=torch.int64)), ids[:2])
    assert torch.equal(
        replay(torch.zeros(2, 2, dtype=torch.int32)),
        torch.tensor([[4, 5], [0, 1]], dtype=torch.int32),
    )
    assert replay.cursor.item() == 4  # wraps at the trace's end


def test_a_malformed_trace_file_is_refused_before_the_model_changes(tmp_path):
    """Zero tokens once failed at the first forward, deep in the replay's modulo; the same expert twice in a row
    replayed without complaint."""
    model = tiny("olmoe")
    before = {name: p.clone() for name, p in model.named_parameters()}
    np.savez(
        tmp_path / "empty.npz", ids=np.zeros((0, 2, 2), dtype=np.int16), num_experts=np.int64(16)
    )
    with pytest.raises(
        ValueError, match=r"replay=.*empty.npz': trace ids have shape \(0, 2, 2\) \(0 tokens"
    ):
        asyncmoe.compile(model, cache=4, replay=tmp_path / "empty.npz")
    np.savez(tmp_path / "twice.npz", ids=np.array([[[3, 5], [2, 2]]]), num_experts=np.int64(16))
    with pytest.raises(
        ValueError, match=r"twice.npz': token 0 names expert 2 twice in its layer-1 row of ids"
    ):
        asyncmoe.compile(model, cache=4, replay=str(tmp_path / "twice.npz"))
    assert not any(hasattr(m, "asyncmoe_replay") for _, m in find_experts(model))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_trace_changed_after_it_was_built_is_refused_at_install():
    trace = random_trace(2, N=30, L=2, E=16, k=2)
    trace.ids[4, 1] = [9, 9]
    with pytest.raises(ValueError, match="token 4 names expert 9 twice in its layer-1 row"):
        replay_routing(tiny("olmoe"), trace, "cpu")
    with pytest.raises(
        ValueError, match=r"ids \[tokens, k\] of at least one token and expert, got \(0, 2\)"
    ):
        Replay(torch.zeros(0, 2, dtype=torch.int64))
