"""The CPU worker: a C thread that serves expert requests written to host memory by a producer (the GPU).

The producer writes a request's payload (layer, pairs, tokens, the pairs' token and expert ids, the hidden rows)
into a `Channel`, then bumps its `request` number; the worker, which polls that number without the GIL and never
calls the CUDA driver, computes the pairs' expert outputs into the channel and then stores the same number as
`done` (with an error code, AMC_OK when it computed). The channel's layout is worker.h's; `Channel.submit` and
`Channel.wait` play the producer from Python (tests, and a CPU-only caller).

Dims: P pairs, T tokens, H hidden.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .kernels import DENSE, ERRORS, STATS, ChannelLayout, CpuExperts, Pool, library


def channel_layout(
    max_pairs: int, max_tokens: int, hidden: int, x_dtype: torch.dtype, isa: str = "native"
) -> ChannelLayout:
    """Where a channel of that capacity keeps each field, and its size in bytes (`nbytes`)."""
    if x_dtype not in DENSE:
        raise ValueError(
            f"x_dtype={x_dtype}: the worker reads hidden rows in float32, bfloat16 or float16"
        )
    layout = ChannelLayout()
    if library(isa).amc_channel_layout_init(
        ctypes.byref(layout), max_pairs, max_tokens, hidden, DENSE[x_dtype]
    ):
        raise ValueError(
            f"a channel needs max_pairs, max_tokens >= 0 and hidden > 0, got {max_pairs}, {max_tokens}, {hidden}"
        )
    return layout


class Fields(NamedTuple):
    """A channel's fields as tensors (worker.h says what each holds)."""

    request: torch.Tensor  # int64 [1]
    awake: torch.Tensor  # int64 [1]
    done: torch.Tensor  # int64 [1]
    error: torch.Tensor  # int32 [1]
    detail: torch.Tensor  # int64 [1]
    layer: torch.Tensor  # int32 [1]
    pairs: torch.Tensor  # int32 [1]
    tokens: torch.Tensor  # int32 [1]
    token_ids: torch.Tensor  # int32 [max_pairs]
    expert_ids: torch.Tensor  # int32 [max_pairs]
    x: torch.Tensor  # [max_tokens, H] in x_dtype
    out: torch.Tensor  # float32 [max_pairs, H]


