"""Decode's expert matmul from 4-bit slots (mxfp4 or int4): out[s] = dequantize(W[slot[s]]) @ x[s].

As `fp8_gemv`: one program per (pair, block of outputs) streams its rows' packed bytes once, decodes
both nibbles of each byte (e2m1 by its bits, or the integer less 8), scales them by their group's
scale, rounds to the activations' dtype as the reference's dequantized weight is, and accumulates in
float32.

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
    def nibble_weights(byte, sc, nibble: tl.constexpr, MXFP4: tl.constexpr, dtype):
        """The weights in one nibble of each byte (0: low, the even inputs), scaled and rounded to
        `dtype` as the reference's dequantized weight is: e2m1 by its bits, or the integer less
        8."""
        code = (byte >> (4 * nibble)) & 15
        if MXFP4:  # e2m1: sign, 2 exponent bits, 1 mantissa bit
            mag = code & 7
            e = mag >> 1
            m = (mag & 1).to(tl.float32)
            value = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
            value = tl.where(code >= 8, -value, value)
        else:
            value = (code - 8).to(tl.float32)
        return (value * sc).to(dtype)

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
        BK: tl.constexpr,  # BK: inputs a step, even
    ):
        pair = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        slot = tl.maximum(tl.load(slot_ptr + pair), 0).to(tl.int64)
        half = K // 2
        w_base = w_ptr + slot * N * half
        s_base = scale_ptr + slot * N * (K // GROUP)
        acc = tl.zeros([BN], dtype=tl.float32)
        for b0 in range(0, half, BK // 2):
            b = b0 + tl.arange(0, BK // 2)  # byte b holds inputs 2b (low nibble) and 2b + 1
            bmask = b < half
            mask = nmask[:, None] & bmask[None, :]
            byte = tl.load(w_base + n[:, None] * half + b[None, :], mask=mask, other=0).to(tl.int32)
            sc = tl.load(
                s_base + n[:, None] * (K // GROUP) + (2 * b[None, :]) // GROUP, mask=mask, other=0
            )
            if MXFP4:
                sc = tl.exp2(sc.to(tl.float32) - 127.0)
            else:
                sc = sc.to(tl.float32)
            x_type = x_ptr.dtype.element_ty
            for nibble in tl.static_range(2):
                weight = nibble_weights(byte, sc, nibble, MXFP4, x_type).to(tl.float32)
                xs = tl.load(x_ptr + pair * K + 2 * b + nibble, mask=bmask, other=0.0).to(
                    tl.float32
                )
                acc += tl.sum(weight * xs[None, :], axis=1)
        tl.store(out_ptr + pair * N + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


BN, BK = 16, 256  # a program's outputs and the inputs per step: 2 KB of packed weights in flight


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
        BK=BK,
        num_warps=4,
    )
    return out


def gemv4(x, packed, scales, slots, kind: str) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if packed.is_cuda and triton is not None:
        return gemv4_triton(x, packed, scales, slots, kind)
    return gemv4_reference(x, packed, scales, slots, kind)
