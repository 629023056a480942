"""The predictors' work, one launch each instead of a chain of small kernels (docs/decisions.md#fused-predictors).

Inside a decode step's CUDA graph every kernel costs a few microseconds, however small, and the side
stream's kernels share the GPU with the compute beside them.

Compute stream:
- `gate_scores_triton`: layer l+1's router on layer l's MoE input [T, H] (cuBLAS, as the router itself),
  then softmax, each token's top-p and the mean over tokens -> [E] in one program: decode has a
  handful of tokens, and one program keeps the sum over tokens in a fixed order (no atomics), so a
  replayed graph decides as the eager step does.
- `observe_triton`: the transition counts' decay-and-add, one program per row.
Side stream:
- `recorded_scores_triton`: a replayed trace's recorded gate for the tokens from its cursor on, scored as the
  gate scores them, in one program (the torch code is ~10 kernels, which the compute stream's join then waits for).
- `prefetch_scores_triton`: the temporal and transition scores, their combination with the gate's, and
  the prefetch gate, ~35 kernels of the torch code, in one program.

References: `predict.predictors.gate_scores_reference`, `recorded_scores_reference` and `observe_reference`, and
`predict.prefetch.scores_reference`. The kernels agree with them to rounding: the matmuls and row sums
accumulate in another order, and an update may fuse its multiply-add.
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
    _ID_BITS = tl.constexpr(12)
    _ID_MASK = tl.constexpr(4095)

    @triton.jit
    def _gate_scores(logits_ptr, out_ptr, T, E, stride, PER_TOKEN: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
        e = tl.arange(0, BE)
        emask = e < E
        total = tl.zeros([BE], dtype=tl.float32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            tmask = t < T
            logits = tl.load(
                logits_ptr + t[:, None] * stride + e[None, :], mask=tmask[:, None] & emask[None, :], other=0.0
            )
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
            p = tl.load(probs_ptr + row * probs_row + j * probs_col, mask=jmask, other=0.0).to(tl.float32)
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

    @triton.jit
    def _opens(outcomes_ptr, tried, saved, decay, precision, WASTED: tl.constexpr, SEEN_WASTED: tl.constexpr):
        """prefetch_gate.opens: the decayed (wasted, paid) estimate updated from the totals, and whether it opens."""
        k = tl.arange(0, 2)  # 0: wasted, 1: paid
        seen = tl.where(k == 0, tried - saved, saved).to(tl.float32)
        fresh_outcomes = tl.maximum(seen - tl.load(outcomes_ptr + SEEN_WASTED + k), 0.0)
        estimate = tl.load(outcomes_ptr + WASTED + k) * decay + fresh_outcomes
        tl.store(outcomes_ptr + WASTED + k, estimate)
        tl.store(outcomes_ptr + SEEN_WASTED + k, seen)
        wasted = tl.sum(tl.where(k == 0, estimate, 0.0), axis=0)
        used = tl.sum(tl.where(k == 1, estimate, 0.0), axis=0)
        return ((used + 1) >= precision * (used + wasted + 2)).to(tl.int32)

    @triton.jit
    def _prefetch_scores(
        gate_ptr,
        pred_ptr,
        nominated_ptr,
        routed_ptr,
        before_ptr,
        transitions_ptr,
        e2s_ptr,
        counters_ptr,
        outcomes_ptr,
        visited_ptr,
        explored_ptr,
        runners_up_ptr,
        gate_open_ptr,
        pace_ptr,
        E,
        E_before,
        keep,
        USE_GATE: tl.constexpr,
        USE_TEMPORAL: tl.constexpr,
        USE_TRANSITION: tl.constexpr,
        GATE: tl.constexpr,
        TEMPORAL: tl.constexpr,
        TRANSITION: tl.constexpr,  # the source bits
        CALLS: tl.constexpr,
        PREFETCHED: tl.constexpr,
        PREFETCH_TIMELY: tl.constexpr,
        PREFETCH_VICTIMS: tl.constexpr,
        EXPLORED: tl.constexpr,
        EXPLORED_PAID: tl.constexpr,
        RUNNERS_UP: tl.constexpr,
        RUNNERS_UP_PAID: tl.constexpr,
        WASTED: tl.constexpr,
        PAID: tl.constexpr,
        SEEN_WASTED: tl.constexpr,
        SEEN_PAID: tl.constexpr,
        N_OUTCOMES: tl.constexpr,
        PACE_WINDOW: tl.constexpr,
        PACE_COPY: tl.constexpr,
        MIN_SUPPORT: tl.constexpr,
        MIN_PRECISION: tl.constexpr,
        LOG2_DECAY: tl.constexpr,
        EXPLORE_EVERY: tl.constexpr,
        BE: tl.constexpr,
        BR: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        emask = e < E
        support = tl.zeros([BE], dtype=tl.float32)
        if USE_TEMPORAL:  # the experts this layer routed to last call
            temporal = tl.load(routed_ptr + e, mask=emask, other=0).to(tl.float32)
            support += temporal
        if USE_TRANSITION:  # share of the previous layer's routed experts' transitions that lead to each expert
            share = tl.zeros([BE], dtype=tl.float32)
            n_before = 0.0
            for r0 in range(0, E_before, BR):
                r = r0 + tl.arange(0, BR)
                rmask = r < E_before
                counts = tl.load(
                    transitions_ptr + r[:, None] * E + e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0
                )
                before = tl.load(before_ptr + r, mask=rmask, other=0).to(tl.float32)
                rows = counts / tl.maximum(tl.sum(counts, axis=1), 1e-6)[:, None]
                share += tl.sum(rows * before[:, None], axis=0)
                n_before += tl.sum(before, axis=0)
            share = share / tl.maximum(n_before, 1.0)
            # share >= 0 sorts as its bits; ties to the lower id (E < 2**_ID_BITS)
            key = (share.to(tl.int32, bitcast=True).to(tl.int64) << _ID_BITS) | (_ID_MASK - e)
            key = tl.where(emask, key, -1)
            kth = tl.min(tl.where(e < keep, tl.sort(key, descending=True), 1 << 62))
            transition = tl.where(key >= kth, share, 0.0)
            support += transition
        # combine: the gate's nominations first, then what the others back with enough support
        sources = tl.zeros([BE], dtype=tl.int32)
        score = tl.zeros([BE], dtype=tl.float32)
        if USE_TEMPORAL + USE_TRANSITION > 0:
            support = support / (USE_TEMPORAL + USE_TRANSITION)
            confident = support >= MIN_SUPPORT
            score = tl.where(confident, support, 0.0)
            if USE_TEMPORAL:  # the bits differ, so + is |
                sources += tl.where(confident & (temporal > 0), TEMPORAL, 0).to(tl.int32)
            if USE_TRANSITION:
                sources += tl.where(confident & (transition > 0), TRANSITION, 0).to(tl.int32)
        if USE_GATE:
            gate = tl.load(gate_ptr + e, mask=emask, other=0.0)
            score = tl.where(gate > 0, 1 + gate, score)
            sources += tl.where(gate > 0, GATE, 0).to(tl.int32)
        # the prefetch gate: off while most recent prefetches were wasted; a closed one's explorer is scored, not copied
        tl.static_assert((PAID == WASTED + 1) & (SEEN_PAID == SEEN_WASTED + 1))
        calls, visited = tl.load(counters_ptr + CALLS), tl.load(visited_ptr)
        decay = tl.exp2(tl.maximum(calls - visited, 1).to(tl.float32) * LOG2_DECAY)  # per call since the last
        copy_ns, window_ns = tl.load(pace_ptr + PACE_COPY), tl.load(pace_ptr + PACE_WINDOW)  # int64
        copy, window = copy_ns.to(tl.float32), window_ns.to(tl.float32)
        measured = (copy > 0) & (window > 0)
        precision = tl.where(measured, tl.maximum(copy / (copy + window), MIN_PRECISION), MIN_PRECISION)
        # misses the prefetches saved: used by their call, less the hits they cost, and the explorations that would
        # have saved one
        saved = tl.load(counters_ptr + PREFETCH_TIMELY) - tl.load(counters_ptr + PREFETCH_VICTIMS)
        saved += tl.load(counters_ptr + EXPLORED_PAID)
        tried = tl.load(counters_ptr + PREFETCHED) + tl.load(counters_ptr + EXPLORED)
        on = _opens(outcomes_ptr, tried, saved, decay, precision, WASTED, SEEN_WASTED)
        runners_on = _opens(
            outcomes_ptr + N_OUTCOMES,
            tl.load(counters_ptr + RUNNERS_UP),
            tl.load(counters_ptr + RUNNERS_UP_PAID),
            decay,
            precision,
            WASTED,
            SEEN_WASTED,
        )
        resident = tl.load(e2s_ptr + e, mask=emask, other=0) >= 0
        fresh = tl.where(resident, 0.0, score)
        fresh = tl.where(emask, fresh, -1.0)
        likeliest = e == tl.min(tl.where(fresh == tl.max(fresh, axis=0), e, BE), axis=0)  # first of the maxima
        # the likeliest whose copies start within the window (fresh >= 0 sorts as its bits; ties to the lower id),
        # past the first: the runners-up
        fit = tl.where(measured, (window_ns + copy_ns - 1) // tl.maximum(copy_ns, 1), keep)  # ranks_in_window
        fit = tl.minimum(tl.maximum(fit, 1), keep)
        key = tl.where(emask, (fresh.to(tl.int32, bitcast=True).to(tl.int64) << _ID_BITS) | (_ID_MASK - e), -1)
        kth = tl.min(tl.where(e < fit, tl.sort(key, descending=True), 1 << 62))
        runners_up = (key >= kth) & (fresh > 0) & ~likeliest
        tl.store(runners_up_ptr + e, runners_up, mask=emask)
        stride = tl.where(measured, tl.maximum(copy_ns // tl.maximum(window_ns, 1), 1), 1)  # explore_period's
        period = EXPLORE_EVERY * stride
        explore = (on == 0) & (calls > 0) & (calls // period != visited // period) & (tl.max(fresh, axis=0) > 0)
        tl.store(explored_ptr, tl.sum(tl.where(likeliest, e, 0), axis=0).to(tl.int64), mask=explore)
        admit = (resident | likeliest).to(tl.int32) + runners_up.to(tl.int32) * runners_on  # runners-up while they pay
        score = tl.where((admit * on) > 0, score, 0.0)
        tl.store(pred_ptr + e, score, mask=emask)
        tl.store(nominated_ptr + e, sources.to(tl.int8), mask=emask)
        tl.store(visited_ptr, calls)
        tl.store(gate_open_ptr, on)


def gate_scores_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int, out: torch.Tensor
) -> None:
    """x [T, H] with T <= MAX_TOKENS, weight [E, H], bias [E] or None -> out [E] float32."""
    logits = F.linear(x.to(weight.dtype), weight, bias)  # [T, E], as the router computes them (and the reference)
    T, E = logits.shape
    BE = max(16, triton.next_power_of_2(E))
    _gate_scores[(1,)](logits, out, T, E, logits.stride(0), PER_TOKEN=min(per_token, E), BT=16, BE=BE, num_warps=4)


def recorded_scores_triton(recorded: list[torch.Tensor], tokens: int, per_token: int, out: torch.Tensor) -> None:
    """`recorded`: (ids [N, g], probs [N, g], cursor [1]) of a replay; tokens <= MAX_TOKENS -> out [E] float32."""
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


def observe_triton(previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor, decay: float) -> None:
    """transitions [E', E] = transitions * decay + outer(previous [E'], routed [E]) (bool masks), in place."""
    E = routed.shape[0]
    BE = triton.next_power_of_2(E)
    _observe[(previous.shape[0],)](previous, routed, transitions, E, decay, BE=BE, num_warps=1)


def prefetch_scores_triton(sources: int, routed_before: torch.Tensor | None, keep: int, s, constants: dict) -> None:
    """The target layer's combined and gated scores into `s.predicted` [E] and their sources into `s.nominated`
    [E], for the predictors in the bits `sources` (constants GATE, TEMPORAL, TRANSITION): the gate's scores from
    `s.gate`, temporal from `s.routed`, transition from `routed_before` [E'] and `s.transitions` [E', E].
    `s` is the target's `CacheState`; `constants`: the reference's indices and thresholds, by name."""
    E = s.predicted.shape[0]
    transition = bool(sources & constants["TRANSITION"])
    _prefetch_scores[(1,)](
        s.gate,
        s.predicted,
        s.nominated,
        s.routed,
        routed_before if transition else s.routed,
        s.transitions,
        s.expert_to_slot,
        s.counters,
        s.outcomes,
        s.visited,
        s.explored,
        s.runners_up,
        s.gate_open,
        s.pace,
        E,
        routed_before.shape[0] if transition else 0,
        keep,
        USE_GATE=bool(sources & constants["GATE"]),
        USE_TEMPORAL=bool(sources & constants["TEMPORAL"]),
        USE_TRANSITION=transition,
        **constants,
        BE=triton.next_power_of_2(E),
        BR=16,
        num_warps=4,
    )
