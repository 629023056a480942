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

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

if triton is not None:

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _stamp(times_ptr, AT: tl.constexpr):
        tl.store(times_ptr + AT, _now())

    @triton.jit
    def _lap(times_ptr):
        now = _now()
        start, mid = tl.load(times_ptr), tl.load(times_ptr + 1)
        tl.store(times_ptr + 2, tl.load(times_ptr + 2) + (mid - start))
        tl.store(times_ptr + 3, tl.load(times_ptr + 3) + (now - mid))


    @triton.jit
    def _window(pace_ptr):
        start = tl.load(pace_ptr)
        tl.store(pace_ptr + 1, tl.where(start > 0, _now() - start, 0))  # no stamp yet: nothing measured


def stamp(times: torch.Tensor, at: int) -> None:
    """times[at] = the GPU clock (ns) when the stream gets here. `times` [4] int64 on CUDA: two stamps, two sums."""
    _stamp[(1,)](times, AT=at, num_warps=1)


def lap(times: torch.Tensor) -> None:
    """times[2] += times[1] - times[0]; times[3] += now - times[1] (ns)."""
    _lap[(1,)](times, num_warps=1)


def window(pace: torch.Tensor) -> None:
    """pace[1] = now - pace[0] (ns): the compute a prefetch issued at the stamp pace[0] had to hide behind, this
    call's (the last call's shape is the next one's: a decode step's, not the prompt's). `pace` [3] int64 on CUDA
    (see `providers.link`)."""
    _window[(1,)](pace, num_warps=1)
