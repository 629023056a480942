"""Eviction policies: each turns the per-slot state into a keep score, higher = keep longer.

Every policy reads the same slot state (`CacheState.last_use`, `born`, `freq`, `clock`), kept up to
date by the cache for every slot. The cache ranks slots by tier first (empty < prefetched-unused <
used < needed by a later wave of this call < needed now) and only then by the policy's score, so a
wrong prefetch guess leaves before any expert that earned its place, and an expert needed now is
never a victim.

Scores are integers (the frequency is fixed-point), so the fused kernel (cache/cache_step.py), which
computes the same scores from the constants below, and this reference agree bit for bit
(docs/decisions.md#integer-policy-scores; Markov is the default: #default-policy).
"""

from __future__ import annotations

import torch

from ..choices import DEFAULT_POLICY as DEFAULT_POLICY  # the default, named with the policies
from .state import CacheState

FREQ_UNIT = 256  # one use
FREQ_DECAY_SHIFT = 4  # freq -= freq >> 4 each call: a use ~11 calls ago counts half
LFRU_SHIFT = 20  # LFRU's fixed-point scale: (freq << 20) // (1 + age)
FOLLOW_UNIT = 16  # Markov: one observed successor
FOLLOW_SHIFT = 4  # a row loses 1/16 each time its expert's call is followed by another
# Markov's score: likely << 33 | LFRU, both capped, under the kernel's 47 score bits
LIKELY_SHIFT = 33
LIKELY_MAX, LFRU_MAX = (1 << 14) - 1, (1 << LIKELY_SHIFT) - 1


class Policy:
    name: str
    id: int  # the fused kernel's POLICY constant
    learns: bool = False  # keeps `CacheState.follows` [E, E] (empty otherwise)

    def score(self, s: CacheState) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, s: CacheState, need: torch.Tensor) -> None:
        """Learn from a call's experts `need` [E] bool, before `s.routed` (the last call's) is
        overwritten."""


class LRU(Policy):
    """Least recently used: the expert idle longest leaves first."""

    name, id = "lru", 0

    def score(self, s):
        return s.last_use


class FIFO(Policy):
    """First in, first out: the expert admitted earliest leaves first, however popular."""

    name, id = "fifo", 1

    def score(self, s):
        return s.born


class LFU(Policy):
    """Least frequently used, with the count decayed every call so yesterday's favourites fade."""

    name, id = "lfu", 2

    def score(self, s):
        return s.freq


class LFRU(Policy):
    """Frequency x recency: the decayed count divided by (1 + calls since last use), in integers.

    A popular expert survives a short gap; one that was popular long ago does not hold a slot
    forever.
    """

    name, id = "lfru", 3

    def score(self, s):
        # the clamp changes no slot's score (last_use <= clock). Compiled for the CPU, torch 2.11
        # divides a short tensor's padding lanes too, and an integer divide by zero traps (SIGFPE)
        return (s.freq << LFRU_SHIFT) // (1 + s.clock - s.last_use).clamp(min=1)


class Markov(LFRU):
    """LFRU behind a prediction of the next call: keeps first the experts that most often followed
    the experts of the call being ranked for (`s.routed`: this call in `ensure`, the last one in
    `prefetch`).

    `follows[a, b]` counts, in FOLLOW_UNITs, the calls routed to b right after a call routed to a; a
    row decays when it learns. `likely[b]` is the mean of `follows[a, b]` over the routed a; LFRU
    breaks its ties (docs/decisions.md#eviction-toward-belady).
    """

    name, id, learns = "markov", 4, True

    def score(self, s):
        routed = s.routed[:, None]
        likely = (s.follows * routed).sum(0) // routed.sum().clamp(min=1)  # [E]
        held = s.slot_to_expert
        likely = torch.where(held >= 0, likely[held.clamp(min=0)], 0).clamp(max=LIKELY_MAX)
        return (likely << LIKELY_SHIFT) | super().score(s).clamp(max=LFRU_MAX)

    def observe(self, s, need):
        learned = (
            s.follows
            - (s.follows >> FOLLOW_SHIFT)
            + need[None, :].to(s.follows.dtype) * FOLLOW_UNIT
        )
        s.follows.copy_(torch.where(s.routed[:, None], learned, s.follows))


POLICIES: dict[str, Policy] = {p.name: p for p in (LRU(), FIFO(), LFU(), LFRU(), Markov())}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