class Channel:
    """The shared request block: `buffer` (uint8, pinned or ordinary host memory, zeroed) and typed views of its
    fields. Capacity: `max_pairs` pairs of `max_tokens` rows of `hidden` values in `x_dtype`. One request is in
    flight at a time: the producer writes the next one only once the last is done."""

    def __init__(
        self,
        max_pairs: int,
        max_tokens: int,
        hidden: int,
        x_dtype: torch.dtype = torch.bfloat16,
        buffer: torch.Tensor | None = None,
        isa: str = "native",
    ):
        self.lib = library(isa)
        layout = channel_layout(max_pairs, max_tokens, hidden, x_dtype, isa)
        if buffer is None:
            buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
        if (
            buffer.dtype != torch.uint8
            or buffer.device.type != "cpu"
            or buffer.numel() < layout.nbytes
        ):
            raise ValueError(
                f"a channel's buffer is a CPU uint8 tensor of at least {layout.nbytes} bytes"
            )
        if buffer.data_ptr() % 64:
            raise ValueError(
                "a channel's buffer must start on a 64-byte boundary (its fields sit on cache lines)"
            )
        self.layout, self.buffer, self.x_dtype, self.seq = layout, buffer, x_dtype, 0
        (
            self.request, self.awake, self.done, self.error, self.detail, self.layer, self.pairs, self.tokens,
            self.token_ids, self.expert_ids, self.x, self.out,
        ) = self.fields(buffer)  # fmt: skip

    def fields(self, buffer: torch.Tensor) -> Fields:
        """Typed views of the channel's fields in `buffer`: this channel's, or a device's view of the same
        memory (a CUDA tensor over the pinned block), through which a kernel writes requests."""
        layout = self.layout

        def view(offset: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            end = offset + dtype.itemsize * math.prod(shape)
            return buffer[offset:end].view(dtype).view(*shape or (1,))

        P, T, H = layout.max_pairs, layout.max_tokens, layout.hidden
        i32, i64 = torch.int32, torch.int64
        return Fields(
            view(layout.request, i64), view(layout.awake, i64), view(layout.done, i64), view(layout.error, i32),
            view(layout.detail, i64), view(layout.layer, i32), view(layout.pairs, i32),
            view(layout.tokens, i32), view(layout.token_ids, i32, P), view(layout.expert_ids, i32, P),
            view(layout.x, self.x_dtype, T, H), view(layout.out, torch.float32, P, H),
        )  # fmt: skip

    def write(
        self, layer: int, token_ids: torch.Tensor, expert_ids: torch.Tensor, x: torch.Tensor
    ) -> None:
        """The payload of the next request (not yet published)."""
        P, T = token_ids.numel(), x.shape[0]
        if P > self.token_ids.numel() or T > self.x.shape[0]:
            raise ValueError(
                f"{P} pairs of {T} tokens: this channel holds {self.token_ids.numel()} of {self.x.shape[0]}"
            )
        self.layer[0], self.pairs[0], self.tokens[0] = layer, P, T
        self.token_ids[:P] = token_ids
        self.expert_ids[:P] = expert_ids
        self.x[:T] = x

    def publish(self, seq: int) -> None:
        """Store `seq` as the request number, after everything written before (a release store)."""
        self.lib.amc_request_publish(self.buffer.data_ptr(), seq)

    def submit(
        self, layer: int, token_ids: torch.Tensor, expert_ids: torch.Tensor, x: torch.Tensor
    ) -> int:
        """Write a request and publish it under the next number; returns that number."""
        self.write(layer, token_ids, expert_ids, x)
        self.seq += 1
        self.publish(self.seq)
        return self.seq

    def wait(self, seq: int, timeout: float = 5.0) -> int:
        """Wait (without the GIL) until request `seq` is done: its error code (0: computed; ERRORS says what the
        others mean). Raises TimeoutError after `timeout` seconds."""
        err = self.lib.amc_done_wait(self.buffer.data_ptr(), seq, int(timeout * 1e9))
        if err < 0:
            raise TimeoutError(
                f"CPU worker: request {seq} not done after {timeout} s (done is {int(self.done)})"
            )
        return err

    def result(self, seq: int, timeout: float = 5.0) -> torch.Tensor:
        """The outputs [P, H] float32 of request `seq` (a view of the channel, valid until the next request);
        raises if the worker refused the request."""
        err = self.wait(seq, timeout)
        if err:
            raise ValueError(
                f"CPU worker refused request {seq}: {ERRORS[err].format(detail=int(self.detail))}"
            )
        return self.out[: int(self.pairs)]


class Worker:
    """A C thread serving `channel`'s requests for `layers` (index = the request's layer; None: a layer the CPU
    never serves), computing them on `pool` (the worker's thread is its thread 0), which other workers and in-line
    callers may share: they take turns.

    While idle it polls with a pause instruction for `idle_spin_ms`, then sleeps `idle_sleep_us` between polls
    (a request then waits up to that long). The pool's threads spin after each phase, then sleep; a change of the
    channel's `awake` (a call that sent the CPU nothing) keeps the worker polling and wakes the pool to spin again,
    so that the requests of the calls after it do not wait for sleeping threads.
    `close()` stops and joins it; so do garbage collection and interpreter exit. The channel's buffer, the
    layers' tensors and the pool stay alive until then."""

    def __init__(
        self,
        channel: Channel,
        layers: Sequence[CpuExperts | None],
        pool: Pool,
        idle_spin_ms: float = 20.0,
        idle_sleep_us: float = 50.0,
    ):
        lib, H = channel.lib, channel.layout.hidden
        if pool.handle is None or pool.lib is not lib:
            raise ValueError("a worker computes on an open Pool of its channel's build (isa)")
        handle = lib.amc_worker_create(
            channel.buffer.data_ptr(), ctypes.byref(channel.layout), len(layers), pool.handle,
            int(idle_spin_ms * 1e6), int(idle_sleep_us * 1e3),
        )  # fmt: skip
        if not handle:
            raise MemoryError("could not allocate a CPU worker")
        # the finalizer holds what the thread reads, so none of it is freed before the thread is joined
        self._close = weakref.finalize(
            self, _destroy, lib, handle, (channel.buffer, list(layers), pool)
        )
        for i, layer in enumerate(layers):
            if layer is None:
                continue
            if layer.hidden != H:
                self.close()
                raise ValueError(
                    f"layer {i} has hidden size {layer.hidden}; the channel's rows hold {H}"
                )
            if rc := lib.amc_worker_set_layer(handle, i, ctypes.byref(layer._descriptor)):
                self.close()
                raise ValueError(f"layer {i}: the kernels refused its descriptor (check {rc})")
        if lib.amc_worker_start(handle):
            self.close()
            raise MemoryError(
                f"could not start the CPU worker thread (workspace for {channel.layout.max_pairs} pairs)"
            )
        self.channel, self.pool = channel, pool
        self.handle, self.num_layers = handle, len(layers)

    def stats(self, reset: bool = False) -> torch.Tensor:
        """int64 [layers, len(STATS)]: what each layer's requests computed, counted by the worker (then zeroed
        where `reset`)."""
        if not self._close.alive:
            raise ValueError("this Worker was closed: its counters went with it")
        out = torch.zeros(self.num_layers, len(STATS), dtype=torch.int64)
        self.channel.lib.amc_worker_stats(self.handle, out.data_ptr(), int(reset))
        return out

    def sleeping(self) -> int:
        """How many of the pool's threads sleep now, rather than spin for the next task."""
        if not self._close.alive:
            raise ValueError("this Worker was closed: its pool went with it")
        return self.channel.lib.amc_worker_sleeping(self.handle)

    def close(self) -> None:
        """Stop the thread and join it (idempotent)."""
        self._close()


def _destroy(lib, handle, keepalive) -> None:
    lib.amc_worker_destroy(handle)
