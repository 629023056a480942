"""The GPU's side of the channel: Triton kernels that send a layer's pairs to the CPU worker and
take its outputs back, from inside a captured step.

`send` writes the request's payload (layer, pairs, tokens, each pair's token and expert id, the
hidden rows) into the pinned channel through its device view; once every thread's stores are made,
one system-scope fence, then the next request number: the worker, polling that number, sees the
payload. A fence waits behind the link's copies, so there is one, not two (a release store is
another). The number lives on the device (`seq`), so a replayed graph sends 1, 2, 3, ... without
the host. A request whose pairs are all skipped (expert -1: the hybrid's split gave the CPU nothing)
is neither written nor published, and the combining `receive` then reads nothing over the link:
such a call pays no round trip and no system-scope fence or load, which can wait behind a prefetch's
copies on the link. It only changes the channel's `awake` word, which keeps the worker's pool awake
for the calls after it. `publish` is the send's body, which the hybrid's split kernel calls too.

`receive` spins on the worker's `done` with system-scope acquire loads until it holds that number
(with DONE_REFUSED where the worker refused it, so that a request served needs no second load), then
copies the outputs to the GPU, or (the hybrid) weights and sums each token's pairs, the CPU's and the
GPU's, into the layer's output. It never hangs: after `timeout_ns` on the GPU clock it records
what it waited for in `fault` (pinned: the host reads it after the error) and traps, which ends the
CUDA context with an error at the host's next sync, so no forward returns a result computed without
the CPU's outputs. A request the worker refused (its error code) traps the same way. It also adds the
ns it waited to the layer's counters.

Dims: T tokens, k experts a token, P = T*k pairs, H hidden.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import gpu
from ...gpu import pointers

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux: triton is a Linux-only dependency
    triton = None

if triton is not None:
    from ...cache.clock import _now

# fault [4]: the request number, its layer, what was seen (`done`, or the worker's error code), why
FAULT_SEQ, FAULT_LAYER, FAULT_SEEN, FAULT_KIND = range(4)
TIMED_OUT, REFUSED = 1, 2
# set in `done` beside the request number where the worker refused the request (worker.h's AMC_REFUSED)
DONE_REFUSED = 1 << 62
# waited [layers, 2]: requests received, ns the GPU waited for them
WAITS, WAITED_NS = 0, 1
BLOCK = 1024
COMBINE_BLOCK = 256  # a token's [H] row over several programs: the CPU's rows read by many at once
RECEIVE_PROGRAMS = 32  # enough loads in flight to read the outputs over the link in a few us
# what the kernels take of a channel's fields (worker.Fields): their parameters `chan_<field>_ptr`,
# bound by name; the send's (and the hybrid's split kernel's), then the receive's
SENT = ("request", "awake", "layer", "token_ids", "expert_ids", "x")
RECEIVED = ("done", "error", "out")

if triton is not None and gpu.interpreted():
    # Triton interprets the kernels on the host (the CPU tests): one program at a time, its stores in
    # program order (x86), on the channel's own memory, beside the worker thread.

    @triton.jit
    def _fence_system():
        return 0

    @triton.jit
    def _store_relaxed(ptr, value):
        tl.store(ptr, value)

    @triton.jit
    def _load_acquire(ptr):
        return tl.load(ptr, volatile=True)

    @triton.jit
    def _trap():
        raise RuntimeError("trap: a CPU request failed (its fault says why)")

elif triton is not None:

    @triton.jit
    def _fence_system():
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _store_relaxed(ptr, value):
        tl.inline_asm_elementwise(
            "st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0;",
            "=r,l,l",
            [ptr, value],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _load_acquire(ptr):
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];",
            "=l,l",
            [ptr],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _trap():
        tl.inline_asm_elementwise(
            "trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


if triton is not None:
    _FAULT_SEQ, _FAULT_LAYER = tl.constexpr(FAULT_SEQ), tl.constexpr(FAULT_LAYER)
    _FAULT_SEEN, _FAULT_KIND = tl.constexpr(FAULT_SEEN), tl.constexpr(FAULT_KIND)
    _TIMED_OUT, _REFUSED = tl.constexpr(TIMED_OUT), tl.constexpr(REFUSED)
    _WAITS, _WAITED_NS = tl.constexpr(WAITS), tl.constexpr(WAITED_NS)

    @triton.jit
    def _fault(fault_ptr, seq, layer, seen, kind):
        """Record what the wait was for, give the writes a millisecond to reach the host (a trap can
        drop those still on their way), and end the context."""
        tl.store(fault_ptr + _FAULT_SEQ, seq)
        tl.store(fault_ptr + _FAULT_LAYER, layer)
        tl.store(fault_ptr + _FAULT_SEEN, seen)
        tl.store(fault_ptr + _FAULT_KIND, kind)
        _fence_system()
        start = _now()
        while _now() - start < 1_000_000:
            _fence_system()
        _trap()

    @triton.jit
    def _cpu_pairs(ids_ptr, P, BLOCK: tl.constexpr):
        """How many of the P pairs name an expert (the others, -1, stay on the GPU)."""
        offs = tl.arange(0, BLOCK)
        active = 0
        for p0 in range(0, P, BLOCK):
            p = p0 + offs
            active += tl.sum((tl.load(ids_ptr + p, mask=p < P, other=-1) >= 0).to(tl.int32))
        return active

    @triton.jit
    def publish(
        x_ptr,  # [T, H], the rows of this request
        ids,  # [BP] expert ids of pairs p (-1: not the CPU's)
        p,  # [BP] pair offsets
        seq_ptr,  # int64 [1] on the device: the last request number sent
        request_ptr,
        awake_ptr,
        header_ptr,  # int32 [3] at the channel's `layer`: layer, pairs, tokens
        token_ids_ptr,
        expert_ids_ptr,
        chan_x_ptr,
        layer,
        T,
        k,
        H,
        BLOCK: tl.constexpr,
    ):
        """Write pairs `ids` of rows `x` into the channel as the next request and publish it; one
        with no pair for the CPU only stores the `awake` word. One program."""
        P = T * k
        # every thread reads the number before any writes it (the barrier below): all publish the same one
        seq = tl.load(seq_ptr) + 1
        ids = tl.where(p < P, ids, -1)
        # none for the CPU: nothing crosses the link, as a system fence can wait behind copies there
        if tl.sum((ids >= 0).to(tl.int32)) > 0:
            tl.store(token_ids_ptr + p, (p // k).to(tl.int32), mask=p < P)
            tl.store(expert_ids_ptr + p, ids.to(tl.int32), mask=p < P)
            offs = tl.arange(0, BLOCK)
            for i0 in range(0, T * H, BLOCK):
                i = i0 + offs
                tl.store(chan_x_ptr + i, tl.load(x_ptr + i, mask=i < T * H), mask=i < T * H)
            tl.store(header_ptr, layer)
            tl.store(header_ptr + 1, P)
            tl.store(header_ptr + 2, T)
            tl.debug_barrier()  # every thread's payload stores are made ...
            _fence_system()  # ... and, by this cumulative fence, reach host memory before the number
            tl.store(seq_ptr, seq)
            _store_relaxed(request_ptr, seq)
        else:  # no fence: the worker need only see it soon, to wake its pool for the calls after this one
            _store_relaxed(awake_ptr, _now())

    @triton.jit
    def _send_kernel(
        x_ptr, ids_ptr, seq_ptr, layer, T, k, H,
        # the channel's (SENT, by name)
        chan_request_ptr, chan_awake_ptr, chan_layer_ptr, chan_token_ids_ptr, chan_expert_ids_ptr, chan_x_ptr,
        BP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        p = tl.arange(0, BP)
        ids = tl.load(ids_ptr + p, mask=p < T * k, other=-1)
        publish(
            x_ptr, ids, p, seq_ptr, chan_request_ptr, chan_awake_ptr, chan_layer_ptr, chan_token_ids_ptr,
            chan_expert_ids_ptr, chan_x_ptr, layer, T, k, H, BLOCK,
        )  # fmt: skip

    @triton.jit
    def _receive_kernel(
        seq_ptr,
        out_ptr,  # float32 [P, H] on the GPU; COMBINE: [T, H] in the model's dtype
        ids_ptr,  # COMBINE: [P] the CPU's expert ids (-1: the GPU's pair)
        gpu_out_ptr,  # COMBINE: [P, H] the GPU's outputs
        weights_ptr,  # COMBINE: [P] the pairs' router weights
        fault_ptr,
        waited_ptr,  # int64 [layers, 2]
        layer,
        n,  # elements of out
        H,
        timeout_ns,
        # the channel's (RECEIVED, by name)
        chan_done_ptr,
        chan_error_ptr,
        chan_out_ptr,  # float32 [P, H]
        K: tl.constexpr,  # COMBINE: experts a token
        BLOCK: tl.constexpr,
        COMBINE: tl.constexpr,
        ROUND: tl.constexpr,  # COMBINE: a pair's output times its weight is in gpu_out's dtype
    ):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        # combining a call whose pairs all stayed on the GPU: no request was sent, nothing to wait for
        asked = _cpu_pairs(ids_ptr, n // H * K, BLOCK) > 0 if COMBINE else True
        if asked:
            seq = tl.load(seq_ptr)
            start = _now()
            done = _load_acquire(chan_done_ptr)
            while done < seq:
                if _now() - start > timeout_ns:
                    _fault(fault_ptr, seq, layer, done, _TIMED_OUT)
                done = _load_acquire(chan_done_ptr)
            # DONE_REFUSED set: only then is `error` read, one more trip over the link
            if done != seq:
                _fault(
                    fault_ptr,
                    seq,
                    layer,
                    tl.load(chan_error_ptr, volatile=True).to(tl.int64),
                    _REFUSED,
                )
            if pid == 0:
                count = waited_ptr + layer * 2
                tl.store(count + _WAITS, tl.load(count + _WAITS) + 1)
                tl.store(count + _WAITED_NS, tl.load(count + _WAITED_NS) + (_now() - start))
        offs = tl.arange(0, BLOCK)
        for i0 in range(pid * BLOCK, n, programs * BLOCK):
            i = i0 + offs
            if COMBINE:  # as compute.experts.combine does; the link is read only for the CPU's rows
                row, h = i // H, i % H
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(K):
                    pair = row * K + j
                    on_cpu = tl.load(ids_ptr + pair, mask=i < n, other=-1) >= 0
                    at = pair * H + h
                    cpu = tl.load(
                        chan_out_ptr + at, mask=(i < n) & on_cpu, other=0.0, volatile=True
                    )
                    gpu = tl.load(gpu_out_ptr + at, mask=(i < n) & ~on_cpu, other=0.0)
                    value = tl.where(on_cpu, cpu.to(gpu_out_ptr.dtype.element_ty), gpu)
                    w = tl.load(weights_ptr + pair, mask=i < n, other=0.0)
                    weighted = value.to(tl.float32) * w.to(tl.float32)
                    if ROUND:
                        weighted = weighted.to(gpu_out_ptr.dtype.element_ty).to(tl.float32)
                    acc += weighted
                if ROUND:
                    acc = acc.to(gpu_out_ptr.dtype.element_ty)
                tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < n)
            else:
                tl.store(
                    out_ptr + i, tl.load(chan_out_ptr + i, mask=i < n, volatile=True), mask=i < n
                )


def send(x: torch.Tensor, ids: torch.Tensor, seq: torch.Tensor, gpu, layer: int) -> None:
    """Write rows `x` [T, H] and their expert ids [T, k] as the next request of `layer` into the
    channel whose device-side fields are `gpu` (worker.Fields), and publish it."""
    T, k = ids.shape
    _send_kernel[(1,)](
        x, ids, seq, layer, T, k, x.shape[1], **pointers(gpu, SENT, "chan_"),
        BP=triton.next_power_of_2(max(T * k, 2)), BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip


class Combine(NamedTuple):
    """What `receive` combines the CPU's outputs with: `ids` [T, k] (the CPU's expert ids, -1: the
    GPU's pair), the GPU's outputs `gpu_out` [T*k, H] and the router's `weights` [T, k]."""

    ids: torch.Tensor
    gpu_out: torch.Tensor
    weights: torch.Tensor


