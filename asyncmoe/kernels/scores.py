"""The predictors' work, one launch each instead of a chain of small kernels.

Why: inside a decode step's CUDA graph every kernel costs a few µs, however small, and the side
stream's kernels share the GPU with the compute beside them. Measured on an H200 (OLMoE shape,
cache 32, docs/results/2026-11-30): the gate predictor's eight kernels added ~33 µs per layer, and
the transition update's five, with the rest of the prefetch, ~31 µs, while the compute stream
waited for the side stream only ~7 µs per layer.

Compute stream:
- `gate_scores`: layer l+1's router on layer l's MoE input [T, H] (cuBLAS, as the router itself),
  then softmax, each token's top-p and the mean over tokens -> [E] in one program: decode has a
  handful of tokens, and one program keeps the sum over tokens in a fixed order (no atomics), so a
  replayed graph decides as the eager step does. The matmul was in that program too until d86bbbb,
  where one program streaming the router's weights alone (256 KB on OLMoE) took 15.4 µs per launch;
  cuBLAS takes 4.9 (H200, benchmarks/profile_step.py, docs/results/2026-11-30).
- `observe`: the transition counts' decay-and-add, one program per row.
Side stream:
- `prefetch_scores`: the temporal and transition scores, their combination with the gate's, and the
  prefetch gate, ~35 kernels of the torch code, in one program.

References: `predict.predictors.gate_scores`, `cache.expert_cache.observe` and the torch branch of
`cache.expert_cache.predict_and_prefetch`. The kernels agree with them to rounding: the matmuls
and row sums accumulate in another order, and an update may fuse its multiply-add.
Dims: T tokens, H hidden, E experts (target layer), E' experts (previous layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

MAX_TOKENS = 64  # more tokens (prefill) take the torch path: one program would serialise their softmax and top-p

if triton is not None:

    @triton.jit
    def _gate_scores(logits_ptr, out_ptr, T, E, stride, PER_TOKEN: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
        e = tl.arange(0, BE)
        emask = e < E
        total = tl.zeros([BE], dtype=tl.float32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            tmask = t < T
            logits = tl.load(logits_ptr + t[:, None] * stride + e[None, :], mask=tmask[:, None] & emask[None, :], other=0.0)
            logits = tl.where(emask[None, :], logits.to(tl.float32), float("-inf"))
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


    @triton.jit
    def _prefetch_scores(
        gate_ptr, pred_ptr, nominated_ptr, routed_ptr, before_ptr, transitions_ptr, e2s_ptr, counters_ptr, outcomes_ptr, pace_ptr,
        E, E_before, keep, CALLS: tl.constexpr, PREFETCHED: tl.constexpr, TIMELY: tl.constexpr, VICTIMS: tl.constexpr, MIN_SUPPORT: tl.constexpr, MIN_PRECISION: tl.constexpr,
        OUTCOME_DECAY: tl.constexpr, EXPLORE_EVERY: tl.constexpr,
        GATE: tl.constexpr, TEMPORAL: tl.constexpr, TRANSITION: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        emask = e < E
        support = tl.zeros([BE], dtype=tl.float32)
        if TEMPORAL:  # the experts this layer routed to last call
            temporal = tl.load(routed_ptr + e, mask=emask, other=0).to(tl.float32)
            support += temporal
        if TRANSITION:  # share of the previous layer's routed experts' transitions that lead to each expert
            share = tl.zeros([BE], dtype=tl.float32)
            n_before = 0.0
            for r0 in range(0, E_before, BR):
                r = r0 + tl.arange(0, BR)
                rmask = r < E_before
                counts = tl.load(transitions_ptr + r[:, None] * E + e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0)
                before = tl.load(before_ptr + r, mask=rmask, other=0).to(tl.float32)
                rows = counts / tl.maximum(tl.sum(counts, axis=1), 1e-6)[:, None]
                share += tl.sum(rows * before[:, None], axis=0)
                n_before += tl.sum(before, axis=0)
            share = share / tl.maximum(n_before, 1.0)
            key = (share.to(tl.int32, bitcast=True).to(tl.int64) << 12) | (4095 - e)  # share >= 0 sorts as its bits; E < 4096
            key = tl.where(emask, key, -1)
            kth = tl.min(tl.where(e < keep, tl.sort(key, descending=True), 1 << 62))
            transition = tl.where(key >= kth, share, 0.0)
            support += transition
        # combine: the gate's nominations first, then what the others back with enough support
        sources = tl.zeros([BE], dtype=tl.int32)
        score = tl.zeros([BE], dtype=tl.float32)
        if TEMPORAL + TRANSITION > 0:
            support = support / (TEMPORAL + TRANSITION)
            confident = support >= MIN_SUPPORT
            score = tl.where(confident, support, 0.0)
            if TEMPORAL:
                sources += tl.where(confident & (temporal > 0), 2, 0).to(tl.int32)  # predictors.TEMPORAL; bits differ: + is |
            if TRANSITION:
                sources += tl.where(confident & (transition > 0), 4, 0).to(tl.int32)  # predictors.TRANSITION
        if GATE:
            gate = tl.load(gate_ptr + e, mask=emask, other=0.0)
            score = tl.where(gate > 0, 1 + gate, score)
            sources += tl.where(gate > 0, 1, 0).to(tl.int32)  # predictors.GATE
        # the prefetch gate: off while most recent prefetches were wasted, but for an explorer
        k = tl.arange(0, 2)
        saved = tl.load(counters_ptr + TIMELY) - tl.load(counters_ptr + VICTIMS)  # used by their call, less the hits they cost
        seen = tl.where(k == 0, tl.load(counters_ptr + PREFETCHED) - saved, saved).to(tl.float32)  # (wasted, paid)
        fresh_outcomes = tl.maximum(seen - tl.load(outcomes_ptr + 2 + k), 0.0)
        estimate = tl.load(outcomes_ptr + k) * OUTCOME_DECAY + fresh_outcomes
        tl.store(outcomes_ptr + k, estimate)
        tl.store(outcomes_ptr + 2 + k, seen)
        wasted = tl.sum(tl.where(k == 0, estimate, 0.0), axis=0)
        used = tl.sum(tl.where(k == 1, estimate, 0.0), axis=0)
        copy_ns, window_ns = tl.load(pace_ptr + 2), tl.load(pace_ptr + 1)  # int64
        copy, window = copy_ns.to(tl.float32), window_ns.to(tl.float32)
        precision = tl.where((copy > 0) & (window > 0), tl.maximum(copy / (copy + window), MIN_PRECISION), MIN_PRECISION)
        on = (used + 1) >= precision * (used + wasted + 2)
        fresh = tl.where(tl.load(e2s_ptr + e, mask=emask, other=0) >= 0, 0.0, score)
        fresh = tl.where(emask, fresh, -1.0)
        likeliest = e == tl.min(tl.where(fresh == tl.max(fresh, axis=0), e, BE), axis=0)  # first of the maxima
        stride = tl.where((copy_ns > 0) & (window_ns > 0), tl.maximum(copy_ns // tl.maximum(window_ns, 1), 1), 1)  # explore_period's
        period = EXPLORE_EVERY * stride
        calls = tl.load(counters_ptr + CALLS)
        explore = (1 - on.to(tl.int32)) * ((calls > 0) & (calls % period == 0)).to(tl.int32)
        score = tl.where(on.to(tl.int32) + explore * likeliest.to(tl.int32) > 0, score, 0.0)
        tl.store(pred_ptr + e, score, mask=emask)
        tl.store(nominated_ptr + e, sources.to(tl.int8), mask=emask)


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


def gate_scores(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int, out: torch.Tensor
) -> None:
    """x [T, H] with T <= MAX_TOKENS, weight [E, H], bias [E] or None -> out [E] float32."""
    logits = F.linear(x.to(weight.dtype), weight, bias)  # [T, E], as the router computes them (and the reference)
    T, E = logits.shape
    _gate_scores[(1,)](logits, out, T, E, logits.stride(0), PER_TOKEN=min(per_token, E), BT=16,
                       BE=max(16, triton.next_power_of_2(E)), num_warps=4)


def observe(previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor, decay: float) -> None:
    """transitions [E', E] = transitions * decay + outer(previous [E'], routed [E]) (bool masks), in place."""
    E = routed.shape[0]
    _observe[(previous.shape[0],)](previous, routed, transitions, E, decay, BE=triton.next_power_of_2(E), num_warps=1)


def prefetch_scores(
    gate: torch.Tensor | None, routed: torch.Tensor | None, routed_before: torch.Tensor | None,
    transitions: torch.Tensor | None, keep: int,
    predicted: torch.Tensor, nominated: torch.Tensor, expert_to_slot: torch.Tensor, counters: torch.Tensor,
    outcomes: torch.Tensor, pace: torch.Tensor, constants: dict,
) -> None:
    """Write the target layer's combined and gated scores into `predicted` [E] and the nominating sources
    into `nominated` [E]; `gate` [E] holds the gate predictor's scores, `routed` [E] turns on the
    temporal predictor, `routed_before` [E'] with `transitions` [E', E] the transition one.
    `constants`: the references' counter indices and thresholds (`expert_cache.PREFETCH_CONSTANTS`)."""
    E = predicted.shape[0]
    temporal, transition = routed is not None, routed_before is not None
    _prefetch_scores[(1,)](
        gate if gate is not None else predicted, predicted, nominated, routed if temporal else nominated,
        routed_before if transition else nominated,
        transitions if transition else predicted, expert_to_slot, counters, outcomes, pace,
        E, routed_before.shape[0] if transition else 0, keep, **constants,
        GATE=gate is not None, TEMPORAL=temporal, TRANSITION=transition, BE=triton.next_power_of_2(E), BR=16, num_warps=4,
    )
