"""The predictor work that sits on the compute stream, one launch each instead of a chain of small kernels.

Why: inside a decode step's CUDA graph every kernel on the compute stream costs a few µs, however
small. Measured on an H200 (OLMoE shape, cache 32, docs/results/2026-11-30): the gate predictor's
eight kernels added ~33 µs per layer, and the transition update's five, with the rest of the
prefetch, ~31 µs, while the compute stream waited for the side stream only ~7 µs per layer.

- `gate_scores`: layer l+1's router on layer l's MoE input [T, H], softmax, each token's top-p, mean
  over tokens -> [E]. One program: decode has a handful of tokens, and one program keeps the sum
  over tokens in a fixed order (no atomics), so a replayed graph decides as the eager step does.
- `observe`: the transition counts' decay-and-add, one program per row.

References: `predict.predictors.gate_scores` and `cache.expert_cache.observe` (plain torch). The
kernels agree with them to rounding: the router's matmul accumulates in another order than cuBLAS,
and the update may fuse its multiply-add.
Dims: T tokens, H hidden, E experts (target layer), E' experts (previous layer).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

MAX_TOKENS = 64  # more tokens (prefill) take the torch path: one program would serialise their matmuls
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton itself does when a kernel is decorated

if triton is not None:

    @triton.jit
    def _gate_scores(
        x_ptr, w_ptr, b_ptr, out_ptr, T, H, E, x_stride,
        PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        BT: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        emask = e < E
        total = tl.zeros([BE], dtype=tl.float32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            tmask = t < T
            acc = tl.zeros([BT, BE], dtype=tl.float32)
            for h0 in range(0, H, BH):
                h = h0 + tl.arange(0, BH)
                hmask = h < H
                x = tl.load(x_ptr + t[:, None] * x_stride + h[None, :], mask=tmask[:, None] & hmask[None, :], other=0.0)
                w = tl.load(w_ptr + e[None, :] * H + h[:, None], mask=emask[None, :] & hmask[:, None], other=0.0)  # [BH, BE]
                x = x.to(w.dtype)
                if UPCAST:  # exact: products of 16-bit floats fit in fp32
                    acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                elif IEEE:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w, acc)
            if HAS_BIAS:
                acc += tl.load(b_ptr + e, mask=emask, other=0.0).to(tl.float32)[None, :]
            logits = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # F.linear returns the router's dtype
            logits = tl.where(emask[None, :], logits, float("-inf"))
            p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            p = p / tl.sum(p, axis=1)[:, None]
            chosen = tl.zeros([BT, BE], dtype=tl.float32)
            left = tl.where(emask[None, :], p, -1.0)
            for _ in tl.static_range(PER_TOKEN):  # top-p by repeated argmax: ties go to the lower expert id
                top = tl.argmax(left, axis=1)
                pick = e[None, :] == top[:, None]
                chosen = tl.where(pick, p, chosen)
                left = tl.where(pick, -1.0, left)
            total += tl.sum(tl.where(tmask[:, None], chosen, 0.0), axis=0)
        tl.store(out_ptr + e, total / T, mask=emask)

    @triton.jit
    def _observe(previous_ptr, routed_ptr, transitions_ptr, E, DECAY, BE: tl.constexpr):
        row = tl.program_id(0)
        e = tl.arange(0, BE)
        emask = e < E
        before = tl.load(previous_ptr + row).to(tl.float32)
        routed = tl.load(routed_ptr + e, mask=emask, other=0).to(tl.float32)
        counts = tl.load(transitions_ptr + row * E + e, mask=emask, other=0.0)
        tl.store(transitions_ptr + row * E + e, counts * DECAY + before * routed, mask=emask)


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


def gate_scores(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int) -> torch.Tensor:
    """x [T, H] with T <= MAX_TOKENS, weight [E, H], bias [E] or None -> [E] float32."""
    T, H = x.shape
    E = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(E, dtype=torch.float32, device=x.device)
    _gate_scores[(1,)](
        x, weight, bias if bias is not None else weight, out, T, H, E, x.stride(0),
        PER_TOKEN=min(per_token, E), HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32,
        UPCAST=INTERPRET,  # the interpreter's 16-bit tl.dot is wrong (triton 3.8)
        BT=16, BH=64, BE=max(16, triton.next_power_of_2(E)), num_warps=4,
    )
    return out


def observe(previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor, decay: float) -> None:
    """transitions [E', E] = transitions * decay + outer(previous [E'], routed [E]) (bool masks), in place."""
    E = routed.shape[0]
    _observe[(previous.shape[0],)](previous, routed, transitions, E, decay, BE=triton.next_power_of_2(E), num_warps=1)
