"""A prompt's expert matmuls from quantized slots: out = x @ dequantize(W[slot])^T for rows grouped by slot.

A prompt routes many tokens to each expert, so the pairs are sorted by slot (as for `grouped_mm`) and each
program computes a tile of one slot's rows by a tile of outputs: it loads the slot's quantized weight tile by
tile (fp8 with its block scales, or 4-bit bytes with their group scales), dequantizes it in registers, rounds
it to the activations' dtype as the reference does, and multiplies with `tl.dot`, accumulating in float32.
No dequantized weight is written to memory, and each weight byte is read once per tile of rows.

The reference, `dequant_mm_reference`, dequantizes each slot with the format's plain-torch definition and
multiplies its rows in float32. Dims: S rows (pairs, sorted by slot), C slots, N outputs, K inputs.
`offs` [C] int32: the end of each slot's rows (grouped_mm's convention); rows past offs[-1] are not computed.
"""

from __future__ import annotations

import torch

from ..formats import dequantize_fp8, dequantize_int4, dequantize_mxfp4

try:
    import triton
    import triton.language as tl

    from .gemv4 import nibble_weights
except ImportError:  # non-Linux
    triton = None

KINDS = ("fp8", "mxfp4", "int4")


def dequantized(kind: str, w, scales, block: tuple[int, int], transposed: bool, dtype) -> torch.Tensor:
    """Slots [C, ...] as dense [C, N, K] in `dtype`: fp8 in the module's layout, 4-bit always [C, N, K/2]."""
    if kind == "fp8":
        dense = dequantize_fp8(w, scales, block, dtype)
        return dense.transpose(-2, -1) if transposed else dense
    return (dequantize_mxfp4 if kind == "mxfp4" else dequantize_int4)(w, scales, dtype)


def dequant_mm_reference(
    x: torch.Tensor,  # [S, K], rows sorted by slot
    w: torch.Tensor,  # [C, R, Q] fp8, or [C, N, K/2] uint8 (4-bit)
    scales: torch.Tensor,  # fp8: [C, Rb, Qb] float32; 4-bit: [C, N, K/G]
    offs: torch.Tensor,  # [C] int32 end of each slot's rows
    kind: str,
    block: tuple[int, int],
    transposed: bool,
) -> torch.Tensor:  # [S, N] in x's dtype; rows past offs[-1] are zero
    dense = dequantized(kind, w, scales, block, transposed, x.dtype)  # [C, N, K]
    out = x.new_zeros(x.shape[0], dense.shape[1])
    start = 0
    for c, end in enumerate(offs.tolist()):  # a host sync: the reference runs eagerly, off the GPU and any graph
        out[start:end] = (x[start:end].float() @ dense[c].float().T).to(x.dtype)
        start = end
    return out


def tiles(offs: torch.Tensor, rows: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row tile's slot and first row, for a launch of `rows // tile + C` tiles (the most any split of `rows`
    rows over C slots needs); a tile past the last gets slot C. Tensor ops only: no host sync."""
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
    def _weight_fp8(w_base, s_base, n, k, nmask, kmask, w_n, w_k, s_n, s_k, BLOCK_SN, BLOCK_SK, dtype):
        mask = nmask[:, None] & kmask[None, :]
        q = tl.load(w_base + n[:, None] * w_n + k[None, :] * w_k, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(s_base + (n[:, None] // BLOCK_SN) * s_n + (k[None, :] // BLOCK_SK) * s_k, mask=mask, other=0.0)
        return (q * sc).to(dtype)

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
        w_k,
        s_slot,
        s_n,
        s_k,  # strides, in (n, k) coordinates whatever the stored layout (4-bit: bytes and groups)
        KIND: tl.constexpr,  # 0 fp8, 1 mxfp4, 2 int4
        BLOCK_SN: tl.constexpr,
        BLOCK_SK: tl.constexpr,  # fp8: the scale block in (n, k); 4-bit: BLOCK_SK is the group
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
            for k0 in range(0, K, BK):
                if KIND == 0:
                    k = k0 + tl.arange(0, BK)
                    kmask = k < K
                    xs = tl.load(
                        x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
                    )
                    wt = _weight_fp8(w_base, s_base, n, k, nmask, kmask, w_n, w_k, s_n, s_k, BLOCK_SN, BLOCK_SK, dtype)
                    acc = _dot(acc, xs, wt, IEEE)
                else:  # byte b holds inputs 2b (low nibble) and 2b + 1
                    b = k0 // 2 + tl.arange(0, BK // 2)
                    bmask = b < K // 2
                    mask = nmask[:, None] & bmask[None, :]
                    byte = tl.load(w_base + n[:, None] * w_n + b[None, :], mask=mask, other=0).to(tl.int32)
                    sc = tl.load(s_base + n[:, None] * s_n + (2 * b[None, :]) // BLOCK_SK, mask=mask, other=0)
                    if KIND == 1:
                        sc = tl.exp2(sc.to(tl.float32) - 127.0)
                    else:
                        sc = sc.to(tl.float32)
                    xmask = rmask[:, None] & bmask[None, :]
                    for nibble in tl.static_range(2):
                        wt = nibble_weights(byte, sc, nibble, KIND == 1, dtype)
                        xs = tl.load(x_ptr + rows[:, None] * K + 2 * b[None, :] + nibble, mask=xmask, other=0.0)
                        acc = _dot(acc, xs, wt, IEEE)
            out = out_ptr + rows[:, None] * N + n[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


BM, BN, BK = 64, 64, 64  # a program's rows and outputs, and the inputs a step (tl.dot needs 16 or more of each)


def dequant_mm_triton(x, w, scales, offs, kind: str, block: tuple[int, int], transposed: bool) -> torch.Tensor:
    S, K = x.shape
    if kind == "fp8":
        N = w.shape[2] if transposed else w.shape[1]
        (wn, wk), (sn, sk) = ((2, 1), (2, 1)) if transposed else ((1, 2), (1, 2))
        strides = (w.stride(0), w.stride(wn), w.stride(wk), scales.stride(0), scales.stride(sn), scales.stride(sk))
        block_sn, block_sk = (block[1], block[0]) if transposed else block
    else:
        N = w.shape[1]
        strides = (w.stride(0), w.stride(1), w.stride(2), scales.stride(0), scales.stride(1), scales.stride(2))
        block_sn, block_sk = 1, K // scales.shape[2]
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
        *strides,
        KIND=KINDS.index(kind),
        BLOCK_SN=block_sn,
        BLOCK_SK=block_sk,
        IEEE=x.dtype == torch.float32,
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=4,
    )
    return out


def dequant_mm(x, w, scales, offs, kind: str, block: tuple[int, int], transposed: bool) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return dequant_mm_triton(x, w, scales, offs, kind, block, transposed)
    return dequant_mm_reference(x, w, scales, offs, kind, block, transposed)
