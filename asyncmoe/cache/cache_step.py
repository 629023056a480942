"""One cache decision (`ensure` or `prefetch`) of one layer in one Triton program.

Reference: `asyncmoe.cache.algorithm.ensure_reference` / `prefetch_reference`, about ninety small
torch kernels per call; here the same decision is one launch (docs/decisions.md#fused-cache-step): E
and C are at most a few hundred, so one program holds a layer's tables in registers.

Ranking without argsort: every slot gets a unique int64 key (tier << 59 | policy score << 12 | slot)
and `tl.sort` orders the keys; the victims are the first `count` keys and carry their slot in the
low bits, so no gather from registers is needed. Per-expert flags that slots must look up go through
the `scratch` buffer, with a barrier (one program: the barrier orders its threads' global memory).

Bit-identical to the reference (tested under TRITON_INTERPRET=1 and on the GPU): integer policy
scores, the same tie-breaks (lower slot / expert id first). Counter indices, policy ids and the
integer scales are the reference's own definitions (state.py, policies.py).
Dims: E experts, C slots, P = T*k routed pairs, M planned copies.
"""

from __future__ import annotations

import torch

from ..gpu import pointers
from .policies import (
    FOLLOW_SHIFT,
    FOLLOW_UNIT,
    FREQ_DECAY_SHIFT,
    FREQ_UNIT,
    LFRU_MAX,
    LFRU_SHIFT,
    LIKELY_MAX,
    LIKELY_SHIFT,
    POLICIES,
)
from .state import SOURCES, WAVE_ELSEWHERE, CacheState, Counter

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

SLOT_BITS = 12  # slots per layer < 4096
# what `_cache_step` reads and writes of a `CacheState`: its parameters `<field>_ptr`, bound by name
CACHE_STATE = (
    "expert_to_slot", "slot_to_expert", "last_use", "born", "freq", "used", "clock", "source", "routed",
    "evicted_at", "wave_of", "explored", "runners_up", "counters", "scratch", "follows",
)  # fmt: skip

