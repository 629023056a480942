"""Eviction policies: each turns the per-slot state into a keep score, higher = keep longer.

All policies see the same state, kept up to date by the cache for every slot (C slots):
  last_use [C] int64   clock of the last call that used the slot
  born     [C] int64   clock when the slot's expert was admitted
  freq     [C] int64   use count in units of 1/FREQ_UNIT, times 15/16 every call (an exponentially decayed
                       count; integer so that the fused kernel and this reference agree bit for bit)
  used     [C] bool    used since admitted; False for a prefetched expert nobody asked for yet
  clock    [1] int64   calls so far
and, for the predictor's bookkeeping (no policy reads them):
  source   [C] int8    which predictors nominated a prefetched slot's expert (bits), 0 if ensure admitted it
  routed   [E] bool    experts the last call routed to
The cache ranks slots by tier first (empty < prefetched-unused < used < needed by a later wave of
this call) and only then by the policy's score, so a wrong prefetch guess leaves before any expert
that earned its place, and an expert needed now is never a victim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FREQ_UNIT = 256  # one use
FREQ_DECAY_SHIFT = 4  # freq -= freq >> 4 each call: a use ~11 calls ago counts half


class SlotState(NamedTuple):
    last_use: torch.Tensor
    born: torch.Tensor
    freq: torch.Tensor
    used: torch.Tensor
    clock: torch.Tensor
    source: torch.Tensor
    routed: torch.Tensor


class Policy:
    name: str

    def score(self, s: SlotState) -> torch.Tensor:
        raise NotImplementedError


class LRU(Policy):
    """Least recently used: the expert idle longest leaves first."""

    name = "lru"

    def score(self, s):
        return s.last_use


class FIFO(Policy):
    """First in, first out: the expert admitted earliest leaves first, however popular."""

    name = "fifo"

    def score(self, s):
        return s.born


class LFU(Policy):
    """Least frequently used, with the count decayed every call so yesterday's favourites fade."""

    name = "lfu"

    def score(self, s):
        return s.freq


class LFRU(Policy):
    """Frequency × recency: the decayed count divided by (1 + calls since last use), in integers.

    A popular expert survives a short gap; one that was popular long ago does not hold a slot forever.
    """

    name = "lfru"

    def score(self, s):
        return (s.freq << 20) // (1 + s.clock - s.last_use)


POLICIES: dict[str, Policy] = {p.name: p for p in (LRU(), FIFO(), LFU(), LFRU())}
POLICY_IDS = {name: i for i, name in enumerate(POLICIES)}  # the fused kernel's POLICY constant


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}") from None
