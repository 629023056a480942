"""Eviction policies: each turns the per-slot state into a keep score, higher = keep longer.

All policies see the same state, kept up to date by the cache for every slot (C slots):
  last_use [C] int64   clock of the last call that used the slot
  born     [C] int64   clock when the slot's expert was admitted
  freq     [C] float32 use count, multiplied by `DECAY` every call (an exponentially decayed count)
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

DECAY = 0.95  # per call: a use 14 calls ago counts half


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
    """Frequency × recency: the decayed count divided by (1 + calls since last use).

    A popular expert survives a short gap; one that was popular long ago does not hold a slot forever.
    """

    name = "lfru"

    def score(self, s):
        age = (s.clock - s.last_use).to(torch.float32)
        return s.freq / (1.0 + age)


POLICIES: dict[str, Policy] = {p.name: p for p in (LRU(), LFU(), LFRU(), FIFO())}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}") from None
