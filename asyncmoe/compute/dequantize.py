"""Every slot of a quantized projection to the compute dtype, in one launch: the prompt path's first
half (dequantize, then the dense grouped GEMM), whose second half reads the result as bf16.

One program per tile of one slot: 4-bit tiles decode both nibbles of each byte with integer ops
(`gemv4.nibble_weights`) and store them interleaved, so the output keeps the inputs' order; fp8 tiles
take their block's scale. Each product is taken in float32 and rounded once to the output dtype, as
the formats' plain-torch definitions (`formats.py`) do; those are the reference, run a few slots at a
time so their float32 temporaries stay small. Dims: C slots; 4-bit weights [C, N, K/2] with scales
[C, N, K/G] (G inputs a scale) give [C, N, K]; fp8 weights (float8_e4m3fn) [C, R, Q] in the module's
layout with float32 scales [C, ceil(R/br), ceil(Q/bq)] give [C, R, Q].
"""

from __future__ import annotations

import torch

from ..formats import Format, Fp8

try:
    import triton
    import triton.language as tl

    from .gemv4 import nibble_weights
except ImportError:  # non-Linux
    triton = None

from .gemv4 import check_stored_order

KINDS = ("fp8", "mxfp4", "int4")
# float32 temporaries of the reference, per step
REFERENCE_BYTES = 128 * 2**20


def dequantize_reference(
    fmt: Format, w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The format's plain-torch definition, a few slots at a time, in stored order (4-bit [C, N, K],
    fp8 the module's [C, R, Q])."""
    values = w[0].numel() * (2 if w.dtype == torch.uint8 else 1)
    step = max(1, REFERENCE_BYTES // (4 * values))
    parts = [
        fmt.dequantize([w[i : i + step], scales[i : i + step]], dtype, transposed=False)
        for i in range(0, len(w), step)
    ]
    return torch.cat(parts)


if triton is not None:

    @triton.jit
    def _dequantize4(
        w_ptr,
        scale_ptr,
        out_ptr,
        N,
        K,
        MXFP4: tl.constexpr,  # else int4
        GROUP: tl.constexpr,
        BN: tl.constexpr,
        BB: tl.constexpr,  # packed bytes a row a program: 2 * BB outputs
    ):
        c = tl.program_id(2).to(tl.int64)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        b = tl.program_id(1) * BB + tl.arange(0, BB)  # byte b holds inputs 2b (low nibble), 2b + 1
        half, groups = K // 2, K // GROUP
        mask = (n < N)[:, None] & (b < half)[None, :]
        byte = tl.load(
            w_ptr + c * N * half + n[:, None] * half + b[None, :], mask=mask, other=0
        ).to(tl.int32)
        sc = tl.load(
            scale_ptr + c * N * groups + n[:, None] * groups + (2 * b[None, :]) // GROUP,
            mask=mask,
            other=0,
        )
        sc = tl.exp2(sc.to(tl.float32) - 127.0) if MXFP4 else sc.to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        pairs = tl.join(
            nibble_weights(byte, sc, 0, MXFP4, dtype), nibble_weights(byte, sc, 1, MXFP4, dtype)
        )  # [BN, BB, 2]
        k = tl.program_id(1) * 2 * BB + tl.arange(0, 2 * BB)
        tl.store(
            out_ptr + c * N * K + n[:, None] * K + k[None, :],
            tl.reshape(pairs, (BN, 2 * BB)),
            mask=(n < N)[:, None] & (k < K)[None, :],
        )

    @triton.jit
    def _dequantize8(
        w_ptr,
        scale_ptr,
        out_ptr,
        R,
        Q,
        BLOCK_R: tl.constexpr,  # the format's block (rows, columns) a scale
        BLOCK_Q: tl.constexpr,
        BR: tl.constexpr,  # a program's tile
        BQ: tl.constexpr,
    ):
        c = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        q = tl.program_id(1) * BQ + tl.arange(0, BQ)
        mask = (r < R)[:, None] & (q < Q)[None, :]
        x = tl.load(w_ptr + c * R * Q + r[:, None] * Q + q[None, :], mask=mask, other=0.0)
        rb, qb = tl.cdiv(R, BLOCK_R), tl.cdiv(Q, BLOCK_Q)
        sc = tl.load(
            scale_ptr + c * rb * qb + (r // BLOCK_R)[:, None] * qb + (q // BLOCK_Q)[None, :],
            mask=mask,
            other=0.0,
        )
        dense = (x.to(tl.float32) * sc).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + c * R * Q + r[:, None] * Q + q[None, :], dense, mask=mask)


# a program's tile: 4-bit BN4 rows of BB4 bytes (2 * BB4 outputs), fp8 BR8 x BQ8
BN4, BB4 = 16, 128
BR8, BQ8 = 16, 256


def dequantize_triton(
    fmt: Format, w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    check_stored_order("dequantize", w, scales)
    C, rows, cols = w.shape
    if isinstance(fmt, Fp8):
        out = torch.empty(C, rows, cols, dtype=dtype, device=w.device)
        _dequantize8[(triton.cdiv(rows, BR8), triton.cdiv(cols, BQ8), C)](
            w,
            scales,
            out,
            rows,
            cols,
            BLOCK_R=fmt.block[0],
            BLOCK_Q=fmt.block[1],
            BR=BR8,
            BQ=BQ8,
            num_warps=4,
        )
        return out
    K = 2 * cols
    out = torch.empty(C, rows, K, dtype=dtype, device=w.device)
    _dequantize4[(triton.cdiv(rows, BN4), triton.cdiv(cols, BB4), C)](
        w,
        scales,
        out,
        rows,
        K,
        MXFP4=fmt.name == "mxfp4",
        GROUP=K // scales.shape[2],
        BN=BN4,
        BB=BB4,
        num_warps=4,
    )
    return out


def dequantize(fmt: Format, w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return dequantize_triton(fmt, w, scales, dtype)
    return dequantize_reference(fmt, w, scales, dtype)
