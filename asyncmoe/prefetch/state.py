"""The tensors of one prefetch target layer that only the prefetch reads and writes, as one named
structure.

Dims: E experts of the target layer, E' experts of the previous cached layer.

What the target's cache must see of a prefetch (the slots' nominators, the experts it evicted, the
nominations its `ensure` scores) lives in the cache's own state (cache/state.py); this is the rest:
the predictors' scores, the prefetch gate's evidence and decision, the transition counts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..cache.host import host_flag

# `outcomes` [2, 4] float32, the prefetch gate's evidence: decayed (wasted, paid) prefetches, then
# the (wasted, paid) totals it last read from the counters; row PREFETCHES for every copy and
# exploration, row RUNNERS_UP for the nominations past the likeliest
WASTED, PAID, SEEN_WASTED, SEEN_PAID = 0, 1, 2, 3
PREFETCHES, RUNNERS_UP = 0, 1
N_OUTCOMES = 4  # a row's length


class PrefetchState(NamedTuple):
    """Everything a prefetch into one layer reads or writes besides that layer's cache."""

    # [E] float32: the gate predictor's scores, written on the side stream by the layer before
    gate: Tensor
    predicted: Tensor  # [E] float32: the side stream's combined prediction
    nominated: Tensor  # [E] int8: its sources (bits, cache/state.py SOURCES)
    # [2, 4] float32: the prefetch gate's evidence (rows PREFETCHES, RUNNERS_UP; WASTED ..
    # SEEN_PAID)
    outcomes: Tensor
    visited: Tensor  # [1] int64: the target's `calls` counter when a prefetch into it last ran
    # [1] int32: 1 while the prefetch gate into this layer is open; in pinned host memory
    gate_open: Tensor
    # [E', E] float32: decayed (expert at the previous layer -> here) counts; [0, E] if unused
    transitions: Tensor


class PrefetchBuffers(nn.Module):
    """The `PrefetchState` buffers of one target layer, allocated once (a captured graph replays on
    them).

    `gate_open` is in pinned host memory on CUDA, and `gate_open_host` is the host's tensor over it:
    the host reads what the last prefetch into this layer decided without a sync
    (runtime/decoder.py's `Gates`). `transitions_from` is E' when a transition predictor feeds this
    layer (0: none)."""

    def __init__(self, num_experts: int, device: torch.device, transitions_from: int = 0):
        super().__init__()
        E, f32 = num_experts, dict(dtype=torch.float32, device=device)
        self.gate_open_host, gate_open = host_flag(1, device)  # open until evidence closes it
        buffers = dict(
            # a buffer, not a temporary: the side stream reads it, and a temporary could be reused
            # under it; and not `predicted`, which the side stream writes while a deeper layer's
            # prefetch may still run
            gate=torch.zeros(E, **f32),
            predicted=torch.zeros(E, **f32),
            nominated=torch.zeros(E, dtype=torch.int8, device=device),
            outcomes=torch.zeros(2, N_OUTCOMES, **f32),
            visited=torch.zeros(1, dtype=torch.int64, device=device),
            gate_open=gate_open,
            transitions=torch.zeros(transitions_from, E, **f32),
        )
        assert tuple(buffers) == PrefetchState._fields
        for name, buf in buffers.items():
            self.register_buffer(name, buf, persistent=False)

    @property
    def state(self) -> PrefetchState:
        return PrefetchState(*(getattr(self, name) for name in PrefetchState._fields))

    def clear(self) -> None:
        """Back to as built: no prediction, no evidence, the gate open. In place (a captured graph's
        addresses)."""
        for name in PrefetchState._fields:
            getattr(self, name).zero_()
        self.gate_open.fill_(1)