def receive(
    seq: torch.Tensor,
    gpu,
    out: torch.Tensor,
    fault: torch.Tensor,
    waited: torch.Tensor,
    layer: int,
    timeout_ns: int,
    combine: Combine | None = None,
) -> None:
    """Wait for the last request sent, then copy its outputs into `out` [P, H] float32; or, with
    `combine`, fill `out` [T, H] with each token's pairs weighted and summed, as
    `compute.experts.combine` does, the CPU's outputs (rounded to gpu_out's dtype) where ids name
    an expert and gpu_out's rows elsewhere."""
    n = out.numel()
    if combine is None:
        ids = gpu_out = weights = out
        k, block, rounded = 1, BLOCK, False
    else:
        ids, gpu_out, weights = combine
        k, block = ids.shape[1], COMBINE_BLOCK
        rounded = torch.promote_types(gpu_out.dtype, weights.dtype) != torch.float32
    programs = max(1, min(RECEIVE_PROGRAMS, triton.cdiv(n, block)))
    _receive_kernel[(programs,)](
        seq, out, ids, gpu_out, weights, fault, waited, layer, n, out.shape[1], timeout_ns,
        **pointers(gpu, RECEIVED, "chan_"), K=k, BLOCK=block, COMBINE=combine is not None, ROUND=rounded,
        num_warps=4, enable_fp_fusion=False,  # a product and its sum rounded apart, as torch's
    )  # fmt: skip
