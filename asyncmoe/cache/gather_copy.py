"""Copy whole experts from the host store into slots: `slots[dst[i]] = host[src[i]]` for i < count,
per tensor.

M pairs are planned (a static maximum), `count` of them are real, and `count` lives in device
memory: the host never learns it, so the copy can sit inside a CUDA graph and be replayed with
different indices. Reading the source through the UVA view streams host memory over PCIe from the
SMs (docs/decisions.md#copies-at-the-links-speed), with no copy engine and no host involvement.

An expert is several tensors (weights and biases, or weights and scales); one launch copies up to
MAX_TENSORS of them, since a call launches its copy even when `count` is 0 (every expert resident)
and each launch is time on the compute stream. The work is `count` experts' tensors cut into 32 KB
blocks, handed out grid-stride. By default the grid has a program per planned block (M experts'
worth; those past `count` return at once), the fastest when the compute waits for the copy anyway.
`programs=P` caps the grid: a prefetch running beside the compute then holds P programs' worth of
SMs instead of flooding every SM with copy programs that the compute stream's kernels would queue
behind; a few dozen programs keep enough loads in flight to fill the link
(docs/decisions.md#copy-programs).

Dims: E experts, C slots, M planned copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux: triton is a Linux-only dependency
    triton = None


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather_copy_reference(
    host: torch.Tensor,  # [E, ...]
    slots: torch.Tensor,  # [C, ...]
    src: torch.Tensor,  # [M] expert ids
    dst: torch.Tensor,  # [M] distinct slot ids
    count: torch.Tensor,  # [] or [1] number of real pairs
) -> None:
    """Plain torch, fixed shape: moves all M rows and writes back the old contents where i >=
    count."""
    # index_copy_ has no fp8 kernels; copying bits is the same copy
    bits = _BITS[host.element_size()]
    host, slots = host.view(bits), slots.view(bits)
    valid = torch.arange(src.numel(), device=src.device) < count
    valid = valid.view(-1, *([1] * (slots.dim() - 1)))
    rows = torch.where(valid, host.index_select(0, src), slots.index_select(0, dst))
    slots.index_copy_(0, dst, rows)


# an expert's tensors one launch copies: weights and biases, or weights and scales, of two
# projections
MAX_TENSORS = 4

if triton is not None:

    @triton.jit
    def _copy_block(host_ptr, slot_ptr, s, d, row_elems, block, BLOCK: tl.constexpr):
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        x = tl.load(host_ptr + s * row_elems + offs, mask=mask)
        tl.store(slot_ptr + d * row_elems + offs, x, mask=mask)

    @triton.jit
    def _gather_copy_kernel(
        src_idx_ptr,
        dst_idx_ptr,
        count_ptr,
        # per tensor: host, slots, row words, blocks
        h0, s0, n0, b0, h1, s1, n1, b1, h2, s2, n2, b2, h3, s3, n3, b3,
        W0: tl.constexpr,  # per tensor: words a block
        W1: tl.constexpr,
        W2: tl.constexpr,
        W3: tl.constexpr,
    ):  # fmt: skip
        per_pair = b0 + b1 + b2 + b3  # a pair's blocks: tensor 0's, then tensor 1's, ...
        work = tl.load(count_ptr) * per_pair
        for w in range(tl.program_id(0), work, tl.num_programs(0)):
            pair = w // per_pair
            r = w % per_pair
            s = tl.load(src_idx_ptr + pair).to(tl.int64)
            d = tl.load(dst_idx_ptr + pair).to(tl.int64)
            if r < b0:
                _copy_block(h0, s0, s, d, n0, r, W0)
            elif r < b0 + b1:
                _copy_block(h1, s1, s, d, n1, r - b0, W1)
            elif r < b0 + b1 + b2:
                _copy_block(h2, s2, s, d, n2, r - b0 - b1, W2)
            else:
                _copy_block(h3, s3, s, d, n3, r - b0 - b1 - b2, W3)


# per block; 12.6 MB experts -> ~400 blocks each (docs/decisions.md#gather-copy-blocks)
BLOCK_BYTES = 32768
NUM_WARPS = 4


def _word_dtype(row_bytes: int) -> torch.dtype:
    """Widest integer that tiles the row, so each thread moves 8 bytes at a time when it can."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def gather_copy_triton(hosts, slots, src, dst, count, programs: int | None = None) -> None:
    """One launch per MAX_TENSORS of the experts' tensors: `hosts` [E, ...] and `slots` [C, ...],
    paired."""
    for i in range(0, len(hosts), MAX_TENSORS):
        _launch(hosts[i : i + MAX_TENSORS], slots[i : i + MAX_TENSORS], src, dst, count, programs)


def _launch(hosts, slots, src, dst, count, programs: int | None) -> None:
    tensors, words = [], []  # per tensor: (host, slots, row words, blocks a row); words a block
    for host, slot in zip(hosts, slots):
        row_bytes = slot[0].numel() * slot.element_size()
        word = _word_dtype(row_bytes)
        row_elems, block = row_bytes // word.itemsize, BLOCK_BYTES // word.itemsize
        rows = (host.view(host.shape[0], -1).view(word), slot.view(slot.shape[0], -1).view(word))
        tensors.append((*rows, row_elems, triton.cdiv(row_elems, block)))
        words.append(block)
    while len(tensors) < MAX_TENSORS:  # unused: no blocks, never read
        tensors.append((*tensors[0][:2], 0, 0))
        words.append(words[0])
    full = src.numel() * sum(t[3] for t in tensors)
    args = [a for t in tensors for a in t]
    _gather_copy_kernel[(min(full, programs or full),)](
        src, dst, count.reshape(1), *args, *words, num_warps=NUM_WARPS
    )


def gather_copy(hosts, slots, src, dst, count, programs: int | None = None) -> None:
    """The copy the cache uses, every tensor of the experts (`hosts`, `slots`: paired lists): the
    Triton kernel on CUDA, the reference elsewhere; none for a cache with no data (the
    simulator)."""
    if slots and slots[0].is_cuda and triton is not None:
        gather_copy_triton(hosts, slots, src, dst, count, programs)
    else:
        for host, slot in zip(hosts, slots):
            gather_copy_reference(host, slot, src, dst, count)


def copy_ns(
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    repeats: int = 5,
    beside: Callable[[], None] | None = None,
) -> float:
    """One expert's host -> slot copy on this GPU, in ns: what a wasted prefetch holds the link for,
    and what the hybrid's cost model charges a miss the link copies. Timed over `repeats` copies
    queued behind a first one, so each launch's host time hides behind the copy before it (an event
    pair around one launch counts that too: docs/decisions.md#runners-up-within-the-window);
    `beside` starts other work first (the hybrid's calibration: a CPU request reading host memory
    too). CUDA events and a sync, at compile only. Slot 0 is written: at compile no table points at
    it."""
    one = torch.ones(1, dtype=torch.int64, device=slots[0].device)
    src, dst = one - 1, one - 1
    gather_copy(hosts, slots, src, dst, one)  # compiles the kernel for these tensors
    torch.cuda.synchronize(one.device)  # at compile only, as the event's below
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if beside is not None:
        beside()
    gather_copy(hosts, slots, src, dst, one)  # the copy the timed ones queue behind
    start.record()
    for _ in range(repeats):
        gather_copy(hosts, slots, src, dst, one)
    end.record()
    end.synchronize()  # at compile only
    return start.elapsed_time(end) / repeats * 1e6
