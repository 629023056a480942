"""Routing traces: which experts every token was routed to, in every MoE layer (docs/traces.md).

An `.npz` with
  ids          int [tokens, layers, k]  expert ids per token per MoE layer, in the router's order
  num_experts  int []                   experts per layer
  starts       int [sequences]          optional: offset of each sequence's first token
  weights      float [tokens, layers, k] optional: the router's weights for those ids
  gate_ids     int [tokens, layers, g]   optional: the gate predictor's nominations for each layer, each
                                         token's top-g experts of layer l's router applied to layer l-1's
                                         MoE input (-1 in layer 0, which has no layer before it)
  gate_probs   float [tokens, layers, g] optional: their softmax probabilities
  expert_bytes int []                   optional: bytes of one expert of the recorded model, in the format its
                                         cache stored (what a miss copies); the simulator's default

With the gate arrays a replayed trace also feeds the gate predictor what it predicted on the recorded
model: without them a random-weight model's own router would, and it predicts nothing of the trace.
"""

from __future__ import annotations

import os
import pathlib
import zipfile
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
        if self.ids.ndim != 3:
            raise ValueError(f"trace ids must be [tokens, layers, k], got shape {self.ids.shape}")
        if self.ids.size and not (0 <= self.ids.min() and self.ids.max() < self.num_experts):
            raise ValueError(f"trace ids must lie in [0, num_experts={self.num_experts})")
        if (self.gate_ids is None) != (self.gate_probs is None):
            raise ValueError("a trace's gate_ids and gate_probs come together")
        if self.gate_ids is not None:
            self.gate_ids, self.gate_probs = np.asarray(self.gate_ids), np.asarray(self.gate_probs)
            if self.gate_ids.shape != self.gate_probs.shape or self.gate_ids.shape[:2] != self.ids.shape[:2]:
                raise ValueError(
                    f"trace gate_ids {self.gate_ids.shape} and gate_probs {self.gate_probs.shape} must both be "
                    f"[tokens, layers, g] with the ids' tokens and layers {self.ids.shape[:2]}"
                )
            if self.gate_ids.size and not (-1 <= self.gate_ids.min() and self.gate_ids.max() < self.num_experts):
                raise ValueError(f"trace gate_ids must lie in [-1, num_experts={self.num_experts})")

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def save(self, path) -> None:
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
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, what: str = "") -> Trace:
        """Read a trace saved by `save`; `what` names the argument it came from, for the error messages."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{what}{str(path)!r}: no such trace file (an .npz written by asyncmoe.record)")
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{what}{str(path)!r} is not an asyncmoe trace: not an .npz archive (docs/traces.md)")
        try:
            f = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{what}{str(path)!r} is not a readable .npz archive ({type(e).__name__})") from None
        with f:
            if "ids" not in f or "num_experts" not in f:
                raise ValueError(
                    f"{what}{str(path)!r} is not an asyncmoe trace: it needs arrays 'ids' and 'num_experts' "
                    "(docs/traces.md)"
                )
            optional = {name: f[name] for name in ("starts", "weights", "gate_ids", "gate_probs") if name in f}
            if "gate_ids" in optional:
                optional["gate_ids"] = optional["gate_ids"].astype(np.int64)
            if "expert_bytes" in f:
                optional["expert_bytes"] = int(f["expert_bytes"])
            return cls(ids=f["ids"].astype(np.int64), num_experts=int(f["num_experts"]), **optional)
