"""One cache decision (`ensure` or `prefetch`) of one layer in one Triton program.

Reference: `asyncmoe.cache.algorithm.ensure_reference` / `prefetch_reference`, about ninety small torch
kernels per call; here the same decision is one launch (docs/decisions.md#fused-cache-step): E and C are
at most a few hundred, so one program holds a layer's tables in registers.

Ranking without argsort: every slot gets a unique int64 key (tier << 59 | policy score << 12 | slot)
and `tl.sort` orders the keys; the victims are the first `count` keys and carry their slot in the low
bits, so no gather from registers is needed. Per-expert flags that slots must look up go through the
`scratch` buffer, with a barrier (one program: the barrier orders its threads' global memory).

Bit-identical to the reference (tested under TRITON_INTERPRET=1 and on the GPU): integer policy
scores, the same tie-breaks (lower slot / expert id first). Counter indices, policy ids and the
integer scales arrive as constexprs from the reference's own definitions (`constants`).
Dims: E experts, C slots, P = T*k routed pairs, M planned copies.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

SLOT_BITS = 12  # slots per layer < 4096

if triton is not None:
    _SLOT_BITS = tl.constexpr(SLOT_BITS)
    _SLOT_MASK = tl.constexpr((1 << SLOT_BITS) - 1)

    @triton.jit
    def _order(flags):
        """Each set entry's rank among the set ones, in id order; -1 where unset."""
        return tl.where(flags != 0, tl.cumsum(flags, axis=0) - 1, -1)

    @triton.jit
    def _nth(order, j0, n, BE: tl.constexpr, BR: tl.constexpr):
        """Ids of the set entries j0 .. j0+BR-1 (by `_order`) and which of them exist (< n): a [BR, BE] comparison
        in registers, so that a loop over a call's routed experts' rows of Markov's table runs as many blocks as
        they fill, not E / BR."""
        j = j0 + tl.arange(0, BR)
        ids = tl.sum(tl.where(order[None, :] == j[:, None], tl.arange(0, BE)[None, :], 0), axis=1)
        return ids, j < n

    # Triton compiles a scalar argument equal to 0 or 1 as a Python constant; `wave` must stay a tensor scalar
    @triton.jit(do_not_specialize=["wave", "n_pairs", "E", "C", "M"])
    def _cache_step(
        ids_ptr,
        n_pairs,
        out_ptr,  # ensure: routed expert of each pair [P]; slot of each pair, -1: other wave
        pred_ptr,
        nominated_ptr,  # prefetch: score [E] f32, source bits [E] i8
        e2s_ptr,
        s2e_ptr,
        last_use_ptr,
        born_ptr,
        freq_ptr,
        used_ptr,
        clock_ptr,
        source_ptr,
        routed_ptr,
        evicted_at_ptr,
        wave_of_ptr,
        explored_ptr,
        runners_up_ptr,
        counters_ptr,
        scratch_ptr,
        follows_ptr,  # Markov: [E, E] i32
        src_ptr,
        dst_ptr,
        count_ptr,  # scratch [E] i32: per-expert flags
        wave,
        E,
        C,
        M,
        expert_bytes,
        POLICY: tl.constexpr,
        PREFETCH: tl.constexpr,
        POLICY_LRU: tl.constexpr,
        POLICY_FIFO: tl.constexpr,
        POLICY_LFU: tl.constexpr,
        POLICY_LFRU: tl.constexpr,
        POLICY_MARKOV: tl.constexpr,
        FREQ_UNIT: tl.constexpr,
        FREQ_SHIFT: tl.constexpr,
        LFRU_SHIFT: tl.constexpr,
        FOLLOW_UNIT: tl.constexpr,
        FOLLOW_SHIFT: tl.constexpr,
        LIKELY_SHIFT: tl.constexpr,
        LIKELY_MAX: tl.constexpr,
        LFRU_MAX: tl.constexpr,
        CALLS: tl.constexpr,
        HITS: tl.constexpr,
        MISSES: tl.constexpr,
        EVICTIONS: tl.constexpr,
        BYTES_H2D: tl.constexpr,
        PREFETCHED: tl.constexpr,
        WASTED: tl.constexpr,
        PREFETCH_HITS: tl.constexpr,
        HITS_GATE: tl.constexpr,
        HITS_TEMPORAL: tl.constexpr,
        HITS_TRANSITION: tl.constexpr,
        PREFETCH_TIMELY: tl.constexpr,
        PREFETCH_VICTIMS: tl.constexpr,
        EXPLORED: tl.constexpr,
        EXPLORED_PAID: tl.constexpr,
        RUNNERS_UP: tl.constexpr,
        RUNNERS_UP_PAID: tl.constexpr,
        N_COUNTERS: tl.constexpr,
        N_SOURCES: tl.constexpr,
        BE: tl.constexpr,
        BC: tl.constexpr,
        BP: tl.constexpr,
        BK: tl.constexpr,
        BR: tl.constexpr,
    ):
        e = tl.arange(0, BE)
        emask = e < E
        c = tl.arange(0, BC)
        cmask = c < C
        clock = tl.load(clock_ptr)
        if not PREFETCH:
            clock += 1
            tl.store(clock_ptr, clock)

        # --- which experts this call wants: `now` (2 in scratch), and `later` waves (1) ---
        e2s = tl.load(e2s_ptr + e, mask=emask, other=-1)
        if PREFETCH:  # `now`: the M likeliest experts not resident; `later`: resident ones the predictor wants kept
            pred = tl.load(pred_ptr + e, mask=emask, other=0.0)
            fresh = tl.where(e2s >= 0, 0.0, pred)
            key = (fresh.to(tl.int32, bitcast=True).to(tl.int64) << _SLOT_BITS) | (_SLOT_MASK - e)  # score desc, id asc
            key = tl.where(emask, key, -1)
            kth = tl.min(tl.where(tl.arange(0, BE) < M, tl.sort(key, descending=True), 1 << 62))
            now = ((key >= kth) & (fresh > 0) & emask).to(tl.int32)
            later = ((e2s >= 0) & (pred > 0) & emask).to(tl.int32)
        else:
            # the call's experts: a later wave reads them from wave 0's plan (-1: not needed); wave 0 scans the
            # pairs, an [E, BP] comparison a block (docs/decisions.md#later-waves-skip-the-pair-scan)
            kept = tl.load(wave_of_ptr + e, mask=emask, other=-1)
            need = (kept >= 0).to(tl.int32)
            if wave == 0:
                need = tl.zeros([BE], dtype=tl.int32)
                for p0 in range(0, n_pairs, BP):
                    p = p0 + tl.arange(0, BP)
                    ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1)
                    need = tl.maximum(need, tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1))
            need = tl.where(emask, need, 0)
            # wave 0 ranks the needed experts, resident ones first, and keeps each one's wave for the later waves
            first = need & (e2s >= 0).to(tl.int32)
            rank = (
                tl.where(first != 0, tl.cumsum(first, axis=0), tl.sum(first, axis=0) + tl.cumsum(need - first, axis=0))
                - 1
            )
            planned = tl.where(need != 0, rank // C, -1).to(tl.int64)
            wave_of = tl.where(wave == 0, planned, kept)
            # a branch, not `mask=emask & (wave == 0)`: Triton 3.9's interpreter broadcasts a scalar comparison to
            # its operands' integer type, and its loads and stores refuse a mask that is not bool
            if wave == 0:
                tl.store(wave_of_ptr + e, planned, mask=emask)
            now = (wave_of == wave).to(tl.int32)
            later = (wave_of > wave).to(tl.int32)
            if POLICY == POLICY_MARKOV:  # the last call's experts' rows learn this call's (Markov.observe)
                if wave == 0:
                    before = (tl.load(routed_ptr + e, mask=emask, other=0) != 0).to(tl.int32)
                    order, n_before = _order(before), tl.sum(before, axis=0)
                    for j0 in range(0, n_before, BR):  # the last call's experts' rows only, BR at a time
                        r, rm = _nth(order, j0, n_before, BE, BR)
                        at = follows_ptr + r[:, None].to(tl.int64) * E + e[None, :]
                        m = rm[:, None] & emask[None, :]
                        f = tl.load(at, mask=m, other=0)
                        tl.store(at, f - (f >> FOLLOW_SHIFT) + need[None, :] * FOLLOW_UNIT, mask=m)
                    tl.debug_barrier()  # every row read `routed` before it changes
            tl.store(routed_ptr + e, need != 0, mask=emask)
            # a prefetch since the last call evicted an expert this call needs (any wave): counted once, at wave 0
            evicted_at = tl.load(evicted_at_ptr + e, mask=emask, other=-1)
            victims = tl.where(
                wave == 0, tl.sum(((need != 0) & (e2s < 0) & (evicted_at == clock - 1)).to(tl.int64), axis=0), 0
            )
            # the last prefetch's nominations: would a copy of a closed gate's exploring one have saved this call a
            # miss, and how many of the runners-up did it route to? Scored and cleared by wave 0: later waves find none
            explored = tl.load(explored_ptr)
            explored_paid = tl.sum(((need != 0) & (e2s < 0) & (e == explored)).to(tl.int64), axis=0)
            tl.store(explored_ptr, tl.full([], -1, tl.int64))
            runners_up = tl.load(runners_up_ptr + e, mask=emask, other=0) != 0
            n_runners_up = tl.sum(runners_up.to(tl.int64), axis=0)
            runners_up_paid = tl.sum((runners_up & (need != 0)).to(tl.int64), axis=0)
            tl.store(runners_up_ptr + e, tl.zeros([BE], dtype=tl.int1), mask=emask)
        tl.store(scratch_ptr + e, now * 2 + later, mask=emask)

        # --- misses first, in expert-id order, then the other experts (src defined for all M, as in the reference) ---
        missing = now & (e2s < 0).to(tl.int32)
        count = tl.sum(missing, axis=0)
        other = tl.where(emask, 1 - missing, 0)
        position = tl.where(missing != 0, tl.cumsum(missing, axis=0) - 1, count + tl.cumsum(other, axis=0) - 1)
        tl.store(src_ptr + position, e.to(tl.int64), mask=emask & (position < M))
        tl.debug_barrier()

        # --- victims: tier, then policy score, then slot ---
        s2e = tl.load(s2e_ptr + c, mask=cmask, other=-1)
        flag = tl.load(scratch_ptr + tl.maximum(s2e, 0), mask=cmask & (s2e >= 0), other=0)
        used = tl.load(used_ptr + c, mask=cmask, other=0).to(tl.int32)
        tier = tl.where(s2e < 0, 0, tl.where(flag == 2, 4, tl.where(flag == 1, 3, tl.where(used != 0, 2, 1))))
        last_use = tl.load(last_use_ptr + c, mask=cmask, other=0)
        born = tl.load(born_ptr + c, mask=cmask, other=0)
        freq = tl.load(freq_ptr + c, mask=cmask, other=0)
        lfru = (freq << LFRU_SHIFT) // (1 + clock - last_use)  # LFRU's score and Markov's tie-break
        if POLICY == POLICY_LRU:
            score = last_use
        elif POLICY == POLICY_FIFO:
            score = born
        elif POLICY == POLICY_LFU:
            score = freq
        elif POLICY == POLICY_LFRU:
            score = lfru
        else:  # Markov.score: the mean of `follows` rows of the routed experts at each slot's expert, then LFRU
            tl.static_assert(POLICY == POLICY_MARKOV)
            likely = tl.zeros([BC], dtype=tl.int64)
            on = (tl.load(routed_ptr + e, mask=emask, other=0) != 0).to(tl.int32)
            order, n_routed = _order(on), tl.sum(on, axis=0)
            for j0 in range(0, n_routed, BR):  # the routed experts' rows only
                r, rm = _nth(order, j0, n_routed, BE, BR)
                at = follows_ptr + r[:, None].to(tl.int64) * E + tl.maximum(s2e, 0)[None, :]
                f = tl.load(at, mask=rm[:, None] & (cmask & (s2e >= 0))[None, :], other=0)
                likely += tl.sum(f, axis=0).to(tl.int64)  # int32: BR entries of ~256 at most
            likely = tl.minimum(likely // tl.maximum(n_routed, 1).to(tl.int64), LIKELY_MAX)
            score = (likely << LIKELY_SHIFT) | tl.minimum(lfru, LFRU_MAX)
        key = (tier.to(tl.int64) << 59) | (score << _SLOT_BITS) | c
        key = tl.where(cmask, key, (1 << 62))
        order = tl.sort(key)  # victims first
        i = tl.arange(0, BC)
        victim = (order & _SLOT_MASK).to(tl.int32)
        valid = i < count
        new = tl.load(src_ptr + i, mask=valid, other=0)
        old = tl.load(s2e_ptr + victim, mask=valid, other=-1)
        old_used = tl.load(used_ptr + victim, mask=valid, other=1).to(tl.int32)
        evicted = valid & (old >= 0)
        wasted = evicted & (old_used == 0)
        tl.store(e2s_ptr + old, -1, mask=evicted)
        tl.store(e2s_ptr + new, victim.to(tl.int64), mask=valid)
        tl.store(s2e_ptr + victim, new, mask=valid)
        tl.store(born_ptr + victim, clock + tl.zeros([BC], dtype=tl.int64), mask=valid)
        tl.store(last_use_ptr + victim, clock + tl.zeros([BC], dtype=tl.int64), mask=valid)
        tl.store(freq_ptr + victim, tl.zeros([BC], dtype=tl.int64), mask=valid)
        tl.store(used_ptr + victim, tl.zeros([BC], dtype=tl.int1), mask=valid)
        if PREFETCH:
            nominated = tl.load(nominated_ptr + new, mask=valid, other=0)
            tl.store(source_ptr + victim, nominated, mask=valid)
            tl.store(evicted_at_ptr + old, clock + tl.zeros([BC], dtype=tl.int64), mask=evicted)
        else:
            tl.store(source_ptr + victim, tl.zeros([BC], dtype=tl.int8), mask=valid)
        tl.store(dst_ptr + i, victim.to(tl.int64), mask=i < M)  # distinct slots, all M defined
        tl.store(count_ptr, count.to(tl.int64))
        tl.debug_barrier()

        # --- counters; ensure also records the uses ---
        evictions = tl.sum(evicted.to(tl.int64), axis=0)
        n_wasted = tl.sum(wasted.to(tl.int64), axis=0)
        k = tl.arange(0, BK)
        if PREFETCH:
            add = tl.where(k == EVICTIONS, evictions, 0) + tl.where(
                k == BYTES_H2D, count.to(tl.int64) * expert_bytes, 0
            )
            add += tl.where(k == PREFETCHED, count, 0) + tl.where(k == WASTED, n_wasted, 0)
        else:
            s2e = tl.load(s2e_ptr + c, mask=cmask, other=-1)
            flag = tl.load(scratch_ptr + tl.maximum(s2e, 0), mask=cmask & (s2e >= 0), other=0)
            hit = cmask & (s2e >= 0) & (flag == 2)
            used = tl.load(used_ptr + c, mask=cmask, other=0).to(tl.int32)
            source = tl.load(source_ptr + c, mask=cmask, other=0).to(tl.int32)
            first_use = hit & (used == 0) & (source != 0)
            timely = first_use & (tl.load(born_ptr + c, mask=cmask, other=0) == clock - 1)
            last_use = tl.load(last_use_ptr + c, mask=cmask, other=0)
            freq = tl.load(freq_ptr + c, mask=cmask, other=0)
            tl.store(used_ptr + c, (used != 0) | hit, mask=cmask)
            tl.store(last_use_ptr + c, tl.where(hit, clock, last_use), mask=cmask)
            tl.store(freq_ptr + c, freq - (freq >> FREQ_SHIFT) + hit.to(tl.int64) * FREQ_UNIT, mask=cmask)
            calls = tl.full([], 0, tl.int64) + (wave == 0)  # wave may arrive as a Python int or a scalar tensor
            n_now = tl.sum(now.to(tl.int64), axis=0)
            add = (
                tl.where(k == CALLS, calls, 0) + tl.where(k == HITS, n_now - count, 0) + tl.where(k == MISSES, count, 0)
            )
            add += tl.where(k == EVICTIONS, evictions, 0) + tl.where(
                k == BYTES_H2D, count.to(tl.int64) * expert_bytes, 0
            )
            add += tl.where(k == WASTED, n_wasted, 0) + tl.where(
                k == PREFETCH_HITS, tl.sum(first_use.to(tl.int64), axis=0), 0
            )
            tl.static_assert((HITS_TEMPORAL == HITS_GATE + 1) & (HITS_TRANSITION == HITS_GATE + 2) & (N_SOURCES == 3))
            for b in tl.static_range(N_SOURCES):  # hits by nominator: HITS_GATE + source bit
                hits_b = tl.sum((first_use & ((source & (1 << b)) != 0)).to(tl.int64), axis=0)
                add += tl.where(k == HITS_GATE + b, hits_b, 0)
            add += tl.where(k == PREFETCH_TIMELY, tl.sum(timely.to(tl.int64), axis=0), 0)
            add += tl.where(k == PREFETCH_VICTIMS, victims, 0)
            add += tl.where(k == EXPLORED, (explored >= 0).to(tl.int64), 0) + tl.where(
                k == EXPLORED_PAID, explored_paid, 0
            )
            add += tl.where(k == RUNNERS_UP, n_runners_up, 0) + tl.where(k == RUNNERS_UP_PAID, runners_up_paid, 0)
            # slot of each routed pair in this wave, -1 for other waves'
            for p0 in range(0, n_pairs, BP):
                p = p0 + tl.arange(0, BP)
                pm = p < n_pairs
                ids = tl.load(ids_ptr + p, mask=pm, other=0)
                here = pm & (ids < E)  # id E: another rank's expert (expert parallelism), in no wave here
                in_wave = tl.load(scratch_ptr + ids, mask=here, other=0) == 2
                slot = tl.load(e2s_ptr + ids, mask=here, other=-1)
                tl.store(out_ptr + p, tl.where(in_wave, slot, -1), mask=pm)
        counters = tl.load(counters_ptr + k, mask=k < N_COUNTERS, other=0)
        tl.store(counters_ptr + k, counters + add, mask=k < N_COUNTERS)


def ensure_triton(ids: torch.Tensor, wave: int, policy_id: int, s, expert_bytes: int, constants: dict):
    """`ensure`'s decision for the routed experts `ids` [P] on the cache state `s` (a `CacheState`):
    (slot of each pair [P], (src [M], dst [M], count [1])) with M = min(C, E, P)."""
    E, C = s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    out, *copies = _launch(ids, None, wave, policy_id, min(C, E, ids.numel()), s, expert_bytes, constants)
    return out, tuple(copies)


def prefetch_triton(budget: int, policy_id: int, s, expert_bytes: int, constants: dict):
    """`prefetch`'s decision from `s.predicted` and `s.nominated`: (src [budget], dst [budget], count [1])."""
    _, *copies = _launch(None, True, 0, policy_id, budget, s, expert_bytes, constants)
    return tuple(copies)


def _launch(ids, prefetch, wave, policy_id, max_new, s, expert_bytes, constants):
    E, C = s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    dev = s.expert_to_slot.device
    src = torch.empty(max_new, dtype=torch.int64, device=dev)
    dst = torch.empty(max_new, dtype=torch.int64, device=dev)
    count = torch.empty(1, dtype=torch.int64, device=dev)
    ids = torch.empty(0, dtype=torch.int64, device=dev) if prefetch else ids
    out = torch.empty_like(ids)
    n_pairs = ids.numel()
    _cache_step[(1,)](
        ids,
        n_pairs,
        out,
        s.predicted,
        s.nominated,
        s.expert_to_slot,
        s.slot_to_expert,
        s.last_use,
        s.born,
        s.freq,
        s.used,
        s.clock,
        s.source,
        s.routed,
        s.evicted_at,
        s.wave_of,
        s.explored,
        s.runners_up,
        s.counters,
        s.scratch,
        s.follows,
        src,
        dst,
        count,
        wave,
        E,
        C,
        max_new,
        expert_bytes,
        POLICY=policy_id,
        PREFETCH=bool(prefetch),
        **constants,
        BE=triton.next_power_of_2(E),
        BC=triton.next_power_of_2(C),
        BP=min(triton.next_power_of_2(max(n_pairs, 1)), 1024),
        BK=triton.next_power_of_2(constants["N_COUNTERS"]),
        BR=16,
        num_warps=4,
    )
    return (None if prefetch else out), src, dst, count
