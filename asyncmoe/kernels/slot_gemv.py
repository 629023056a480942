"""Decode's expert matmul from dense slots: out[s] = W[slot[s]] @ x[s], each pair's weights read once.

At decode a layer computes a handful of (token, expert) pairs, and the time is reading the experts' weights
from HBM. The grouped GEMM (`experts._grouped`) first sorts the pairs by slot and counts them, a score of small
launches around its two GEMMs; here one program per (pair, block of outputs) streams its rows of the pair's
matrix and accumulates in float32, with no sort (docs/decisions.md#dense-decode-gemv). Where pairs times blocks
of outputs make fewer than MIN_PROGRAMS programs (few pairs, wide blocks), the inputs are split among programs
too, each writing float32 partial sums that one sum adds: too few programs leave HBM idle. A pair of another
wave (slot -1) reads nothing and gets zeros.

The reference, `slot_gemv_reference`, gathers the pairs' matrices and multiplies in float32; the two differ
only in the order of the sums.
Dims: S pairs, C slots, stored matrix [C, N, K] (out x in), or [C, K, N] (`transposed`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None


def slot_gemv_reference(
    x: torch.Tensor,  # [S, K]
    w: torch.Tensor,  # [C, N, K], or [C, K, N] if transposed
    slots: torch.Tensor,  # [S]; -1: another wave's pair
    transposed: bool,
) -> torch.Tensor:  # [S, N] in x's dtype
    mats = w[slots.clamp(min=0)].float()  # [S, N, K] or [S, K, N]
    if transposed:
        mats = mats.transpose(-2, -1)
    out = torch.bmm(mats, x.float().unsqueeze(-1)).squeeze(-1)
    return torch.where((slots >= 0).unsqueeze(-1), out, 0).to(x.dtype)


if triton is not None:

    @triton.jit
    def _slot_gemv(
        x_ptr,
        w_ptr,
        slot_ptr,
        out_ptr,
        N,
        K,
        K_SPLIT,  # inputs a program sums over: K, or a multiple of BK where the inputs are split
        w_slot,
        w_n,
        w_k,  # strides, in (n, k) coordinates whatever the stored layout
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        k_lo = tl.program_id(2) * K_SPLIT  # this program's share of the inputs, [k_lo, k_hi)
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        slot = tl.load(slot_ptr + pair).to(tl.int64)
        nmask = (n < N) & (slot >= 0)  # another wave's pair: no loads, zeros out
        w_base = w_ptr + tl.maximum(slot, 0) * w_slot
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < k_hi
            w = tl.load(w_base + n[:, None] * w_n + k[None, :] * w_k, mask=nmask[:, None] & kmask[None, :], other=0.0)
            xs = tl.load(x_ptr + pair * K + k, mask=kmask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
        out = out_ptr + (tl.program_id(2) * tl.num_programs(0) + pair) * N + n  # out [splits, S, N]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n < N)


# (outputs, inputs) a program takes per step, 8 KB of bf16 in flight: along the contiguous dim of the stored matrix
BLOCKS = {False: (16, 256), True: (128, 32)}
MIN_PROGRAMS = 512  # ~4 an SM on an H200 (132 SMs); fewer split the inputs (docs/decisions.md#dense-decode-gemv)


def slot_gemv_triton(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, transposed: bool) -> torch.Tensor:
    S, K = x.shape
    N, w_n, w_k = (w.shape[2], w.stride(2), w.stride(1)) if transposed else (w.shape[1], w.stride(1), w.stride(2))
    BN, BK = BLOCKS[transposed]
    tiles = S * triton.cdiv(N, BN)
    k_split = BK * triton.cdiv(triton.cdiv(K, BK), triton.cdiv(MIN_PROGRAMS, tiles))  # whole blocks of inputs
    splits = triton.cdiv(K, k_split)
    x = x.to(w.dtype).contiguous()
    out = torch.empty(splits, S, N, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _slot_gemv[(S, triton.cdiv(N, BN), splits)](
        x, w, slots, out, N, K, k_split, w.stride(0), w_n, w_k, BN=BN, BK=BK, num_warps=4
    )
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)


def slot_gemv(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return slot_gemv_triton(x, w, slots, transposed)
    return slot_gemv_reference(x.to(w.dtype), w, slots, transposed)
