"""A prompt's expert matmuls from 4-bit slots: out = x @ dequantize(W[slot])^T for rows grouped by
slot.

A prompt routes many tokens to each expert, so the pairs are sorted by slot (as for `grouped_mm`)
and each program computes a tile of one slot's rows by a tile of outputs: it loads the slot's packed
weight tile by tile with its group scales, dequantizes it in registers, rounds it to the
activations' dtype as the reference does, and multiplies with `tl.dot`, accumulating in float32. No
dequantized weight is written to memory, and each weight byte is read once per tile of rows. fp8
slots are not served here: dequantizing them to bf16 and the grouped GEMM was twice as fast at every
size measured (docs/decisions.md#quantized-matmul-by-pairs-per-slot).

The reference, `dequant_mm_reference`, dequantizes each slot with the format's plain-torch
definition and multiplies its rows in float32. Dims: S rows (pairs, sorted by slot), C slots, N
outputs, K inputs. Slots are stored [C, N, K/2] (two inputs a byte, the even one in the low nibble)
with scales [C, N, K/G]. `offs` [C] int32: the end of each slot's rows (grouped_mm's convention);
rows past offs[-1] are not computed.
"""

from __future__ import annotations

import torch

from ..formats import dequantize_int4, dequantize_mxfp4

try:
    import triton
    import triton.language as tl

    from .gemv4 import nibble_weights
except ImportError:  # non-Linux
    triton = None

from .gemv4 import check_stored_order

KINDS = ("mxfp4", "int4")


def dequant_mm_reference(
    x: torch.Tensor,  # [S, K], rows sorted by slot
    w: torch.Tensor,  # [C, N, K/2] uint8
    scales: torch.Tensor,  # [C, N, K/G]
    offs: torch.Tensor,  # [C] int32 end of each slot's rows
    kind: str,
) -> torch.Tensor:  # [S, N] in x's dtype; rows past offs[-1] are zero
    # [C, N, K]
    dense = (dequantize_mxfp4 if kind == "mxfp4" else dequantize_int4)(w, scales, x.dtype)
    out = x.new_zeros(x.shape[0], dense.shape[1])
    start = 0
    # a host sync: the reference runs eagerly, off the GPU and any graph
    for c, end in enumerate(offs.tolist()):
        out[start:end] = (x[start:end].float() @ dense[c].float().T).to(x.dtype)
        start = end
    return out


def tiles(offs: torch.Tensor, rows: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row tile's slot and first row, for a launch of `rows // tile + C` tiles (the most any
    split of `rows` rows over C slots needs); a tile past the last gets slot C. Tensor ops only: no
    host sync."""
    C = offs.shape[0]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per_slot = (ends - starts + tile - 1) // tile  # [C]
    last = per_slot.cumsum(0)  # [C] end of each slot's tiles
    t = torch.arange(rows // tile + C, device=offs.device)
    slot = torch.searchsorted(last, t, right=True)  # [T]; C past the last tile
    safe = slot.clamp(max=C - 1)
    first = starts[safe] + (t - (last[safe] - per_slot[safe])) * tile
    return slot.to(torch.int32), first.to(torch.int32)


if triton is not None:

    @triton.jit
    def _dot(acc, xs, wt, IEEE: tl.constexpr):  # [BM, BK] x [BN, BK] -> acc [BM, BN]
        if IEEE:
            return acc + tl.dot(xs, tl.trans(wt), input_precision="ieee")
        return acc + tl.dot(xs, tl.trans(wt))

    @triton.jit
    def _dequant_mm(
        x_ptr,
        w_ptr,
        scale_ptr,
        offs_ptr,
        tile_slot_ptr,
        tile_row_ptr,
        out_ptr,
        C,
        N,
        K,
        w_slot,
        w_n,
        s_slot,
        s_n,  # strides of the packed bytes [C, N, K/2] and the scales [C, N, K/G]
        MXFP4: tl.constexpr,  # else int4
        GROUP: tl.constexpr,
        IEEE: tl.constexpr,  # float32 activations: exact products, not tf32
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(tile_slot_ptr + t)
        if slot < C:
            end = tl.load(offs_ptr + slot)
            rows = tl.load(tile_row_ptr + t) + tl.arange(0, BM)
            rmask = rows < end
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nmask = n < N
            w_base = w_ptr + slot.to(tl.int64) * w_slot
            s_base = scale_ptr + slot.to(tl.int64) * s_slot
            dtype = x_ptr.dtype.element_ty
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):  # byte b holds inputs 2b (low nibble) and 2b + 1
                b = k0 // 2 + tl.arange(0, BK // 2)
                bmask = b < K // 2
                mask = nmask[:, None] & bmask[None, :]
                byte = tl.load(w_base + n[:, None] * w_n + b[None, :], mask=mask, other=0).to(
                    tl.int32
                )
                sc = tl.load(
                    s_base + n[:, None] * s_n + (2 * b[None, :]) // GROUP, mask=mask, other=0
                )
                if MXFP4:  # e8m0: a power of two
                    sc = tl.exp2(sc.to(tl.float32) - 127.0)
                else:
                    sc = sc.to(tl.float32)
                xmask = rmask[:, None] & bmask[None, :]
                for nibble in tl.static_range(2):
                    wt = nibble_weights(byte, sc, nibble, MXFP4, dtype)
                    xs = tl.load(
                        x_ptr + rows[:, None] * K + 2 * b[None, :] + nibble, mask=xmask, other=0.0
                    )
                    acc = _dot(acc, xs, wt, IEEE)
            out = out_ptr + rows[:, None] * N + n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


# a program's rows and outputs, and the inputs a step (tl.dot needs 16 or more of each)
BM, BN, BK = 64, 64, 64


def dequant_mm_triton(x, w, scales, offs, kind: str) -> torch.Tensor:
    check_stored_order("dequant_mm", w, scales)
    S, K = x.shape
    N = w.shape[1]
    x = x.contiguous()
    out = torch.zeros(S, N, dtype=x.dtype, device=x.device)
    tile_slot, tile_row = tiles(offs, S, BM)
    _dequant_mm[(tile_slot.numel(), triton.cdiv(N, BN))](
        x,
        w,
        scales,
        offs,
        tile_slot,
        tile_row,
        out,
        offs.shape[0],
        N,
        K,
        w.stride(0),
        w.stride(1),
        scales.stride(0),
        scales.stride(1),
        MXFP4=kind == "mxfp4",
        GROUP=K // scales.shape[2],
        IEEE=x.dtype == torch.float32,
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=4,
    )
    return out


def dequant_mm(x, w, scales, offs, kind: str) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return dequant_mm_triton(x, w, scales, offs, kind)
    return dequant_mm_reference(x, w, scales, offs, kind)
