"""Stall timing on the device: read the GPU's global nanosecond clock from a one-thread kernel.

Why not CUDA events: an event cannot be timed inside a CUDA graph, and a graph is where the stalls
that matter happen. A kernel that stores `%globaltimer` is an ordinary graph node, runs in stream
order, and the differences accumulate in device counters that `asyncmoe.stats` reads with the rest:
no host sync while decoding.

What one stamp-to-stamp difference holds: the work between the two stamps on the stream, plus one
kernel boundary (a microsecond or two inside a graph; in eager mode, when the GPU outruns the host,
the host's time to launch the next kernel).
"""

from __future__ import annotations

import time

import torch

from .. import gpu

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

# The layouts the kernels below write (the cache's `timer` and `pace` use them: cache/state.py)
# a timer [7]: three stamps, three sums of ns, and the experts the timed copies moved
START, WAIT_FROM, WAITED, WAIT_NS, ENSURE_NS, COPY_NS, COPIED = 0, 1, 2, 3, 4, 5, 6
TIMER_SIZE = 7
STAMP, WINDOW = 0, 1  # a pace: a stamp, then the ns from it to the `window` call

if triton is not None and gpu.interpreted():

    @triton.jit
    def _now():
        """The host's clock, in ns, where Triton interprets the kernels."""
        return time.perf_counter_ns()

elif triton is not None:

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


if triton is not None:

    @triton.jit
    def _stamp(times_ptr, AT: tl.constexpr):
        tl.store(times_ptr + AT, _now())

    @triton.jit
    def _lap(
        times_ptr,
        count_ptr,
        START: tl.constexpr,
        WAIT_FROM: tl.constexpr,
        WAITED: tl.constexpr,
        WAIT_NS: tl.constexpr,
        ENSURE_NS: tl.constexpr,
        COPY_NS: tl.constexpr,
        COPIED: tl.constexpr,
    ):
        now = _now()
        start, wait_from, waited = (
            tl.load(times_ptr + START),
            tl.load(times_ptr + WAIT_FROM),
            tl.load(times_ptr + WAITED),
        )
        tl.store(times_ptr + WAIT_NS, tl.load(times_ptr + WAIT_NS) + (waited - wait_from))
        tl.store(
            times_ptr + ENSURE_NS,
            tl.load(times_ptr + ENSURE_NS) + (wait_from - start) + (now - waited),
        )
        tl.store(times_ptr + COPY_NS, tl.load(times_ptr + COPY_NS) + (now - waited))
        tl.store(times_ptr + COPIED, tl.load(times_ptr + COPIED) + tl.load(count_ptr))

    @triton.jit
    def _window(pace_ptr, STAMP: tl.constexpr, WINDOW: tl.constexpr):
        start = tl.load(pace_ptr + STAMP)
        # no stamp yet: nothing measured
        tl.store(pace_ptr + WINDOW, tl.where(start > 0, _now() - start, 0))


def stamp(times: torch.Tensor, at: int) -> None:
    """times[at] = the GPU clock (ns) when the stream gets here (`times` int64 on CUDA)."""
    _stamp[(1,)](times, AT=at, num_warps=1)


def lap(times: torch.Tensor, count: torch.Tensor) -> None:
    """times[WAIT_NS] += the ns from WAIT_FROM to WAITED; times[ENSURE_NS] += the rest since
    START; times[COPY_NS] += the ns since WAITED, the part of it `ensure` spends on its copies, and
    times[COPIED] += `count` [1], the experts they moved."""
    _lap[(1,)](
        times,
        count,
        START=START,
        WAIT_FROM=WAIT_FROM,
        WAITED=WAITED,
        WAIT_NS=WAIT_NS,
        ENSURE_NS=ENSURE_NS,
        COPY_NS=COPY_NS,
        COPIED=COPIED,
        num_warps=1,
    )


def window(pace: torch.Tensor) -> None:
    """pace[WINDOW] = now - pace[STAMP] (ns): the compute a prefetch issued at the stamp had to hide
    behind, this call's (the last call's shape is the next one's: a decode step's, not the prompt's;
    see `providers.link`)."""
    _window[(1,)](pace, STAMP=STAMP, WINDOW=WINDOW, num_warps=1)
