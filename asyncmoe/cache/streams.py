"""The side streams of each device and the events that order them against the compute stream.

`gate_scores` and `prefetch` (prefetch/ops.py) fork a side stream from the current (compute) stream
and predict and admit there, off the compute stream's path; `prefetch` copies on a second side
stream, so that the next prefetch's prediction need not queue behind this one's copies. Given the
`routed` of the layer they predict from (`source`), they fork from that layer's `ensure` once it has
decided, not once its copies are done: the prediction and the admission run while the misses copy,
and the prefetch's own copy starts as soon as the misses' copies end, so the link does not idle
between them and misses still go first. `gate_scores` records an event once it has read its input,
which `gate_join` makes the compute stream wait on before that input may be freed or reused.
`prefetch` records two events per target cache: `planned` (its tables are written) and `ready` (its
copies are made). The target's `ensure(wait=True)` (cache/ops.py) waits for `planned` before it
decides, and for `ready` only before its own copies: it decides while the prefetch copies, and its
misses' copies follow the prefetch's on the link with no decision between them. Every prefetch
targets a later layer of the same forward, whose `ensure` waits, so side-stream work has rejoined
before the forward returns (a CUDA-graph capture must end joined). On the CPU there are no streams:
both run inline.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SideStreams:
    """The two side streams of each device (`predict`: gate scores and prefetch decisions; `copy`:
    prefetch copies), the two events each target cache's last prefetch recorded (planned, ready),
    and the two each cache's last `ensure` recorded (decided, copied).

    Owned by this module: a custom op sees only tensors, so it finds a cache's event by the address
    of one of the cache's buffers, which never changes (buffers are allocated once)."""

    def __init__(self):
        self.streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self.events: dict[tuple[str, int], torch.cuda.Event] = {}

    def stream(self, device: torch.device, kind: str = "predict") -> torch.cuda.Stream:
        key = (kind, device.index)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device)
        return self.streams[key]

    def planned(self, target: Tensor) -> torch.cuda.Event:
        """The event of the last prefetch into the cache whose `expert_to_slot` is `target`: its
        tables are written."""
        return self._event("planned", target)

    def ready(self, target: Tensor) -> torch.cuda.Event:
        """The event of the last prefetch into the cache whose `expert_to_slot` is `target`: its
        copies are made."""
        return self._event("ready", target)

    def read(self, gate: Tensor) -> torch.cuda.Event:
        """The event of the last gate scoring into `gate`: its input has been read."""
        return self._event("read", gate)

    def mark(self, kind: str, routed: Tensor) -> None:
        """Record the event `kind` of an `ensure` (`decided`: its tables are written; `copied`: its
        copies are made) on the current stream, for the cache whose `routed` is `routed`. Only this
        creates those events, so `fork` and `copier` know by their existence that an `ensure` has
        recorded them."""
        self._event(kind, routed).record()

    def fork(self, device: torch.device, source: Tensor | None = None) -> torch.cuda.Stream:
        """The side stream, made to wait for the work queued so far on the current stream, or, given
        the `routed` of a cache whose `ensure` has run, only for that `ensure`'s decision (its
        copies may still run)."""
        side = self.stream(device)
        if source is not None and ("decided", source.data_ptr()) in self.events:
            side.wait_event(self._event("decided", source))
        else:
            side.wait_stream(torch.cuda.current_stream())
        return side

    def copier(
        self, target: Tensor, source: Tensor | None, copies: tuple[Tensor, ...]
    ) -> torch.cuda.Stream:
        """The copy stream, made to wait for the prefetch decision into `target` (recorded
        `planned`) and for the copies of `source`'s last `ensure`, if any; the decision's `copies`,
        made on the predict stream, are kept from reuse until the copy stream is done with them."""
        copy = self.stream(target.device, "copy")
        copy.wait_event(self.planned(target))
        if source is not None and ("copied", source.data_ptr()) in self.events:
            copy.wait_event(self._event("copied", source))
        for t in copies:
            t.record_stream(copy)
        return copy

    def _event(self, kind: str, t: Tensor) -> torch.cuda.Event:
        key = (kind, t.data_ptr())
        if key not in self.events:
            self.events[key] = torch.cuda.Event()
        return self.events[key]


SIDE = SideStreams()