if triton is not None:
    _SLOT_BITS = tl.constexpr(SLOT_BITS)
    _SLOT_MASK = tl.constexpr((1 << SLOT_BITS) - 1)
    _LRU = tl.constexpr(POLICIES["lru"].id)
    _FIFO = tl.constexpr(POLICIES["fifo"].id)
    _LFU = tl.constexpr(POLICIES["lfu"].id)
    _LFRU = tl.constexpr(POLICIES["lfru"].id)
    _MARKOV = tl.constexpr(POLICIES["markov"].id)
    _FREQ_UNIT = tl.constexpr(FREQ_UNIT)
    _FREQ_SHIFT = tl.constexpr(FREQ_DECAY_SHIFT)
    _LFRU_SHIFT = tl.constexpr(LFRU_SHIFT)
    _FOLLOW_UNIT = tl.constexpr(FOLLOW_UNIT)
    _FOLLOW_SHIFT = tl.constexpr(FOLLOW_SHIFT)
    _LIKELY_SHIFT = tl.constexpr(LIKELY_SHIFT)
    _LIKELY_MAX = tl.constexpr(LIKELY_MAX)
    _LFRU_MAX = tl.constexpr(LFRU_MAX)
    _CALLS = tl.constexpr(Counter.CALLS)
    _HITS = tl.constexpr(Counter.HITS)
    _MISSES = tl.constexpr(Counter.MISSES)
    _EVICTIONS = tl.constexpr(Counter.EVICTIONS)
    _BYTES_H2D = tl.constexpr(Counter.BYTES_H2D)
    _PREFETCHED = tl.constexpr(Counter.PREFETCHED)
    _WASTED = tl.constexpr(Counter.WASTED)
    _PREFETCH_HITS = tl.constexpr(Counter.PREFETCH_HITS)
    _HITS_GATE = tl.constexpr(
        Counter.HITS_GATE
    )  # then HITS_TEMPORAL, HITS_TRANSITION: by source bit
    _PREFETCH_TIMELY = tl.constexpr(Counter.PREFETCH_TIMELY)
    _PREFETCH_VICTIMS = tl.constexpr(Counter.PREFETCH_VICTIMS)
    _EXPLORED = tl.constexpr(Counter.EXPLORED)
    _EXPLORED_PAID = tl.constexpr(Counter.EXPLORED_PAID)
    _RUNNERS_UP = tl.constexpr(Counter.RUNNERS_UP)
    _RUNNERS_UP_PAID = tl.constexpr(Counter.RUNNERS_UP_PAID)
    _N_COUNTERS = tl.constexpr(len(Counter))
    _N_SOURCES = tl.constexpr(len(SOURCES))
    _WAVE_ELSEWHERE = tl.constexpr(WAVE_ELSEWHERE)

    @triton.jit
    def _order(flags):
        """Each set entry's rank among the set ones, in id order; -1 where unset."""
        return tl.where(flags != 0, tl.cumsum(flags, axis=0) - 1, -1)

    @triton.jit
    def _nth(order, j0, n, BE: tl.constexpr, BR: tl.constexpr):
        """Ids of the set entries j0 .. j0+BR-1 (by `_order`) and which of them exist (< n): a [BR,
        BE] comparison in registers, so that a loop over a call's routed experts' rows of Markov's
        table runs as many blocks as they fill, not E / BR."""
        j = j0 + tl.arange(0, BR)
        ids = tl.sum(tl.where(order[None, :] == j[:, None], tl.arange(0, BE)[None, :], 0), axis=1)
        return ids, j < n

    @triton.jit
    def _prefetch_wants(pred_ptr, e2s, e, emask, M, BE: tl.constexpr):
        """`now`: the M likeliest experts not resident; `later`: resident ones the predictor wants
        kept."""
        pred = tl.load(pred_ptr + e, mask=emask, other=0.0)
        fresh = tl.where(e2s >= 0, 0.0, pred)
        # score desc, id asc
        key = (fresh.to(tl.int32, bitcast=True).to(tl.int64) << _SLOT_BITS) | (_SLOT_MASK - e)
        key = tl.where(emask, key, -1)
        kth = tl.min(tl.where(tl.arange(0, BE) < M, tl.sort(key, descending=True), 1 << 62))
        now = ((key >= kth) & (fresh > 0) & emask).to(tl.int32)
        later = ((e2s >= 0) & (pred > 0) & emask).to(tl.int32)
        return now, later

    @triton.jit
    def _call_needs(
        ids_ptr, n_pairs, wave_of_ptr, away, e2s, e, emask, wave, C,
        BE: tl.constexpr, BP: tl.constexpr,
    ):  # fmt: skip
        """The call's experts and each one's wave: a later wave reads them from wave 0's plan (-1:
        not needed, WAVE_ELSEWHERE: routed, computed elsewhere); wave 0 scans the pairs, an [E, BP]
        comparison a block (docs/decisions.md#eager-waves), ranks the needed
        experts but those `away` [BE] int32 marks, resident ones first, and keeps each one's wave
        for the later waves."""
        kept = tl.load(wave_of_ptr + e, mask=emask, other=-1)
        need = (kept != -1).to(tl.int32)
        if wave == 0:
            need = tl.zeros([BE], dtype=tl.int32)
            for p0 in range(0, n_pairs, BP):
                p = p0 + tl.arange(0, BP)
                ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1)
                need = tl.maximum(need, tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1))
        need = tl.where(emask, need, 0)
        here = need & (1 - away)
        first = here & (e2s >= 0).to(tl.int32)
        rank = tl.where(
            first != 0,
            tl.cumsum(first, axis=0),
            tl.sum(first, axis=0) + tl.cumsum(here - first, axis=0),
        )
        no_wave = tl.where(need != 0, _WAVE_ELSEWHERE, -1)
        planned = tl.where(here != 0, (rank - 1) // C, no_wave).to(tl.int64)
        wave_of = tl.where(wave == 0, planned, kept)
        # a branch, not `mask=emask & (wave == 0)`: Triton 3.9's interpreter broadcasts a scalar
        # comparison to its operands' integer type, and its loads and stores refuse a mask that is
        # not bool
        if wave == 0:
            tl.store(wave_of_ptr + e, planned, mask=emask)
        return need, wave_of

    @triton.jit
    def _learn_follows(
        follows_ptr, routed_ptr, need, e, emask, E, BE: tl.constexpr, BR: tl.constexpr
    ):
        """Markov.observe: the last call's experts' rows of `follows` learn this call's, BR rows at
        a time."""
        before = (tl.load(routed_ptr + e, mask=emask, other=0) != 0).to(tl.int32)
        order, n_before = _order(before), tl.sum(before, axis=0)
        for j0 in range(0, n_before, BR):
            r, rm = _nth(order, j0, n_before, BE, BR)
            at = follows_ptr + r[:, None].to(tl.int64) * E + e[None, :]
            m = rm[:, None] & emask[None, :]
            f = tl.load(at, mask=m, other=0)
            tl.store(at, f - (f >> _FOLLOW_SHIFT) + need[None, :] * _FOLLOW_UNIT, mask=m)
        tl.debug_barrier()  # every row read `routed` before it changes

    @triton.jit
    def _score_nominations(explored_ptr, runners_up_ptr, need, e2s, e, emask, BE: tl.constexpr):
        """The last prefetch's nominations: would a copy of a closed gate's exploring one have saved
        this call a miss, and how many of the runners-up did it route to? Scored and cleared: later
        waves find none."""
        explored = tl.load(explored_ptr)
        explored_paid = tl.sum(((need != 0) & (e2s < 0) & (e == explored)).to(tl.int64), axis=0)
        tl.store(explored_ptr, tl.full([], -1, tl.int64))
        runners_up = tl.load(runners_up_ptr + e, mask=emask, other=0) != 0
        n_runners_up = tl.sum(runners_up.to(tl.int64), axis=0)
        runners_up_paid = tl.sum((runners_up & (need != 0)).to(tl.int64), axis=0)
        tl.store(runners_up_ptr + e, tl.zeros([BE], dtype=tl.int1), mask=emask)
        return (explored >= 0).to(tl.int64), explored_paid, n_runners_up, runners_up_paid

    @triton.jit
    def _plan_misses(src_ptr, now, e2s, e, emask, M):
        """Misses first, in expert-id order, then the other experts (src defined for all M, as in
        the reference)."""
        missing = now & (e2s < 0).to(tl.int32)
        count = tl.sum(missing, axis=0)
        other = tl.where(emask, 1 - missing, 0)
        position = tl.where(
            missing != 0, tl.cumsum(missing, axis=0) - 1, count + tl.cumsum(other, axis=0) - 1
        )
        tl.store(src_ptr + position, e.to(tl.int64), mask=emask & (position < M))
        tl.debug_barrier()
        return count

    @triton.jit
    def _markov_likely(
        follows_ptr,
        routed_ptr,
        s2e,
        e,
        emask,
        cmask,
        E,
        BE: tl.constexpr,
        BC: tl.constexpr,
        BR: tl.constexpr,
    ):
        """Markov.score's prediction: the mean of the routed experts' `follows` rows at each slot's
        expert."""
        likely = tl.zeros([BC], dtype=tl.int64)
        on = (tl.load(routed_ptr + e, mask=emask, other=0) != 0).to(tl.int32)
        order, n_routed = _order(on), tl.sum(on, axis=0)
        for j0 in range(0, n_routed, BR):  # the routed experts' rows only
            r, rm = _nth(order, j0, n_routed, BE, BR)
            at = follows_ptr + r[:, None].to(tl.int64) * E + tl.maximum(s2e, 0)[None, :]
            f = tl.load(at, mask=rm[:, None] & (cmask & (s2e >= 0))[None, :], other=0)
            likely += tl.sum(f, axis=0).to(tl.int64)  # int32: BR entries of ~256 at most
        return tl.minimum(likely // tl.maximum(n_routed, 1).to(tl.int64), _LIKELY_MAX)

    @triton.jit
    def _policy_score(last_use, born, freq, clock, likely, POLICY: tl.constexpr):
        """Each slot's keep score by the policy (policies.py): higher = kept longer."""
        # LFRU's score and Markov's tie-break
        lfru = (freq << _LFRU_SHIFT) // (1 + clock - last_use)
        if POLICY == _LRU:
            score = last_use
        elif POLICY == _FIFO:
            score = born
        elif POLICY == _LFU:
            score = freq
        elif POLICY == _LFRU:
            score = lfru
        else:
            tl.static_assert(POLICY == _MARKOV)
            score = (likely << _LIKELY_SHIFT) | tl.minimum(lfru, _LFRU_MAX)
        return score

    @triton.jit
    def _evict(s2e_ptr, used_ptr, scratch_ptr, c, cmask, score, count, BC: tl.constexpr):
        """The first `count` slots by (tier, policy score, slot): tiers empty < prefetched-unused <
        used < needed by a later wave < needed now. Returns the victims' slots, which of them are
        real, their experts and use."""
        s2e = tl.load(s2e_ptr + c, mask=cmask, other=-1)
        flag = tl.load(scratch_ptr + tl.maximum(s2e, 0), mask=cmask & (s2e >= 0), other=0)
        used = tl.load(used_ptr + c, mask=cmask, other=0).to(tl.int32)
        tier = tl.where(
            s2e < 0, 0, tl.where(flag == 2, 4, tl.where(flag == 1, 3, tl.where(used != 0, 2, 1)))
        )
        key = (tier.to(tl.int64) << 59) | (score << _SLOT_BITS) | c
        key = tl.where(cmask, key, (1 << 62))
        order = tl.sort(key)  # victims first
        i = tl.arange(0, BC)
        victim = (order & _SLOT_MASK).to(tl.int32)
        valid = i < count
        old = tl.load(s2e_ptr + victim, mask=valid, other=-1)
        old_used = tl.load(used_ptr + victim, mask=valid, other=1).to(tl.int32)
        return victim, valid, old, old_used

    @triton.jit
    def _book(e2s_ptr, s2e_ptr, born_ptr, last_use_ptr, freq_ptr, used_ptr, victim, valid, old, new, clock,
              BC: tl.constexpr):  # fmt: skip
        """The tables after the planned experts `new` take the victims' slots: mapped both ways, born and last
        used now, no uses yet."""
        tl.store(e2s_ptr + old, -1, mask=valid & (old >= 0))
        tl.store(e2s_ptr + new, victim.to(tl.int64), mask=valid)
        tl.store(s2e_ptr + victim, new, mask=valid)
        now = clock + tl.zeros([BC], dtype=tl.int64)
        tl.store(born_ptr + victim, now, mask=valid)
        tl.store(last_use_ptr + victim, now, mask=valid)
        tl.store(freq_ptr + victim, tl.zeros([BC], dtype=tl.int64), mask=valid)
        tl.store(used_ptr + victim, tl.zeros([BC], dtype=tl.int1), mask=valid)

    @triton.jit
    def _count_ensure(
        k,
        now,
        count,
        n_wasted,
        first_use,
        timely,
        source,
        victims,
        explored,
        explored_paid,
        n_runners_up,
        runners_up_paid,
        wave,
    ):
        """What an `ensure` adds to the counters (state.Counter) besides evictions and bytes, as a
        [BK] vector."""
        # wave may arrive as a Python int or a scalar tensor
        calls = tl.full([], 0, tl.int64) + (wave == 0)
        n_now = tl.sum(now.to(tl.int64), axis=0)
        add = (
            tl.where(k == _CALLS, calls, 0)
            + tl.where(k == _HITS, n_now - count, 0)
            + tl.where(k == _MISSES, count, 0)
        )
        add += tl.where(k == _WASTED, n_wasted, 0) + tl.where(
            k == _PREFETCH_HITS, tl.sum(first_use.to(tl.int64), axis=0), 0
        )
        for b in tl.static_range(_N_SOURCES):  # hits by nominator: HITS_GATE + source bit
            hits_b = tl.sum((first_use & ((source & (1 << b)) != 0)).to(tl.int64), axis=0)
            add += tl.where(k == _HITS_GATE + b, hits_b, 0)
        add += tl.where(k == _PREFETCH_TIMELY, tl.sum(timely.to(tl.int64), axis=0), 0)
        add += tl.where(k == _PREFETCH_VICTIMS, victims, 0)
        add += tl.where(k == _EXPLORED, explored, 0) + tl.where(
            k == _EXPLORED_PAID, explored_paid, 0
        )
        add += tl.where(k == _RUNNERS_UP, n_runners_up, 0) + tl.where(
            k == _RUNNERS_UP_PAID, runners_up_paid, 0
        )
        return add

    @triton.jit
    def _record_uses(
        s2e_ptr,
        scratch_ptr,
        used_ptr,
        source_ptr,
        born_ptr,
        last_use_ptr,
        freq_ptr,
        c,
        cmask,
        clock,
    ):
        """`ensure` marks the slots it uses: used, last use, frequency. Returns the hits that were a
        prefetch's first use, those in the very call it was for, and the slots' nominators."""
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
        tl.store(
            freq_ptr + c, freq - (freq >> _FREQ_SHIFT) + hit.to(tl.int64) * _FREQ_UNIT, mask=cmask
        )
        return first_use, timely, source

    @triton.jit
    def _pair_slots(ids_ptr, n_pairs, scratch_ptr, e2s_ptr, out_ptr, E, BP: tl.constexpr):
        """Slot of each routed pair in this wave, -1 for other waves' (and for id E: another rank's
        expert)."""
        for p0 in range(0, n_pairs, BP):
            p = p0 + tl.arange(0, BP)
            pm = p < n_pairs
            ids = tl.load(ids_ptr + p, mask=pm, other=0)
            here = pm & (ids < E)
            in_wave = tl.load(scratch_ptr + ids, mask=here, other=0) == 2
            slot = tl.load(e2s_ptr + ids, mask=here, other=-1)
            tl.store(out_ptr + p, tl.where(in_wave, slot, -1), mask=pm)

    # Triton compiles a scalar argument equal to 0 or 1 as a Python constant; `wave` must stay a
    # tensor scalar
    @triton.jit(do_not_specialize=["wave", "n_pairs", "E", "C", "M"])
    def _cache_step(
        ids_ptr, n_pairs, out_ptr,  # ensure: routed expert of each pair [P]; slot of each pair, -1: other wave
        elsewhere_ptr,  # ensure: [E] bool, experts computed elsewhere (ELSEWHERE)
        pred_ptr, nominated_ptr,  # prefetch: score [E] f32, source bits [E] i8
        src_ptr, dst_ptr, count_ptr,  # the planned copies
        wave, E, C, M, expert_bytes,
        # the cache's state (CACHE_STATE, by name)
        expert_to_slot_ptr, slot_to_expert_ptr, last_use_ptr, born_ptr, freq_ptr, used_ptr, clock_ptr, source_ptr,
        routed_ptr, evicted_at_ptr, wave_of_ptr, explored_ptr, runners_up_ptr, counters_ptr, scratch_ptr, follows_ptr,
        POLICY: tl.constexpr, PREFETCH: tl.constexpr, ELSEWHERE: tl.constexpr,
        BE: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    ):  # fmt: skip
        e = tl.arange(0, BE)
        emask = e < E
        c = tl.arange(0, BC)
        cmask = c < C
        clock = tl.load(clock_ptr)
        if not PREFETCH:
            clock += 1
            tl.store(clock_ptr, clock)
        # which experts this call wants: `now` (2 in scratch), and `later` waves (1)
        e2s = tl.load(expert_to_slot_ptr + e, mask=emask, other=-1)
        if PREFETCH:
            now, later = _prefetch_wants(pred_ptr, e2s, e, emask, M, BE)
        else:
            away = tl.zeros([BE], dtype=tl.int32)
            if ELSEWHERE:  # routed, but in no wave: neither copied nor a hit
                away = tl.load(elsewhere_ptr + e, mask=emask, other=0).to(tl.int32)
            need, wave_of = _call_needs(
                ids_ptr, n_pairs, wave_of_ptr, away, e2s, e, emask, wave, C, BE, BP
            )
            now, later = (wave_of == wave).to(tl.int32), (wave_of > wave).to(tl.int32)
            if POLICY == _MARKOV:
                if wave == 0:
                    _learn_follows(follows_ptr, routed_ptr, need, e, emask, E, BE, BR)
            tl.store(routed_ptr + e, need != 0, mask=emask)
            # a prefetch since the last call evicted an expert this call needs (any wave): counted
            # once, at wave 0
            evicted_at = tl.load(evicted_at_ptr + e, mask=emask, other=-1)
            hurt = (need != 0) & (e2s < 0) & (evicted_at == clock - 1)
            victims = tl.where(wave == 0, tl.sum(hurt.to(tl.int64), axis=0), 0)
            explored, explored_paid, n_runners_up, runners_up_paid = _score_nominations(
                explored_ptr, runners_up_ptr, need, e2s, e, emask, BE
            )
        tl.store(scratch_ptr + e, now * 2 + later, mask=emask)
        count = _plan_misses(src_ptr, now, e2s, e, emask, M)

        # victims, booked for the planned experts
        s2e = tl.load(slot_to_expert_ptr + c, mask=cmask, other=-1)
        last_use = tl.load(last_use_ptr + c, mask=cmask, other=0)
        likely = tl.zeros([BC], dtype=tl.int64)
        if POLICY == _MARKOV:
            likely = _markov_likely(follows_ptr, routed_ptr, s2e, e, emask, cmask, E, BE, BC, BR)
        born = tl.load(born_ptr + c, mask=cmask, other=0)
        freq = tl.load(freq_ptr + c, mask=cmask, other=0)
        score = _policy_score(last_use, born, freq, clock, likely, POLICY)
        victim, valid, old, old_used = _evict(
            slot_to_expert_ptr, used_ptr, scratch_ptr, c, cmask, score, count, BC
        )
        i = tl.arange(0, BC)
        new = tl.load(src_ptr + i, mask=valid, other=0)
        evicted = valid & (old >= 0)
        wasted = evicted & (old_used == 0)
        _book(
            expert_to_slot_ptr,
            slot_to_expert_ptr,
            born_ptr,
            last_use_ptr,
            freq_ptr,
            used_ptr,
            victim,
            valid,
            old,
            new,
            clock,
            BC,
        )
        if PREFETCH:
            nominated = tl.load(nominated_ptr + new, mask=valid, other=0)
            tl.store(source_ptr + victim, nominated, mask=valid)
            tl.store(evicted_at_ptr + old, clock + tl.zeros([BC], dtype=tl.int64), mask=evicted)
        else:
            tl.store(source_ptr + victim, tl.zeros([BC], dtype=tl.int8), mask=valid)
        tl.store(dst_ptr + i, victim.to(tl.int64), mask=i < M)  # distinct slots, all M defined
        tl.store(count_ptr, count.to(tl.int64))
        tl.debug_barrier()

        # counters; ensure also records the uses and each pair's slot
        evictions = tl.sum(evicted.to(tl.int64), axis=0)
        n_wasted = tl.sum(wasted.to(tl.int64), axis=0)
        k = tl.arange(0, BK)
        add = tl.where(k == _EVICTIONS, evictions, 0) + tl.where(
            k == _BYTES_H2D, count.to(tl.int64) * expert_bytes, 0
        )
        if PREFETCH:
            add += tl.where(k == _PREFETCHED, count, 0) + tl.where(k == _WASTED, n_wasted, 0)
        else:
            # fmt: off
            first_use, timely, source = _record_uses(
                slot_to_expert_ptr, scratch_ptr, used_ptr, source_ptr, born_ptr, last_use_ptr, freq_ptr, c, cmask, clock
            )
            add += _count_ensure(
                k, now, count, n_wasted, first_use, timely, source, victims, explored, explored_paid,
                n_runners_up, runners_up_paid, wave,
            )
            # fmt: on
            _pair_slots(ids_ptr, n_pairs, scratch_ptr, expert_to_slot_ptr, out_ptr, E, BP)
        counters = tl.load(counters_ptr + k, mask=k < _N_COUNTERS, other=0)
        tl.store(counters_ptr + k, counters + add, mask=k < _N_COUNTERS)


def ensure_triton(
    ids: torch.Tensor, wave: int, policy_id: int, s: CacheState, expert_bytes: int,
    elsewhere: torch.Tensor | None = None,
):  # fmt: skip
    """`ensure`'s decision for the routed experts `ids` [P] on the cache state `s`, but those
    `elsewhere` [E] computes: (slot of each pair [P], (src [M], dst [M], count [1])) with
    M = min(C, E, P)."""
    E, C = s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    out, *copies = _launch(
        ids, None, None, wave, policy_id, min(C, E, ids.numel()), s, expert_bytes, elsewhere
    )
    return out, tuple(copies)


def prefetch_triton(
    predicted, nominated, budget: int, policy_id: int, s: CacheState, expert_bytes: int
):
    """`prefetch`'s decision from the scores `predicted` [E] and their sources `nominated` [E]:
    (src [budget], dst [budget], count [1])."""
    _, *copies = _launch(None, predicted, nominated, 0, policy_id, budget, s, expert_bytes)
    return tuple(copies)


def _launch(
    ids, predicted, nominated, wave, policy_id, max_new, s: CacheState, expert_bytes, elsewhere=None
):
    E, C = s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    dev = s.expert_to_slot.device
    prefetch = predicted is not None
    src = torch.empty(max_new, dtype=torch.int64, device=dev)
    dst = torch.empty(max_new, dtype=torch.int64, device=dev)
    count = torch.empty(1, dtype=torch.int64, device=dev)
    ids = torch.empty(0, dtype=torch.int64, device=dev) if prefetch else ids
    out = torch.empty_like(ids)
    # `scores` are unread without PREFETCH, `away` without ELSEWHERE
    scores = (predicted, nominated) if prefetch else (s.wave_of, s.scratch)
    away = s.routed if elsewhere is None else elsewhere
    n_pairs = ids.numel()
    _cache_step[(1,)](
        ids, n_pairs, out, away, *scores, src, dst, count, wave, E, C, max_new, expert_bytes,
        **pointers(s, CACHE_STATE),
        POLICY=policy_id, PREFETCH=prefetch, ELSEWHERE=elsewhere is not None,
        BE=triton.next_power_of_2(E), BC=triton.next_power_of_2(C),
        BP=min(triton.next_power_of_2(max(n_pairs, 1)), 1024), BK=triton.next_power_of_2(len(Counter)), BR=16,
        num_warps=4,
    )  # fmt: skip
    return (None if prefetch else out), src, dst, count
