"""Routing traces: which experts every token was routed to, in every MoE layer (docs/traces.md).

An `.npz` with
  ids          int [tokens, layers, k]  expert ids per token per MoE layer, in the router's order
  num_experts  int []                   experts per layer
  starts       int [sequences]          optional: offset of each sequence's first token
  weights      float [tokens, layers, k] optional: the router's weights for those ids
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    ids: np.ndarray  # [N, L, k]
    num_experts: int
    starts: np.ndarray | None = None
    weights: np.ndarray | None = None

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        if self.ids.ndim != 3:
            raise ValueError(f"trace ids must be [tokens, layers, k], got shape {self.ids.shape}")
        if self.ids.size and not (0 <= self.ids.min() and self.ids.max() < self.num_experts):
            raise ValueError(f"trace ids must lie in [0, num_experts={self.num_experts})")

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
        arrays = {"ids": self.ids.astype(np.int16 if self.num_experts < 2**15 else np.int32), "num_experts": np.int64(self.num_experts)}
        if self.starts is not None:
            arrays["starts"] = np.asarray(self.starts, dtype=np.int64)
        if self.weights is not None:
            arrays["weights"] = np.asarray(self.weights, dtype=np.float16)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path) -> "Trace":
        with np.load(path) as f:
            if "ids" not in f or "num_experts" not in f:
                raise ValueError(f"{path} is not an asyncmoe trace: it needs arrays 'ids' and 'num_experts' (docs/traces.md)")
            return cls(
                ids=f["ids"].astype(np.int64), num_experts=int(f["num_experts"]),
                starts=f["starts"] if "starts" in f else None, weights=f["weights"] if "weights" in f else None,
            )
