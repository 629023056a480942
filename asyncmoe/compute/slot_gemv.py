"""Decode's expert matmul from dense slots: out[s] = W[slot[s]] @ x[s], each pair's weights read
once.

At decode a layer computes a handful of (token, expert) pairs, and the time is reading the experts'
weights from HBM. The grouped GEMM (`experts._grouped`) first sorts the pairs by slot and counts
them, a score of small launches around its two GEMMs; here one program per (pair, block of outputs)
streams its rows of the pair's matrix and accumulates in float32, with no sort
(docs/decisions.md#dense-decode-gemv). A pair of another wave (slot -1) reads nothing and gets
zeros.

The reference, `slot_gemv_reference`, gathers the pairs' matrices and multiplies in float32; the two
differ only in the order of the sums. Experts stored transposed ([in, out], GPT-OSS) are not taken:
through this kernel they read slower than through the grouped GEMM
(docs/decisions.md#dense-decode-gemv). Dims: S pairs, C slots, stored matrix [C, N, K] (out x in).
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
    w: torch.Tensor,  # [C, N, K]
    slots: torch.Tensor,  # [S]; -1: another wave's pair
) -> torch.Tensor:  # [S, N] in x's dtype
    mats = w[slots.clamp(min=0)].float()  # [S, N, K]
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
        w_slot,
        w_n,
        w_k,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        slot = tl.load(slot_ptr + pair).to(tl.int64)
        # another wave's pair: no loads, zeros out. The rows read as a scalar, not `(n < N) & (slot
        # >= 0)`: Triton 3.9's interpreter broadcasts a scalar comparison to its operands' integer
        # type and refuses that as a mask
        nmask = n < tl.where(slot >= 0, N, 0)
        w_base = w_ptr + tl.maximum(slot, 0) * w_slot
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            w = tl.load(
                w_base + n[:, None] * w_n + k[None, :] * w_k,
                mask=nmask[:, None] & kmask[None, :],
                other=0.0,
            )
            xs = tl.load(x_ptr + pair * K + k, mask=kmask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + pair * N + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


# (outputs, inputs) a program takes per step: 8 KB of bf16 in flight, along the rows' contiguous
# inputs
BN, BK = 16, 256


def slot_gemv_triton(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    S, K = x.shape
    N = w.shape[1]
    x = x.to(w.dtype).contiguous()
    out = torch.empty(S, N, dtype=x.dtype, device=x.device)
    _slot_gemv[(S, triton.cdiv(N, BN))](
        x, w, slots, out, N, K, w.stride(0), w.stride(1), w.stride(2), BN=BN, BK=BK, num_warps=4
    )
    return out


def slot_gemv(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if w.is_cuda and triton is not None:
        return slot_gemv_triton(x, w, slots)
    return slot_gemv_reference(x.to(w.dtype), w, slots)
