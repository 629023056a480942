"""Decode's expert matmul from 4-bit slots (mxfp4 or int4): out[s] = dequantize(W[slot[s]]) @ x[s].

As `fp8_gemv`: one program per (pair, block of outputs) streams its rows' packed bytes once, a few
whole scale groups a step, decodes both nibbles of each byte with integer ops (e2m1 into float32's
bits, or the integer less 8), scales them by their group's scale (decoded once a group), rounds to
the activations' dtype as the reference's dequantized weight is (a no-op, so skipped, for mxfp4 in
bf16 and anything in float32), and accumulates in float32.

The reference, `gemv4_reference`, dequantizes the pairs' experts with the format's plain-torch
definition, then multiplies in float32. Dims: S pairs, C slots, N outputs, K inputs, G inputs per
scale.
"""

from __future__ import annotations

import torch

from ..formats import dequantize_int4, dequantize_mxfp4

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

KINDS = ("mxfp4", "int4")


def gemv4_reference(
    x: torch.Tensor,  # [S, K]
    packed: torch.Tensor,  # [C, N, K/2] uint8
    scales: torch.Tensor,  # [C, N, K/G]: e8m0 uint8 (mxfp4) or bf16 (int4)
    slots: torch.Tensor,  # [S]; -1 (another wave's pair) computes on slot 0
    kind: str,
) -> torch.Tensor:  # [S, N] in x's dtype
    idx = slots.clamp(min=0)
    dequantize = dequantize_mxfp4 if kind == "mxfp4" else dequantize_int4
    dense = dequantize(packed[idx], scales[idx], x.dtype)  # [S, N, K]
    return torch.bmm(dense.float(), x.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)


if triton is not None:

    @triton.jit
    def nibble_values(byte, nibble: tl.constexpr, MXFP4: tl.constexpr):
        """The unscaled values in one nibble of each int32 `byte` (0: low, the even inputs), float32:
        e2m1 built from its bits with integer ops (no exp2), or the integer less 8."""
        code = (byte >> (4 * nibble)) & 15
        if MXFP4:  # sign, 2 exponent bits, 1 mantissa bit -> float32's sign, exponent and mantissa
            mag = code & 7
            # magnitude 1 is the subnormal 0.5; from 2 on the exponent is rebiased by 126
            bits = tl.where(mag < 2, mag * 0x3F000000, (mag << 22) + (126 << 23))
            return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
        return (code - 8).to(tl.float32)

    @triton.jit
    def nibble_weights(byte, sc, nibble: tl.constexpr, MXFP4: tl.constexpr, dtype):
        """The weights in one nibble of each byte, scaled by `sc` (float32) and rounded to `dtype` as
        the reference's dequantized weight is."""
        return (nibble_values(byte, nibble, MXFP4) * sc).to(dtype)

    @triton.jit
    def _gemv4(
        x_ptr,
        w_ptr,
        scale_ptr,
        slot_ptr,
        out_ptr,
        N,
        K,
        MXFP4: tl.constexpr,
        GROUP: tl.constexpr,
        BN: tl.constexpr,
        NG: tl.constexpr,  # groups a step: each row's NG * GROUP / 2 packed bytes
        ROUND: tl.constexpr,  # round each weight to x's dtype (where that is not exact already)
    ):
        pair = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        GB: tl.constexpr = GROUP // 2  # bytes a group
        g, j = tl.arange(0, NG), tl.arange(0, GB)
        slot = tl.maximum(tl.load(slot_ptr + pair), 0).to(tl.int64)
        half, groups = K // 2, K // GROUP
        w_rows = w_ptr + slot * N * half + n[:, None, None] * half  # [BN, 1, 1]
        s_rows = scale_ptr + slot * N * groups + n[:, None] * groups  # [BN, 1]
        x_dtype = x_ptr.dtype.element_ty
        acc = tl.zeros([BN, NG, GB], dtype=tl.float32)
        for g0 in range(0, groups, NG):
            gm = (g0 + g) < groups  # [NG]
            b = (g0 + g)[:, None] * GB + j[None, :]  # [NG, GB]: byte b holds inputs 2b and 2b + 1
            mask = (n < N)[:, None, None] & gm[None, :, None]
            byte = tl.load(w_rows + b[None, :, :], mask=mask, other=0).to(tl.int32)
            sc = tl.load(s_rows + (g0 + g)[None, :], mask=(n < N)[:, None] & gm[None, :], other=0)
            sc = (tl.exp2(sc.to(tl.float32) - 127.0) if MXFP4 else sc.to(tl.float32))[:, :, None]
            for nibble in tl.static_range(2):
                weight = nibble_values(byte, nibble, MXFP4) * sc
                if ROUND:
                    weight = weight.to(x_dtype).to(tl.float32)
                xs = tl.load(x_ptr + pair * K + 2 * b + nibble, mask=gm[:, None], other=0.0)
                acc += weight * xs.to(tl.float32)[None, :, :]
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(out_ptr + pair * N + n, out.to(out_ptr.dtype.element_ty), mask=n < N)


# a program's outputs, and the packed bytes of each of its rows a step (2 KB in flight)
BN, ROW_BYTES = 16, 128


def check_stored_order(kernel: str, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """The 4-bit kernels read packed weights and scales in their stored order: refuse strided
    ones."""
    if not (packed.is_contiguous() and scales.is_contiguous()):
        raise ValueError(
            f"{kernel} reads packed weights and scales in their stored order: pass "
            "contiguous tensors"
        )


def gemv4_triton(x, packed, scales, slots, kind: str) -> torch.Tensor:
    check_stored_order("gemv4", packed, scales)
    S, K = x.shape
    N = packed.shape[1]
    x = x.contiguous()
    out = torch.empty(S, N, dtype=x.dtype, device=x.device)
    group = K // scales.shape[2]
    _gemv4[(S, triton.cdiv(N, BN))](
        x,
        packed,
        scales,
        slots,
        out,
        N,
        K,
        MXFP4=kind == "mxfp4",
        GROUP=group,
        BN=BN,
        NG=max(1, ROW_BYTES // (group // 2)),
        # an e2m1 value (two significant bits) times a power of two is a bf16 as it is, but below
        # bf16's normal range (scales under 2^-126)
        ROUND=x.dtype != torch.float32 and not (kind == "mxfp4" and x.dtype == torch.bfloat16),
        num_warps=4,
    )
    return out


def gemv4(x, packed, scales, slots, kind: str) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if packed.is_cuda and triton is not None:
        return gemv4_triton(x, packed, scales, slots, kind)
    return gemv4_reference(x, packed, scales, slots, kind)
