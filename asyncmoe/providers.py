"""Expert weight providers: where an experts module's weights come from for one forward.

The transformers integration hands every experts call to the module's provider and knows nothing
else about caching. `ResidentProvider` is what `cache >= num_experts` gets: the experts stay where
the model put them and the model's own implementation runs (no tables, no copies, no overhead).
`CachedProvider` asks the layer's `ExpertCache` for slot ids and computes from the slot buffers.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import ops
from .cache.expert_cache import ExpertCache, num_waves
from .experts import combine, routed_outputs


class ExpertWeightProvider(nn.Module):
    def forward(self, experts: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        raise NotImplementedError


class ResidentProvider(ExpertWeightProvider):
    """Every expert resident: run the implementation the model used before asyncmoe (`implementation`)."""

    def __init__(self, implementation: str, fn: Callable):
        super().__init__()
        self.implementation, self.fn = implementation, fn

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        return self.fn(experts, hidden_states, top_k_index, top_k_weights)


class CachedProvider(ExpertWeightProvider):
    """Experts in host memory, C of them in GPU slots; calls with more than C distinct experts run in waves."""

    def __init__(self, cache: ExpertCache):
        super().__init__()
        self.cache = cache

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        C, E = self.cache.num_slots, self.cache.num_experts
        if k > C:
            raise ValueError(
                f"this call routes each token to {k} experts but the cache has {C} slots per layer: every token "
                f"needs its top-{k} experts resident at once; use cache>={k}"
            )
        weights = self.cache.slot_weights()
        out = None
        for wave in range(num_waves(T * k, C, E)):
            slots = ops.ensure(self.cache, top_k_index, wave)  # [T, k]
            part = routed_outputs(experts, hidden_states, slots, weights)  # [T*k, H]
            out = part if out is None else torch.where((slots >= 0).reshape(-1, 1), part, out)
        return combine(out, top_k_weights, hidden_states.dtype)
