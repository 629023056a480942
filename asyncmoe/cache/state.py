"""The tensors of one layer's cache that the ops read and write, as one named structure.

Dims: E experts of this layer, E' experts of the previous cached layer, C slots.

A custom op takes a flat `list[Tensor]`; `CacheState._make(tensors)` names them again in one place
(`asyncmoe.ops`), so the algorithm, the kernels and the predictors read fields by name. The fields
that are small vectors of different things (`counters`, `pace`, `timer`) are indexed by the named
constants below, which the Triton kernels import: one definition each. A prefetch target's own
tensors (scores, the prefetch gate's evidence) are prefetch/state.py's `PrefetchState`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

from torch import Tensor

from . import clock


class Counter(IntEnum):
    """Indices of `CacheState.counters` [len(Counter)] int64, summed over calls on the device."""

    CALLS = 0  # calls served (a call in waves counts once)
    HITS = 1
    MISSES = 2
    EVICTIONS = 3
    BYTES_H2D = 4  # every byte copied host -> slots, prefetches included
    PREFETCHED = 5  # experts a prefetch admitted
    WASTED = 6  # prefetched experts evicted before any use
    PREFETCH_HITS = 7  # routed experts found resident because a prefetch put them there
    HITS_GATE = 8  # ... by the predictor that nominated them (bit i of `source`: SOURCES[i])
    HITS_TEMPORAL = 9
    HITS_TRANSITION = 10
    PREFETCH_TIMELY = 11  # prefetch hits in the very call the prefetch was for
    # experts a prefetch evicted that the next call needed: hits the prefetch cost
    PREFETCH_VICTIMS = 12
    # a closed prefetch gate's exploring nominations, scored against their call with no copy
    EXPLORED = 13
    # ... that the call routed to and did not hold: misses a prefetch would have saved
    EXPLORED_PAID = 14
    # a prefetch's nominations past its likeliest, not resident when nominated, copied or not
    RUNNERS_UP = 15
    # ... that the call routed to: misses their copies saved or would have saved
    RUNNERS_UP_PAID = 16
    # hybrid: misses the CPU computed instead of the link copying them (hybrid/split.py)
    CPU_MISSES = 17
    # hybrid: the cost model's predicted ns for the calls' misses, both sides
    COST_NS = 18


COUNTERS = tuple(c.name.lower() for c in Counter)
# the predictors; bit i of a slot's `source`: nominated by SOURCES[i]
SOURCES = ("gate", "temporal", "transition")
GATE, TEMPORAL, TRANSITION = 1, 2, 4  # their bits

# `pace` [3] int64, one tensor shared by every linked layer: a GPU-clock stamp (ns) taken before the
# first layer's prefetch, the compute that prefetch hid behind in the last call (ns), and one
# expert's copy (ns); 0: not measured
PACE_STAMP, PACE_WINDOW, PACE_COPY = clock.STAMP, clock.WINDOW, 2
# `timer` [7] int64 (stall timing; empty when off): three GPU-clock stamps, then the summed ns
# waited for the prefetch's copies, spent in `ensure`'s own decision and copies, and in its copies,
# and the experts those copies moved
TIMER_START, TIMER_WAIT_FROM, TIMER_WAITED = clock.START, clock.WAIT_FROM, clock.WAITED
TIMER_WAIT_NS, TIMER_ENSURE_NS, TIMER_COPY_NS = clock.WAIT_NS, clock.ENSURE_NS, clock.COPY_NS
TIMER_COPIED, TIMER_SIZE = clock.COPIED, clock.TIMER_SIZE
# `wave_of` of an expert the call routes to that another executor (the hybrid's CPU) computes
WAVE_ELSEWHERE = -2


class CacheState(NamedTuple):
    """Everything the ops read or write of one layer's cache but the expert weights (host store and
    slots)."""

    # [E+1] int64, -1: not resident; row E is a trash row that absorbs masked writes
    expert_to_slot: Tensor
    slot_to_expert: Tensor  # [C] int64, -1: empty
    last_use: Tensor  # [C] int64: clock of the last call that used the slot
    born: Tensor  # [C] int64: clock when the slot's expert was admitted
    freq: Tensor  # [C] int64: decayed use count, in units of 1/FREQ_UNIT (policies.py)
    used: Tensor  # [C] bool: used since admitted (False: a prefetched expert nobody asked for yet)
    clock: Tensor  # [1] int64: waves served so far
    # [C] int8: bits of the predictors that nominated a prefetched slot's expert; 0: ensure admitted
    source: Tensor
    routed: Tensor  # [E] bool: experts the last call routed to
    counters: Tensor  # [len(Counter)] int64
    evicted_at: Tensor  # [E+1] int64: clock of the prefetch that last evicted each expert, -1: none
    # [E] int64: this call's wave of each expert, -1: not needed, WAVE_ELSEWHERE: routed, computed
    # elsewhere (in no wave)
    wave_of: Tensor
    scratch: Tensor  # [E] int32: the fused kernel's per-expert flags
    # [1] int64: the expert an exploring call nominated, for the next `ensure` to score; -1: none
    explored: Tensor
    # [E] bool: the last prefetch's nominations past its likeliest, for the next `ensure` to score
    runners_up: Tensor
    # [E, E] int32: the Markov policy's (expert in a call -> in the next call) counts; [0, 0] if
    # unused
    follows: Tensor
    timer: Tensor  # [TIMER_SIZE] int64 (TIMER_*), or [0] when stall timing is off
    pace: Tensor  # [3] int64 (PACE_*), shared by the linked layers
