"""Decode's expert matmul from fp8 slots: out[s] = dequantize(W[slot[s]]) @ x[s], each weight byte
read once.

At decode a layer computes a handful of (token, expert) pairs, and the time is reading the experts'
weights from HBM: one program per (pair, block of outputs) streams its rows of the pair's fp8
matrix, scales each element by its block's scale, rounds to the activations' dtype (as the
reference's dequantized weight is) and accumulates in float32. Nothing is dequantized to memory.

The reference, `fp8_gemv_reference`, dequantizes the pairs' experts with `formats.dequantize_fp8`,
then multiplies in float32. They differ only in the order of the sums. Dims: S pairs, C slots,
stored matrix [R, Q] ([N, K] out x in; `transposed`: [K, N]), N outputs, K inputs.
"""

from __future__ import annotations

import torch

from ..formats import dequantize_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None


def fp8_gemv_reference(
    x: torch.Tensor,  # [S, K]
    w: torch.Tensor,  # [C, R, Q] fp8
    scale: torch.Tensor,  # [C, Rb, Qb] float32
    slots: torch.Tensor,  # [S] slot of each pair; -1 (another wave's pair) computes on slot 0
    block: tuple[int, int],
    transposed: bool,
) -> torch.Tensor:  # [S, N] in x's dtype
    idx = slots.clamp(min=0)
    dense = dequantize_fp8(w[idx], scale[idx], block, x.dtype)  # [S, R, Q]
    if transposed:
        dense = dense.transpose(-2, -1)  # [S, N, K]
    return torch.bmm(dense.float(), x.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)


if triton is not None:

    @triton.jit
    def _fp8_gemv(
        x_ptr,
        w_ptr,
        scale_ptr,
        slot_ptr,
        out_ptr,
        N,
        K,
        w_slot,
        w_n,
        w_k,
        s_slot,
        s_n,
        s_k,  # strides, in (n, k) coordinates whatever the stored layout
        BLOCK_SN: tl.constexpr,
        BLOCK_SK: tl.constexpr,  # the scale block, in (n, k) coordinates
        BN: tl.constexpr,
        BK: tl.constexpr,
        # scales a row of a step: BK // BLOCK_SK where the scale block divides BK, 1 where BK divides it;
        # 0: neither (a block not a power of two), a scale loaded for every weight
        G: tl.constexpr,
    ):
        pair = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        slot = tl.maximum(tl.load(slot_ptr + pair), 0).to(tl.int64)
        w_base = w_ptr + slot * w_slot
        s_base = scale_ptr + slot * s_slot
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            mask = nmask[:, None] & kmask[None, :]
            q = tl.load(w_base + n[:, None] * w_n + k[None, :] * w_k, mask=mask, other=0.0).to(
                tl.float32
            )
            if G > 0:  # each scale loaded once a step, applied to its block of the row
                g = k0 // BLOCK_SK + tl.arange(0, G)
                gmask = nmask[:, None] & (g[None, :] * BLOCK_SK < K)
                sc = tl.load(
                    s_base + (n[:, None] // BLOCK_SN) * s_n + g[None, :] * s_k,
                    mask=gmask,
                    other=0.0,
                )  # [BN, G]
                q = tl.reshape(tl.reshape(q, (BN, G, BK // G)) * sc[:, :, None], (BN, BK))
            else:
                q *= tl.load(
                    s_base + (n[:, None] // BLOCK_SN) * s_n + (k[None, :] // BLOCK_SK) * s_k,
                    mask=mask,
                    other=0.0,
                )
            # the dequantized weight, as the reference's
            weight = q.to(x_ptr.dtype.element_ty).to(tl.float32)
            xs = tl.load(x_ptr + pair * K + k, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(weight * xs[None, :], axis=1)
        tl.store(out_ptr + pair * N + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


BN, BK = 16, 256  # a program's outputs and the inputs per step: 4 KB of fp8 weights in flight


def fp8_gemv_triton(x, w, scale, slots, block, transposed) -> torch.Tensor:
    S, K = x.shape
    if transposed:  # stored [K, N]: n walks the columns, k the rows
        N, w_n, w_k, s_n, s_k, block_sn, block_sk = (
            w.shape[2],
            w.stride(2),
            w.stride(1),
            scale.stride(2),
            scale.stride(1),
            block[1],
            block[0],
        )
    else:
        N, w_n, w_k, s_n, s_k, block_sn, block_sk = (
            w.shape[1],
            w.stride(1),
            w.stride(2),
            scale.stride(1),
            scale.stride(2),
            block[0],
            block[1],
        )
    x = x.contiguous()
    out = torch.empty(S, N, dtype=x.dtype, device=x.device)
    _fp8_gemv[(S, triton.cdiv(N, BN))](
        x,
        w,
        scale,
        slots,
        out,
        N,
        K,
        w.stride(0),
        w_n,
        w_k,
        scale.stride(0),
        s_n,
        s_k,
        BLOCK_SN=block_sn,
        BLOCK_SK=block_sk,
        BN=BN,
        BK=BK,
        G=BK // block_sk if BK % block_sk == 0 else (1 if block_sk % BK == 0 else 0),
        num_warps=4,
    )
    return out


def fp8_gemv(x, w, scale, slots, block, transposed) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return fp8_gemv_triton(x, w, scale, slots, block, transposed)
    return fp8_gemv_reference(x, w, scale, slots, block, transposed)
