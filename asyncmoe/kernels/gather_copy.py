"""Copy whole experts from the host store into slots: `slots[dst[i]] = host[src[i]]` for i < count.

M pairs are planned (a static maximum), `count` of them are real, and `count` lives in device
memory: the host never learns it, so the copy can sit inside a CUDA graph and be replayed with
different indices. Reading the source through the UVA view streams host memory over PCIe from the
SMs (~50 GB/s on an H200, Gen5 x16), with no copy engine and no host involvement.

The work is `count` rows cut into 32 KB blocks, handed out grid-stride. By default the grid has a
program per planned block (M rows' worth; those past `count` return at once), the fastest when the
compute waits for the copy anyway. `programs=P` caps the grid: a prefetch running beside the
compute then holds P programs' worth of SMs instead of flooding every SM with copy programs that
the compute stream's kernels would queue behind; a few dozen programs keep enough loads in flight
to fill the link (docs/decisions.md#copy-programs).

Dims: E experts, C slots, M planned copies.
"""

from __future__ import annotations

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
    """Plain torch, fixed shape: moves all M rows and writes back the old contents where i >= count."""
    bits = _BITS[host.element_size()]  # index_copy_ has no fp8 kernels; copying bits is the same copy
    host, slots = host.view(bits), slots.view(bits)
    valid = torch.arange(src.numel(), device=src.device) < count
    valid = valid.view(-1, *([1] * (slots.dim() - 1)))
    rows = torch.where(valid, host.index_select(0, src), slots.index_select(0, dst))
    slots.index_copy_(0, dst, rows)


if triton is not None:

    @triton.jit
    def _gather_copy_kernel(
        src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, count_ptr, row_elems, row_blocks, BLOCK: tl.constexpr
    ):
        work = tl.load(count_ptr) * row_blocks  # blocks to move: row i's blocks are i*row_blocks ...
        for w in range(tl.program_id(0), work, tl.num_programs(0)):
            pair = w // row_blocks
            s = tl.load(src_idx_ptr + pair).to(tl.int64)
            d = tl.load(dst_idx_ptr + pair).to(tl.int64)
            offs = (w % row_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_elems
            x = tl.load(src_ptr + s * row_elems + offs, mask=mask)
            tl.store(dst_ptr + d * row_elems + offs, x, mask=mask)


BLOCK_BYTES = 32768  # per block; 12.6 MB experts -> ~400 blocks each (docs/decisions.md#gather-copy-blocks)
NUM_WARPS = 4


def _word_dtype(row_bytes: int) -> torch.dtype:
    """Widest integer that tiles the row, so each thread moves 8 bytes at a time when it can."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def gather_copy_triton(host, slots, src, dst, count, programs: int | None = None) -> None:
    row_bytes = slots[0].numel() * slots.element_size()
    word = _word_dtype(row_bytes)
    row_elems = row_bytes // word.itemsize
    block = BLOCK_BYTES // word.itemsize
    row_blocks = triton.cdiv(row_elems, block)
    grid = (min(src.numel() * row_blocks, programs or src.numel() * row_blocks),)
    _gather_copy_kernel[grid](
        host.view(host.shape[0], -1).view(word),
        slots.view(slots.shape[0], -1).view(word),
        src,
        dst,
        count.reshape(1),
        row_elems,
        row_blocks,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )


def gather_copy(host, slots, src, dst, count, programs: int | None = None) -> None:
    """The copy the cache uses: the Triton kernel on CUDA, the reference elsewhere."""
    if slots.is_cuda and triton is not None:
        gather_copy_triton(host, slots, src, dst, count, programs)
    else:
        gather_copy_reference(host, slots, src, dst, count)
