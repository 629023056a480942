"""The routing trace format (trace/format.py): a saved trace loads back as it was, bad traces are refused at
build, and `Trace.load` says what is wrong with a file that is not one."""

import numpy as np
import pytest

from asyncmoe.trace import Trace

from traces import random_trace


def test_format_round_trip(tmp_path):
    tr = random_trace(0)
    tr.starts = np.array([0, 50])
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.ids, tr.ids) and back.num_experts == 12 and back.starts.tolist() == [0, 50]
    assert (back.tokens, back.layers, back.top_k) == (120, 3, 2) and back.weights is None and back.gate_ids is None
    with pytest.raises(ValueError, match=r"must lie in \[0, num_experts=4\)"):
        Trace(np.full((2, 1, 1), 7), 4)
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an asyncmoe trace"):
        Trace.load(tmp_path / "bad.npz")
    gate_ids = np.where(np.arange(3)[None, :, None] == 0, -1, tr.ids[:, :, :1])  # [N, L, 1], none for layer 0
    gated = Trace(tr.ids, 12, gate_ids=gate_ids, gate_probs=np.full(gate_ids.shape, 0.5))
    gated.save(tmp_path / "g.npz")
    back = Trace.load(tmp_path / "g.npz")
    assert np.array_equal(back.gate_ids, gate_ids) and np.array_equal(back.gate_probs, np.full(gate_ids.shape, 0.5))
    with pytest.raises(ValueError, match=r"gate_ids \(120, 2, 1\) and gate_probs \(120, 2, 1\) must both be"):
        Trace(tr.ids, 12, gate_ids=gate_ids[:, :2], gate_probs=np.zeros((120, 2, 1)))


def test_weights_round_trip_in_half_precision(tmp_path):
    tr = random_trace(1, N=10)
    tr.weights = np.full(tr.ids.shape, 0.3, dtype=np.float32)
    tr.save(tmp_path / "w.npz")
    back = Trace.load(str(tmp_path / "w.npz"))  # a str path as well as a PathLike
    np.testing.assert_allclose(back.weights, tr.weights, rtol=1e-3)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(ids=np.zeros((3, 2))), r"trace ids must be \[tokens, layers, k\], got shape \(3, 2\)"),
        (dict(gate_ids=np.zeros((4, 1, 1))), "gate_ids and gate_probs come together"),
        (
            dict(gate_ids=np.full((4, 1, 1), 9), gate_probs=np.zeros((4, 1, 1))),
            r"gate_ids must lie in \[-1, num_experts=4\)",
        ),
    ],
)
def test_a_bad_trace_is_refused_at_build(bad, message):
    with pytest.raises(ValueError, match=message):
        Trace(**{"ids": np.zeros((4, 1, 1), dtype=int), "num_experts": 4, **bad})


def test_load_a_missing_file(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"trace=.*nope.npz.*no such trace file \(an .npz written by asyncmoe.record\)"
    ):
        Trace.load(tmp_path / "nope.npz", what="trace=")
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        Trace.load(tmp_path)  # a directory is no trace file either


def test_load_a_file_of_something_else(tmp_path):
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(ValueError, match="one.npz' is not an asyncmoe trace: not an .npz archive"):
        Trace.load(tmp_path / "one.npz")
    np.savez(tmp_path / "ids_only.npz", ids=np.zeros((2, 1, 1)))
    with pytest.raises(ValueError, match="it needs arrays 'ids' and 'num_experts'"):
        Trace.load(tmp_path / "ids_only.npz")
    (tmp_path / "cut.npz").write_bytes((tmp_path / "ids_only.npz").read_bytes()[:30])
    with pytest.raises(ValueError, match="cut.npz' is not an asyncmoe trace: not an .npz archive"):
        Trace.load(tmp_path / "cut.npz")
