"""Routing traces: which experts every token was routed to, in every MoE layer (docs/traces.md).

An `.npz` with
  ids          int [tokens, layers, k]  expert ids per token per MoE layer, in the router's order
  num_experts  int []                   experts per layer
  starts       int [sequences]          optional: offset of each sequence's first token
  weights      float [tokens, layers, k] optional: the router's weights for those ids
  gate_ids     int [tokens, layers, g]   optional: the gate predictor's nominations for each layer,
  each
                                         token's top-g experts of layer l's router applied to layer
                                         l-1's
                                         MoE input (-1 in layer 0, which has no layer before it)
  gate_probs   float [tokens, layers, g] optional: their softmax probabilities
  expert_bytes int []                   optional: bytes of one expert of the recorded model, in the
  format its
                                         cache stored (what a miss copies); the simulator's default

With the gate arrays a replayed trace also feeds the gate predictor what it predicted on the
recorded model: without them a random-weight model's own router would, and it predicts nothing of
the trace.
"""

from __future__ import annotations

import os
import pathlib
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    ids: np.ndarray  # [N, L, k]
    num_experts: int
    starts: np.ndarray | None = None
    weights: np.ndarray | None = None
    gate_ids: np.ndarray | None = None  # [N, L, g]
    gate_probs: np.ndarray | None = None  # [N, L, g]
    expert_bytes: int | None = None

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        if self.gate_ids is not None:
            self.gate_ids = np.asarray(self.gate_ids)
        if self.gate_probs is not None:
            self.gate_probs = np.asarray(self.gate_probs)
        self.validate()

    def validate(self) -> None:
        """Refuse what no cache can replay, with a ValueError saying what is wrong: a trace that
        passes here replays and simulates without dividing by zero tokens or counting an expert
        twice in one call."""
        ids, E = self.ids, self.num_experts
        if isinstance(E, bool) or not isinstance(E, (int, np.integer)) or E < 1:
            raise ValueError(
                f"trace num_experts must be an int >= 1 (experts per layer), got {E!r}"
            )
        if ids.ndim != 3:
            raise ValueError(f"trace ids must be [tokens, layers, k], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"trace ids must be integer expert ids, got {ids.dtype}")
        if 0 in ids.shape:
            N, L, k = ids.shape
            raise ValueError(
                f"trace ids have shape {ids.shape} ({N} tokens, {L} layers, k={k}): a trace needs "
                "at least one "
                "token routed to at least one expert in at least one layer; record a run that "
                "generates something"
            )
        _check_rows(ids, E, "ids", low=0)
        if self.weights is not None and np.shape(self.weights) != ids.shape:
            raise ValueError(
                f"trace weights {np.shape(self.weights)} must have the ids' shape {ids.shape}"
            )
        if self.weights is not None:
            _check_floats(np.asarray(self.weights), "weights")
        if self.starts is not None:
            starts = np.asarray(self.starts)
            if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
                raise ValueError(
                    f"trace starts must be a 1-D int array (token offsets), got {starts.dtype} "
                    f"{starts.shape}"
                )
            if starts.size and (
                starts.min() < 0 or starts.max() > self.tokens or (np.diff(starts) < 0).any()
            ):
                first = starts.tolist()[:8]
                raise ValueError(
                    f"trace starts must be ascending token offsets in [0, tokens={self.tokens}], "
                    f"got {first}"
                )
        if (self.gate_ids is None) != (self.gate_probs is None):
            raise ValueError("a trace's gate_ids and gate_probs come together")
        if self.gate_ids is not None:
            if (
                self.gate_ids.shape != self.gate_probs.shape
                or self.gate_ids.ndim != 3
                or self.gate_ids.shape[:2] != ids.shape[:2]
                or self.gate_ids.shape[2] == 0
            ):
                raise ValueError(
                    f"trace gate_ids {self.gate_ids.shape} and gate_probs {self.gate_probs.shape} "
                    "must both be "
                    f"[tokens, layers, g] (g >= 1) with the ids' tokens and layers {ids.shape[:2]}"
                )
            if not np.issubdtype(self.gate_ids.dtype, np.integer):
                raise ValueError(
                    "trace gate_ids must be integer expert ids (-1: none), got "
                    f"{self.gate_ids.dtype}"
                )
            _check_rows(self.gate_ids, E, "gate_ids", low=-1)
            _check_floats(self.gate_probs, "gate_probs")
        if self.expert_bytes is not None and not (
            isinstance(self.expert_bytes, (int, np.integer)) and self.expert_bytes >= 0
        ):
            raise ValueError(
                "trace expert_bytes must be an int >= 0 (bytes of one expert), got "
                f"{self.expert_bytes!r}"
            )

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the trace to exactly `path` (numpy would add .npz to a name without it) and return
        that path."""
        arrays = {
            "ids": self.ids.astype(np.int16 if self.num_experts < 2**15 else np.int32),
            "num_experts": np.int64(self.num_experts),
        }
        if self.starts is not None:
            arrays["starts"] = np.asarray(self.starts, dtype=np.int64)
        if self.weights is not None:
            arrays["weights"] = np.asarray(self.weights, dtype=np.float16)
        if self.gate_ids is not None:
            arrays["gate_ids"] = self.gate_ids.astype(arrays["ids"].dtype)
            arrays["gate_probs"] = np.asarray(self.gate_probs, dtype=np.float16)
        if self.expert_bytes is not None:
            arrays["expert_bytes"] = np.int64(self.expert_bytes)
        path = pathlib.Path(path)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, what: str = "") -> Trace:
        """Read a trace saved by `save` and validate it; `what` names the argument it came from.
        Every error names the file and what is wrong with it."""
        path = pathlib.Path(path)
        name = f"{what}{str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(
                f"{name}: no such trace file (an .npz written by asyncmoe.record)"
            )
        if not zipfile.is_zipfile(path):
            raise ValueError(
                f"{name} is not an asyncmoe trace: not an .npz archive (docs/traces.md)"
            )
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {key: f[key] for key in f.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise ValueError(
                f"{name} is not a readable .npz archive ({type(e).__name__})"
            ) from None
        if "ids" not in arrays or "num_experts" not in arrays:
            raise ValueError(
                f"{name} is not an asyncmoe trace: it needs arrays 'ids' and 'num_experts' "
                "(docs/traces.md)"
            )
        try:
            return cls(**_fields(arrays))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _fields(arrays: dict[str, np.ndarray]) -> dict:
    """The Trace fields of a loaded .npz: ids as int64, the scalars as ints; a wrong kind of array
    is a ValueError."""
    for key in ("num_experts", "expert_bytes"):
        if key in arrays and (
            arrays[key].shape != () or not np.issubdtype(arrays[key].dtype, np.integer)
        ):
            raise ValueError(
                f"{key} must be an int scalar, got {arrays[key].dtype} of shape {arrays[key].shape}"
            )
    for key in ("ids", "gate_ids", "starts"):
        if key in arrays and not np.issubdtype(arrays[key].dtype, np.integer):
            raise ValueError(f"{key} must be an int array, got {arrays[key].dtype}")
    fields = {
        key: arrays[key] for key in ("starts", "weights", "gate_ids", "gate_probs") if key in arrays
    }
    if "gate_ids" in fields:
        fields["gate_ids"] = fields["gate_ids"].astype(np.int64)
    if "expert_bytes" in arrays:
        fields["expert_bytes"] = int(arrays["expert_bytes"])
    return dict(
        ids=arrays["ids"].astype(np.int64), num_experts=int(arrays["num_experts"]), **fields
    )


def _check_rows(ids: np.ndarray, num_experts: int, name: str, low: int) -> None:
    """Every id of `ids` [N, L, k] in [low, num_experts), and no expert twice in one token's row of
    a layer (ids below 0 mean none and may repeat): the cache makes a row's experts resident
    together, each once."""
    bad = (ids < low) | (ids >= num_experts)
    if bad.any():
        t, l, j = np.argwhere(bad)[0]
        raise ValueError(
            f"trace {name} must lie in [{low}, num_experts={num_experts}): token {t} names expert "
            f"{ids[t, l, j]} "
            f"in layer {l} ({int(bad.sum())} ids out of range)"
        )
    ordered = np.sort(ids, axis=-1)
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if twice.any():
        t, l, j = np.argwhere(twice)[0]
        e = ordered[t, l, j]
        n = int((ids[t, l] == e).sum())
        times = "twice" if n == 2 else f"{n} times"
        what = "k experts" if name == "ids" else "gate nominations"
        raise ValueError(
            f"token {t} names expert {e} {times} in its layer-{l} row of {name}; a token's {what} "
            "must be distinct"
        )


def _check_floats(values: np.ndarray, name: str) -> None:
    """Router weights or the gate's probabilities: finite and >= 0 (some routers scale their weights
    past 1); a NaN would be replayed into the simulator's and the gate's scores."""
    if not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"trace {name} must be floats, got {values.dtype}")
    bad = ~(np.isfinite(values) & (values >= 0))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"trace {name} must be finite numbers >= 0: {int(bad.sum())} are not, the first "
            f"{values[where]} at [token, layer, rank] {where}; record the trace again"
        )
