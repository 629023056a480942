"""The predictors' work, one launch each instead of a chain of small kernels
(docs/decisions.md#fused-predictors).

Inside a decode step's CUDA graph every kernel costs a few microseconds, however small, and the side
stream's kernels share the GPU with the compute beside them.

Compute stream:
- `gate_scores_triton`: layer l+1's router on layer l's MoE input [T, H] (cuBLAS, as the router
  itself),
  then softmax, each token's top-p and the mean over tokens -> [E] in one program: decode has a
  handful of tokens, and one program keeps the sum over tokens in a fixed order (no atomics), so a
  replayed graph decides as the eager step does.
- `observe_triton`: the transition counts' decay-and-add, one program per row.
Side stream:
- `recorded_scores_triton`: a replayed trace's recorded gate for the tokens from its cursor on,
  scored as the
  gate scores them, in one program (the torch code is ~10 kernels, which the compute stream's join
  then waits for).
- the prefetch's own scores and gate: prefetch_scores.py.

References: `predictors.gate_scores_reference`, `recorded_scores_reference` and `observe_reference`.
The kernels agree with them to rounding: the matmuls and row sums accumulate in another order, and
an update may fuse its multiply-add. Dims: T tokens, H hidden, E experts (target layer), E' experts
(previous layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

# more tokens (prefill) take the torch path: one program would serialise their softmax and top-p
MAX_TOKENS = 64

if triton is not None:

    @triton.jit
    def _gate_scores(
        logits_ptr,
        out_ptr,
        T,
        E,
        stride,
        PER_TOKEN: tl.constexpr,
        BT: tl.constexpr,
        BE: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        emask = e < E
        total = tl.zeros([BE], dtype=tl.float32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            tmask = t < T
            logits = tl.load(
                logits_ptr + t[:, None] * stride + e[None, :],
                mask=tmask[:, None] & emask[None, :],
                other=0.0,
            )
            logits = tl.where(emask[None, :], logits.to(tl.float32), float("-inf"))
            p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            p = p / tl.sum(p, axis=1)[:, None]
            chosen = tl.zeros([BT, BE], dtype=tl.float32)
            left = tl.where(emask[None, :], p, -1.0)
            # top-p by repeated argmax: ties go to the lower expert id
            for _ in tl.static_range(PER_TOKEN):
                top = tl.argmax(left, axis=1)
                pick = e[None, :] == top[:, None]
                chosen = tl.where(pick, p, chosen)
                left = tl.where(pick, -1.0, left)
            total += tl.sum(tl.where(tmask[:, None], chosen, 0.0), axis=0)
        tl.store(out_ptr + e, total / T, mask=emask)

    @triton.jit
    def _recorded_scores(
        ids_ptr,
        probs_ptr,
        cursor_ptr,
        out_ptr,
        T,
        N,
        E,
        ids_row,
        ids_col,
        probs_row,
        probs_col,  # strides
        PER_TOKEN: tl.constexpr,
        BP: tl.constexpr,
        BE: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        j = tl.arange(0, BP)
        jmask = j < PER_TOKEN
        cursor = tl.load(cursor_ptr)
        total = tl.zeros([BE], dtype=tl.float32)
        for t in range(0, T):  # rows from the cursor on, wrapping as the replay does
            row = (cursor + t) % N
            ids = tl.load(ids_ptr + row * ids_row + j * ids_col, mask=jmask, other=-1)
            p = tl.load(probs_ptr + row * probs_row + j * probs_col, mask=jmask, other=0.0).to(
                tl.float32
            )
            total += tl.sum(tl.where(ids[:, None] == e[None, :], p[:, None], 0.0), axis=0)
        tl.store(out_ptr + e, total / T, mask=e < E)

    @triton.jit
    def _observe(previous_ptr, routed_ptr, transitions_ptr, E, DECAY, BE: tl.constexpr):
        row = tl.program_id(0)
        e = tl.arange(0, BE)
        emask = e < E
        before = tl.load(previous_ptr + row).to(tl.float32)
        routed = tl.load(routed_ptr + e, mask=emask, other=0).to(tl.float32)
        counts = tl.load(transitions_ptr + row * E + e, mask=emask, other=0.0)
        tl.store(transitions_ptr + row * E + e, counts * DECAY + before * routed, mask=emask)


def gate_scores_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    per_token: int,
    out: torch.Tensor,
) -> None:
    """x [T, H] with T <= MAX_TOKENS, weight [E, H], bias [E] or None -> out [E] float32."""
    # [T, E], as the router computes them (and the reference)
    logits = F.linear(x.to(weight.dtype), weight, bias)
    T, E = logits.shape
    BE = max(16, triton.next_power_of_2(E))
    _gate_scores[(1,)](
        logits, out, T, E, logits.stride(0), PER_TOKEN=min(per_token, E), BT=16, BE=BE, num_warps=4
    )


def recorded_scores_triton(
    recorded: list[torch.Tensor], tokens: int, per_token: int, out: torch.Tensor
) -> None:
    """`recorded`: (ids [N, g], probs [N, g], cursor [1]) of a replay; tokens <= MAX_TOKENS -> out
    [E] float32."""
    ids, probs, cursor = recorded
    (N, g), E = ids.shape, out.shape[0]
    _recorded_scores[(1,)](
        ids,
        probs,
        cursor,
        out,
        tokens,
        N,
        E,
        *ids.stride(),
        *probs.stride(),
        PER_TOKEN=min(per_token, g),
        BP=triton.next_power_of_2(min(per_token, g)),
        BE=max(16, triton.next_power_of_2(E)),
        num_warps=4,
    )


def observe_triton(
    previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor, decay: float
) -> None:
    """transitions [E', E] = transitions * decay + outer(previous [E'], routed [E]) (bool masks), in
    place."""
    E = routed.shape[0]
    BE = triton.next_power_of_2(E)
    _observe[(previous.shape[0],)](previous, routed, transitions, E, decay, BE=BE, num_warps=1)
