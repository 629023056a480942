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
    assert (
        np.array_equal(back.ids, tr.ids)
        and back.num_experts == 12
        and back.starts.tolist() == [0, 50]
    )
    assert (
        (back.tokens, back.layers, back.top_k) == (120, 3, 2)
        and back.weights is None
        and back.gate_ids is None
    )
    with pytest.raises(ValueError, match=r"must lie in \[0, num_experts=4\)"):
        Trace(np.full((2, 1, 1), 7), 4)
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an asyncmoe trace"):
        Trace.load(tmp_path / "bad.npz")
    gate_ids = np.where(
        np.arange(3)[None, :, None] == 0, -1, tr.ids[:, :, :1]
    )  # [N, L, 1], none for layer 0
    gated = Trace(tr.ids, 12, gate_ids=gate_ids, gate_probs=np.full(gate_ids.shape, 0.5))
    gated.save(tmp_path / "g.npz")
    back = Trace.load(tmp_path / "g.npz")
    assert np.array_equal(back.gate_ids, gate_ids) and np.array_equal(
        back.gate_probs, np.full(gate_ids.shape, 0.5)
    )
    with pytest.raises(
        ValueError, match=r"gate_ids \(120, 2, 1\) and gate_probs \(120, 2, 1\) must both be"
    ):
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
        (
            dict(ids=np.zeros((3, 2))),
            r"trace ids must be \[tokens, layers, k\], got shape \(3, 2\)",
        ),
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
        FileNotFoundError,
        match=r"trace=.*nope.npz.*no such trace file \(an .npz written by asyncmoe.record\)",
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


def saved(tmp_path, name="t.npz", **arrays):
    """An .npz of `arrays` over a valid 4-token, 2-layer, top-2 trace of 8 experts."""
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 4]], [[4, 5], [6, 7]], [[0, 7], [1, 6]]])
    np.savez(tmp_path / name, **{"ids": ids, "num_experts": np.int64(8), **arrays})
    return tmp_path / name


GATE = np.zeros((4, 2, 2), dtype=np.int64)


@pytest.mark.parametrize(
    "arrays, message",
    [
        (
            dict(ids=np.zeros((0, 2, 2), dtype=np.int16)),
            r"shape \(0, 2, 2\) \(0 tokens, 2 layers, k=2\)",
        ),
        (dict(ids=np.zeros((3, 0, 2), dtype=np.int16)), r"0 layers"),
        (
            dict(ids=np.array([[[0, 1]], [[2, 9]]])),
            r"must lie in \[0, num_experts=8\): token 1 names expert 9 in layer 0",
        ),
        (dict(ids=np.array([[[0, 1]], [[2, -1]]])), r"token 1 names expert -1 in layer 0"),
        (
            dict(ids=np.array([[[0, 1, 2, 3]], [[7, 3, 5, 7]]])),
            "token 1 names expert 7 twice in its layer-0 row of ids; a token's k experts must be distinct",
        ),
        (dict(ids=np.full((2, 1, 8), 3)), "token 0 names expert 3 8 times in its layer-0 row"),
        (dict(ids=np.zeros((2, 1, 1)) + 0.5), "ids must be an int array, got float64"),
        (dict(num_experts=np.zeros(2, dtype=np.int64)), r"num_experts must be an int scalar"),
        (dict(num_experts=np.int64(0)), "num_experts must be an int >= 1"),
        (dict(gate_ids=GATE), "gate_ids and gate_probs come together"),
        (
            dict(gate_ids=GATE[:3], gate_probs=np.zeros((3, 2, 2))),
            r"gate_ids \(3, 2, 2\) and gate_probs \(3, 2, 2\) must both be \[tokens, layers, g\]",
        ),
        (
            dict(gate_ids=GATE, gate_probs=np.zeros((4, 2, 1))),
            r"gate_ids \(4, 2, 2\) and gate_probs \(4, 2, 1\)",
        ),
        (dict(gate_ids=GATE[..., :0], gate_probs=np.zeros((4, 2, 0))), r"\(g >= 1\)"),
        (
            dict(gate_ids=GATE + 8, gate_probs=np.zeros((4, 2, 2))),
            r"gate_ids must lie in \[-1, num_experts=8\)",
        ),
        (
            dict(
                gate_ids=np.where(np.arange(2)[None, :, None] == 0, -1, GATE + 5),
                gate_probs=np.zeros((4, 2, 2)),
            ),
            "token 0 names expert 5 twice in its layer-1 row of gate_ids",
        ),
        (
            dict(weights=np.zeros((4, 2, 1))),
            r"weights \(4, 2, 1\) must have the ids' shape \(4, 2, 2\)",
        ),
        (
            dict(weights=np.where(np.arange(4)[:, None, None] == 2, np.nan, np.ones((4, 2, 2)))),
            r"weights must be finite numbers >= 0: 4 are not, the first nan at \[token, layer, "
            r"rank\] \(2, 0, 0\)",
        ),
        (
            dict(gate_ids=np.broadcast_to([0, 1], (4, 2, 2)), gate_probs=np.full((4, 2, 2), -0.5)),
            r"gate_probs must be finite numbers >= 0: 16 are not",
        ),
        (
            dict(starts=np.array([2, 0])),
            r"starts must be ascending token offsets in \[0, tokens=4\], got \[2, 0\]",
        ),
        (dict(expert_bytes=np.float64(1.5)), "expert_bytes must be an int scalar"),
    ],
)
def test_a_malformed_trace_file_is_refused_where_it_loads(arrays, message, tmp_path):
    """Each a ValueError that names the file and what is wrong, before anything replays or simulates it."""
    path = saved(tmp_path, **arrays)
    with pytest.raises(ValueError, match=message) as error:
        Trace.load(path, what="replay=")
    assert str(error.value).startswith(f"replay={str(path)!r}")


def test_layer_0s_empty_gate_rows_may_repeat_minus_one(tmp_path):
    gate_ids = np.where(np.arange(2)[None, :, None] == 0, -1, np.array([0, 1]))
    back = Trace.load(
        saved(
            tmp_path, gate_ids=np.broadcast_to(gate_ids, (4, 2, 2)), gate_probs=np.zeros((4, 2, 2))
        )
    )
    assert (back.gate_ids[:, 0] == -1).all()


def test_a_trace_changed_after_it_was_built_is_refused_by_validate():
    trace = random_trace(0, N=5)
    trace.ids = trace.ids[:0]
    with pytest.raises(ValueError, match="0 tokens"):
        trace.validate()


def test_save_writes_exactly_the_path_given(tmp_path):
    """numpy adds .npz to a name without it; `save` writes where it was told and says where."""
    tr = random_trace(0, N=5)
    assert tr.save(tmp_path / "t.txt") == tmp_path / "t.txt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
    assert np.array_equal(Trace.load(tmp_path / "t.txt").ids, tr.ids)
