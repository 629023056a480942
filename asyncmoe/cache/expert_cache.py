"""One MoE layer's expert cache: host store, slots, the two tables, policy state and counters.

Dims: E experts, C slots, T tokens, k top-k, M = min(C, E, T*k) (the most experts one call admits).

`ensure` is written in fixed-shape tensor ops only: no `.item()`, `.tolist()`, `nonzero`,
`unique`, boolean-mask indexing or Python branches on tensor values. The same code therefore runs
on the CPU in CI, on the GPU in eager mode, and inside a captured CUDA graph, where every call
replays with new routing and the host never learns which experts moved.

Tables: `expert_to_slot [E+1]` (-1: not resident; row E is a trash row that absorbs masked
writes) and `slot_to_expert [C]` (-1: empty). They are inverse on the resident experts.

Waves: a call whose distinct experts exceed C (prefill, big batches) is served in waves of at most C
experts: first the ones already resident, then the missing ones, each in expert-id order. Resident
first, because a later wave would have to copy back what an earlier one evicted: a 2048-token prompt
needs all 64 experts of an OLMoE layer, and with 16 slots ordered by id alone the first three waves
evicted the previous prompt's last wave (experts 48-63) before the fourth needed it again (64 copies
where 48 do). Wave 0 decides every expert's wave and keeps it in `wave_of`, so that later waves,
which see a changed cache, agree with it. Wave w admits its experts, evicting only experts that no
later wave of the same call needs while others are available, and returns slot -1 for pairs of other
waves.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.cache_step import cache_step
from ..kernels import predict as predict_kernels
from ..kernels.gather_copy import gather_copy
from ..predict.predictors import GATE, MIN_SUPPORT, SOURCES, TEMPORAL, TRANSITION, combine, temporal_scores, transition_scores
from .policies import FREQ_DECAY_SHIFT, FREQ_UNIT, POLICY_IDS, SlotState, get_policy

COUNTERS = (
    "calls", "hits", "misses", "evictions", "bytes_h2d",  # ensure: every byte moved, prefetches included
    "prefetched", "wasted",  # experts a prefetch admitted; prefetched experts evicted before any use
    "prefetch_hits", "hits_gate", "hits_temporal", "hits_transition",  # routed experts found prefetched, by nominator
    "prefetch_timely",  # ... first used by the very call they were fetched for
    "prefetch_victims",  # experts a prefetch evicted that the very next call needed: a hit the prefetch cost
)
CALLS, PREFETCHED, TIMELY, VICTIMS = (COUNTERS.index(n) for n in ("calls", "prefetched", "prefetch_timely", "prefetch_victims"))  # the gate's

# The prefetch gate (see `gate_prefetch`). A wasted copy costs about what a used one saves when one
# expert's copy takes as long as a layer's compute (OLMoE-1B-7B shape on the H200: 0.27 vs 0.25 ms),
# so a layer prefetches while at least half of its recent prefetches saved a miss; more where a copy
# outlasts the compute it hides behind (`pace`).
MIN_PRECISION = 0.5
OUTCOME_DECAY = 0.98  # per call: the estimate follows the last ~50 calls
EXPLORE_EVERY = 32  # a gated layer still prefetches its likeliest expert every 32nd call, to notice a change
# (every 32 x copy // window calls where a copy outlasts the compute it hides behind: `explore_period`)
PREFETCH_CONSTANTS = dict(  # what the fused kernel (kernels.predict.prefetch_scores) shares with `combine` and `gate_prefetch`
    CALLS=CALLS, PREFETCHED=PREFETCHED, TIMELY=TIMELY, VICTIMS=VICTIMS, MIN_SUPPORT=MIN_SUPPORT, MIN_PRECISION=MIN_PRECISION,
    OUTCOME_DECAY=OUTCOME_DECAY, EXPLORE_EVERY=EXPLORE_EVERY,
)


class ExpertCache(nn.Module):
    """Buffers of one layer's cache; every one allocated once, so its address never changes.

    `hosts` maps each per-expert tensor name of the experts module (`gate_up_proj`, `down_proj`,
    biases, ...) to its host store `[E, ...]`, as the device sees it: a UVA view of pinned memory
    for a CUDA cache, the host tensor itself for a CPU one.
    """

    def __init__(self, hosts: dict[str, torch.Tensor], num_slots: int, policy: str, time_stalls: bool = False):
        super().__init__()
        get_policy(policy)  # fail on a bad name now, not at the first forward
        first = next(iter(hosts.values()))
        device, self.num_experts, self.num_slots, self.policy = first.device, first.shape[0], num_slots, policy
        self.names = list(hosts)
        for name, host in hosts.items():
            self.register_buffer(f"host_{name}", host, persistent=False)
            self.register_buffer(
                f"slot_{name}", torch.zeros((num_slots,) + host.shape[1:], dtype=host.dtype, device=device), persistent=False
            )
        C, E = num_slots, self.num_experts
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("expert_to_slot", torch.full((E + 1,), -1, **i64), persistent=False)
        self.register_buffer("slot_to_expert", torch.full((C,), -1, **i64), persistent=False)
        self.register_buffer("last_use", torch.zeros(C, **i64), persistent=False)
        self.register_buffer("born", torch.zeros(C, **i64), persistent=False)
        self.register_buffer("freq", torch.zeros(C, **i64), persistent=False)
        self.register_buffer("used", torch.zeros(C, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("clock", torch.zeros(1, **i64), persistent=False)
        self.register_buffer("source", torch.zeros(C, dtype=torch.int8, device=device), persistent=False)
        self.register_buffer("routed", torch.zeros(E, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("counters", torch.zeros(len(COUNTERS), **i64), persistent=False)
        # the clock of the prefetch that last evicted each expert (-1: none; row E absorbs masked writes)
        self.register_buffer("evicted_at", torch.full((E + 1,), -1, **i64), persistent=False)
        self.register_buffer("wave_of", torch.full((E,), -1, **i64), persistent=False)  # this call's wave of each expert
        self.register_buffer("scratch", torch.zeros(E, dtype=torch.int32, device=device), persistent=False)  # fused kernel
        # the gate predictor's scores for this layer: written on the compute stream by the layer before, read by
        # the prefetch on the side stream, so a buffer (a temporary could be reused under the side stream), and
        # not `predicted`, which the side stream writes (a deeper layer's prefetch may still be running)
        self.register_buffer("gate", torch.zeros(E, dtype=torch.float32, device=device), persistent=False)
        # the side stream's combined prediction and its sources
        self.register_buffer("predicted", torch.zeros(E, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("nominated", torch.zeros(E, dtype=torch.int8, device=device), persistent=False)
        # prefetch outcomes: decayed (wasted, paid) counts and the counters they were last read from (see `gate_prefetch`)
        self.register_buffer("outcomes", torch.zeros(4, dtype=torch.float32, device=device), persistent=False)
        # stall timing (kernels.clock): two GPU-clock stamps, then the summed ns of waiting for the prefetch
        # and of `ensure`'s own decision and copy; empty when not timed (an op cannot take an optional mutated tensor)
        self.register_buffer("timer", torch.zeros(4 if time_stalls else 0, **i64), persistent=False)
        # the prefetch's pace, one tensor for every linked layer (`providers.link`): a GPU-clock stamp, the compute
        # a prefetch hid behind in the last call (ns) and one expert's copy (ns); zeros: not measured (the CPU)
        self.register_buffer("pace", torch.zeros(3, **i64), persistent=False)
        # `transitions` [E_prev, E], decayed counts of (expert routed at the previous MoE layer -> here),
        # is registered by the integration when a transition predictor feeds this layer.

    @property
    def hosts(self) -> list[torch.Tensor]:
        return [getattr(self, f"host_{n}") for n in self.names]

    @property
    def slots(self) -> list[torch.Tensor]:
        return [getattr(self, f"slot_{n}") for n in self.names]

    @property
    def slot_state(self) -> SlotState:
        return SlotState(self.last_use, self.born, self.freq, self.used, self.clock, self.source, self.routed)

    @property
    def state(self) -> list[torch.Tensor]:
        """What the ops mutate besides tables, counters and slots: the slot state, the prefetches' victims, the call's
        waves and the kernel's scratch."""
        return [*self.slot_state, self.evicted_at, self.wave_of, self.scratch]

    def clear(self) -> None:
        """Back to the cache as built: no expert resident, no policy, predictor or counter history. In place,
        so a captured graph's addresses stay valid. Slot weights are left as they are: no table points at them.
        A benchmark that reuses one model for several cases clears it so each starts as a fresh build would."""
        kept = {f"{kind}_{n}" for n in self.names for kind in ("host", "slot")} | {"pace"}  # pace measures the GPU, not this history
        for name, buf in self.named_buffers(recurse=False):
            if name not in kept:
                buf.fill_(-1 if name in ("expert_to_slot", "slot_to_expert", "evicted_at", "wave_of") else 0)

    def slot_weights(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"slot_{n}") for n in self.names}

    @property
    def expert_bytes(self) -> int:
        return _expert_bytes(self.slots)

    def _apply(self, fn, recurse=True):
        # `model.to()`, `.half()`, `.cpu()` reach here. Moving or casting would reallocate the slots and
        # (for a UVA host view) copy the whole host store onto the GPU; refuse instead of doing that.
        for buf in self._buffers.values():
            probe = torch.empty(0, dtype=buf.dtype, device=buf.device)
            out = fn(probe)
            if out.device != probe.device or out.dtype != probe.dtype:
                raise RuntimeError(
                    f"an asyncmoe expert cache lives on {probe.device} in {probe.dtype} and cannot be moved or cast "
                    f"(asked for {out.device}, {out.dtype}). Move/cast the model before asyncmoe.compile, "
                    "or pass device= to asyncmoe.compile."
                )
        return self


def num_waves(pairs: int, num_slots: int, num_experts: int) -> int:
    """Waves needed in the worst case for `pairs` (token, expert) pairs: decided by shapes alone."""
    if pairs <= num_slots:
        return 1
    return math.ceil(min(num_experts, pairs) / num_slots)


def wave_plan(ids: torch.Tensor, wave: int, num_slots: int, resident: torch.Tensor, wave_of: torch.Tensor):
    """Experts needed by this call [E], those in wave `wave` [E], those of later waves [E].

    Wave 0 ranks the needed experts, resident ones first, and writes each one's wave to `wave_of`
    (-1: not needed); later waves of the call read it."""
    need = torch.zeros_like(resident).index_fill_(0, ids.reshape(-1), True)
    if wave == 0:
        first = need & resident
        rank = torch.where(first, first.cumsum(0), first.sum() + (need & ~first).cumsum(0)) - 1
        wave_of.copy_(torch.where(need, rank // num_slots, -1))
    return need, wave_of == wave, wave_of > wave


def _put(t: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, value) -> None:
    """t[idx] = value where valid, unchanged elsewhere; idx must hold distinct entries."""
    t.index_put_((idx,), torch.where(valid, value, t[idx]))


def admit(
    want: torch.Tensor,  # [E] bool: experts to make resident
    protect: torch.Tensor,  # [E] bool: evict these only if nothing else can go
    max_new: int,  # M
    policy: str,
    expert_to_slot: torch.Tensor,
    slot_to_expert: torch.Tensor,
    st: SlotState,
):
    """Plan and book the admission of the wanted experts not yet resident; the caller copies the data.

    Returns src [M] expert ids, dst [M] slots, valid [M], count [] (pairs i < count are real),
    gone [M] (the expert each pair evicted, E: none) and wasted [] (evicted prefetches that were never used).
    Victims are ranked by tier (empty < prefetched-unused < used < protected < wanted), then by the
    policy's score, so a wanted expert is never evicted: at most C are wanted, and every missing
    wanted expert leaves a slot not holding a wanted one.
    """
    E = want.numel()
    missing = want & (expert_to_slot[:E] < 0)
    count = missing.sum()
    src = torch.argsort((~missing).to(torch.int8), stable=True)[:max_new]  # missing experts first

    held = slot_to_expert.clamp(min=0)
    tier = torch.where(
        slot_to_expert < 0, 0, torch.where(want[held], 4, torch.where(protect[held], 3, torch.where(st.used, 2, 1)))
    )
    by_score = torch.argsort(get_policy(policy).score(st), stable=True)
    dst = by_score[torch.argsort(tier[by_score], stable=True)][:max_new]  # victims, most evictable first

    valid = torch.arange(max_new, device=want.device) < count
    old = slot_to_expert[dst]
    evicted = valid & (old >= 0)
    wasted = evicted & ~st.used[dst]
    expert_to_slot.index_put_((torch.where(evicted, old, E),), torch.full_like(old, -1))
    expert_to_slot.index_put_((torch.where(valid, src, E),), dst)
    _put(slot_to_expert, dst, valid, src)
    _put(st.born, dst, valid, st.clock)
    _put(st.last_use, dst, valid, st.clock)
    _put(st.freq, dst, valid, torch.zeros_like(st.freq[dst]))
    _put(st.used, dst, valid, torch.zeros_like(st.used[dst]))
    _put(st.source, dst, valid, torch.zeros_like(st.source[dst]))
    return src, dst, valid, count, torch.where(evicted, old, E), wasted.sum()


def touch(want: torch.Tensor, slot_to_expert: torch.Tensor, st: SlotState) -> torch.Tensor:
    """Record a use of every slot holding a wanted expert; decay every frequency once per call.

    Returns [prefetch hits, the same by nominator (len(SOURCES)), timely ones]: slots a prefetch
    filled, used now for the first time; timely: by the call right after the prefetch (`clock` has
    moved once since it was `born`), the call the prediction was for.
    """
    hit = (slot_to_expert >= 0) & want[slot_to_expert.clamp(min=0)]
    first_use = hit & ~st.used & (st.source != 0)
    timely = first_use & (st.born == st.clock - 1)
    bits = (2 ** torch.arange(len(SOURCES), device=hit.device)).to(st.source.dtype)  # built on the device: capturable
    by_source = (first_use[:, None] & ((st.source[:, None] & bits) != 0)).sum(0)
    st.used.logical_or_(hit)
    st.last_use.copy_(torch.where(hit, st.clock, st.last_use))
    st.freq.sub_(st.freq >> FREQ_DECAY_SHIFT).add_(hit.to(st.freq.dtype) * FREQ_UNIT)
    return torch.cat([first_use.sum().view(1), by_source, timely.sum().view(1)])


def ensure(
    top_k_index: torch.Tensor,  # [T, k] expert ids
    wave: int,
    policy: str,
    expert_to_slot: torch.Tensor,  # [E+1]
    slot_to_expert: torch.Tensor,  # [C]
    state: list[torch.Tensor],  # SlotState fields
    counters: torch.Tensor,  # [len(COUNTERS)]
    hosts: list[torch.Tensor],  # [E, ...] each
    slots: list[torch.Tensor],  # [C, ...] each
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Make wave `wave` of this call's experts resident; return slot ids [T, k] (-1: another wave's pair).

    `state` is the SlotState fields, the experts' waves and the kernel's scratch. The fused Triton kernel
    makes the decision on CUDA (`use_kernel=None`); the plain-torch code below is its reference, used elsewhere.
    """
    ids = top_k_index.long()
    E, C = expert_to_slot.numel() - 1, slot_to_expert.numel()
    *fields, evicted_at, wave_of, scratch = state
    if _use_kernel(expert_to_slot, use_kernel):
        out, src, dst, count = cache_step(
            ids.reshape(-1), None, None, wave, POLICY_IDS[policy], min(C, E, ids.numel()), expert_to_slot,
            slot_to_expert, fields, evicted_at, wave_of, counters, scratch, _expert_bytes(slots), FREQ_UNIT, FREQ_DECAY_SHIFT,
        )
        for host, slot in zip(hosts, slots):
            gather_copy(host, slot, src, dst, count)
        return out.view(ids.shape)
    st = SlotState(*fields)
    st.clock.add_(1)
    resident = expert_to_slot[:E] >= 0
    need, now, later = wave_plan(ids, wave, C, resident, wave_of)
    st.routed.copy_(need)
    # a prefetch since the last call evicted an expert this call needs (any wave): counted once, at wave 0
    victims = (need & ~resident & (evicted_at[:E] == st.clock - 1)).sum() * (wave == 0)
    src, dst, _, count, gone, wasted = admit(now, later, min(C, E, ids.numel()), policy, expert_to_slot, slot_to_expert, st)
    for host, slot in zip(hosts, slots):
        gather_copy(host, slot, src, dst, count)
    prefetch_hits = touch(now, slot_to_expert, st)

    calls = torch.ones_like(count) if wave == 0 else torch.zeros_like(count)
    zero = torch.zeros_like(count)
    add = [calls, now.sum() - count, count, (gone < E).sum(), count * _expert_bytes(slots), zero, wasted]
    counters.add_(torch.cat([torch.stack(add), prefetch_hits, victims.view(1)]))
    return torch.where(now[ids], expert_to_slot[ids], -1)


def prefetch(
    predicted: torch.Tensor,  # [E] float: how likely each expert is to be routed here next
    nominated: torch.Tensor,  # [E] int8: bits of the predictors that nominated each expert
    budget: int,  # most experts to admit
    policy: str,
    expert_to_slot: torch.Tensor,
    slot_to_expert: torch.Tensor,
    state: list[torch.Tensor],
    counters: torch.Tensor,
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    use_kernel: bool | None = None,
    copy_programs: int | None = None,
) -> None:
    """Admit the `budget` likeliest experts (score > 0) that are not resident, as prefetched-unused slots.

    `copy_programs` caps the copy kernel's grid (see gather_copy)."""
    *fields, evicted_at, wave_of, scratch = state
    if _use_kernel(expert_to_slot, use_kernel):
        _, src, dst, count = cache_step(
            None, predicted, nominated, 0, POLICY_IDS[policy], budget, expert_to_slot, slot_to_expert,
            fields, evicted_at, wave_of, counters, scratch, _expert_bytes(slots), FREQ_UNIT, FREQ_DECAY_SHIFT,
        )
        for host, slot in zip(hosts, slots):
            gather_copy(host, slot, src, dst, count, copy_programs)
        return
    st = SlotState(*fields)
    resident = expert_to_slot[:-1] >= 0
    fresh = predicted.masked_fill(resident, 0)  # a resident expert needs no copy: spend the budget elsewhere
    top = torch.argsort(-fresh, stable=True)[:budget]  # ties: lower expert id first, as the kernel does
    want = torch.zeros_like(st.routed).index_fill_(0, top, True) & (fresh > 0)
    keep = resident & (predicted > 0)  # ... but do not evict it for a likelier one's sake
    E = expert_to_slot.numel() - 1
    src, dst, valid, count, gone, wasted = admit(want, keep, budget, policy, expert_to_slot, slot_to_expert, st)
    _put(st.source, dst, valid, nominated[src])
    evicted_at.index_put_((gone,), st.clock.expand_as(gone))  # gone: distinct experts, or E (the trash row)
    for host, slot in zip(hosts, slots):
        gather_copy(host, slot, src, dst, count, copy_programs)
    zero = torch.zeros_like(count)
    add = [zero, zero, zero, (gone < E).sum(), count * _expert_bytes(slots), count, wasted] + [zero] * (3 + len(SOURCES))
    counters.add_(torch.stack(add))


def predict_and_prefetch(
    gate: torch.Tensor | None,  # [E] the gate predictor's scores (computed from hidden states by the caller)
    temporal: bool,
    routed_before: torch.Tensor | None,  # [E'] the previous layer's routing: turns on the transition predictor
    transitions: torch.Tensor | None,  # [E', E]
    budget: int,
    policy: str,
    predicted: torch.Tensor,
    nominated: torch.Tensor,
    expert_to_slot: torch.Tensor,
    slot_to_expert: torch.Tensor,
    state: list[torch.Tensor],
    counters: torch.Tensor,
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    outcomes: torch.Tensor,
    pace: torch.Tensor,  # [3] int64 (ExpertCache.pace)
    copy_programs: int | None = None,
    use_kernel: bool | None = None,
) -> None:
    """Score the target layer's experts by the chosen predictors, combine them, and `prefetch`: what the
    prefetch op runs on its side stream, and the simulator inline.

    On CUDA the scoring, combining and gating are one Triton launch (kernels.predict.prefetch_scores),
    the decision another (kernels.cache_step), then the copy; the torch code below is their reference."""
    st = SlotState(*state[:-3])
    if _use_kernel(expert_to_slot, use_kernel):
        predict_kernels.prefetch_scores(
            gate, st.routed if temporal else None, routed_before, transitions, budget, predicted, nominated,
            expert_to_slot, counters, outcomes, pace, PREFETCH_CONSTANTS,
        )
        prefetch(predicted, nominated, budget, policy, expert_to_slot, slot_to_expert, state, counters, hosts, slots,
                 use_kernel=True, copy_programs=copy_programs)
        return
    parts = [(GATE, gate)] if gate is not None else []
    if temporal:
        parts.append((TEMPORAL, temporal_scores(st.routed)))
    if routed_before is not None:
        parts.append((TRANSITION, transition_scores(routed_before, transitions, budget)))
    score, sources = combine(parts)
    predicted.copy_(score)
    nominated.copy_(sources)
    gate_prefetch(predicted, expert_to_slot, counters, outcomes, pace)
    prefetch(predicted, nominated, budget, policy, expert_to_slot, slot_to_expert, state, counters, hosts, slots,
             use_kernel=False, copy_programs=copy_programs)


def gate_precision(pace: torch.Tensor) -> torch.Tensor:
    """The share of prefetches that must save a miss for the gate to stay open (see `gate_prefetch`):
    copy / (copy + window) from `pace` [3], never below MIN_PRECISION, which is also the answer while the pace
    is not measured (the CPU, before a forward)."""
    copy, window = pace[2].float(), pace[1].float()
    return torch.where((copy > 0) & (window > 0), (copy / (copy + window)).clamp(min=MIN_PRECISION), MIN_PRECISION)


def explore_period(pace: torch.Tensor) -> torch.Tensor:
    """Every how many calls a gated layer explores (see `gate_prefetch`): EXPLORE_EVERY, times copy // window
    where a copy outlasts the compute it hides behind. Why the stride: an exploring copy that is wasted adds
    a whole copy to the step, so exploring every EXPLORE_EVERY windows of compute costs at most about
    1/EXPLORE_EVERY of it, however long a copy. On a replay shaped as the Mixtral-8x7B
    shape at 4 of 8 slots (a copy 14x the window, as measured on the H200), a fixed 32 calls copied 1.004x what
    no prefetch copies, the stride 1.0005x (docs/results/2026-11-30/explore_replay.txt). Nor does it cost a
    layer its way back: where a copy outlasts ~3 windows, the decayed estimate forgets one exploring call's
    evidence before the next even at 32 calls, so exploring alone cannot reopen the gate either way.
    Unmeasured (the CPU, before a forward): a stride of 1."""
    copy, window = pace[2], pace[1]
    stride = torch.where((copy > 0) & (window > 0), (copy // window.clamp(min=1)).clamp(min=1), 1)
    return EXPLORE_EVERY * stride


def gate_prefetch(
    predicted: torch.Tensor, expert_to_slot: torch.Tensor, counters: torch.Tensor, outcomes: torch.Tensor, pace: torch.Tensor
) -> None:
    """Zero the predictions (so nothing is admitted) while this layer's prefetches are mostly wasted.

    Why: a copy that is never used still holds the link and the SMs, and the layer's `ensure` waits
    for it; with predictions that miss (a random-weight router, routing replayed from a trace that the
    gate cannot see) prefetch made decode up to 2.3x slower than none (docs/results). The estimate is
    a decayed count of prefetched experts used by the call they were fetched for vs not, fed by the
    counters' growth since the last call (a stats reset only restarts the counters, not the
    estimate). Not "used before it was evicted": a prefetched slot waits for a miss to evict it, many
    calls at a high hit rate, and a guess that routing used by chance meanwhile counted as right
    (OLMoE shape, random routing, cache 32: 1.14 experts prefetched per token for 0.19 prefetch hits,
    docs/results/2026-11-30).

    Used, less the victims: a prefetch that is used but evicted an expert the same call needs saved no
    miss; it traded one hit for another and added a copy. Where a call routes to more experts than the
    slots hold, nearly every prefetch is such a trade: Mixtral-8x7B shape, its router, 4 of 8 slots,
    batch 32: 0.96 of 0.96 prefetched experts a layer used by their call, 0.00 misses saved, 1.18x slower
    than no prefetch (batch 8: 0.95 used, 0.25 saved, 1.14x; docs/results/2026-11-30, twenty-third
    session). So a prefetch pays here only by the misses it saved: its expert used by its call, each
    expert it evicted that the call needed counted against it.

    What share must be used: a used prefetch hides at most the compute it runs beside (`pace`'s window:
    from the prefetch's issue to the target layer's `ensure`), a wasted one holds the link for a whole
    copy, and where the link sets the step every copy adds its time. So the gate opens while used x window
    >= wasted x copy, at a precision of copy / (copy + window), never below MIN_PRECISION (where a copy
    takes no longer than the window, a wasted copy costs about what a used one saves). On the Mixtral-8x7B
    shape a copy takes ~13x a layer's compute at batch 1: 0.93, where 82% of prefetches used made decode
    1.15x slower than none (docs/results/2026-11-30, twenty-third session). Unmeasured (the CPU, before a
    forward): MIN_PRECISION. Where a call runs in waves, the window also holds the stamped layer's later
    waves and their copies, which share the link rather than hide a copy: it overstates the compute, and
    there the victims decide (above).

    A gated layer explores: it keeps one prediction, the likeliest expert not resident, every
    EXPLORE_EVERY calls (more where a copy outlasts the window: `explore_period`), counted by the `calls`
    counter: `clock` counts waves, and with two waves a call it kept one parity, so a period of 32 explored
    every 16 calls or never (one copy is enough to learn from, where the whole budget on every layer at
    once cost ~0.5 ms/token, measured at EXPLORE_EVERY=16, OLMoE shape). Not less often as it goes on: paid
    explores are how a closed gate reopens (two in a row where half is enough), and on the OLMoE shape with
    its trace, 16 of 64 slots, the gate closes where prefetches pay (its break-even charges a wasted copy a
    whole copy, but the link idles ~30% of that step): exploring every 32 calls made decode 0.923x graph
    without prefetch, where doubling the interval after each explore, up to 512 calls, gave 0.955x (its
    random router: 9.10 against 9.09 ms/token, nothing predicts there). The doubling was for the
    Mixtral-8x7B shape (4.4% slower without it, cache 2 of 8), whose stride now spaces exploring ~13x as far:
    there, at 4 of 8, 0.979x graph without prefetch (docs/results/2026-11-30, twenty-seventh and
    twenty-eighth sessions).
    """
    saved = counters[TIMELY] - counters[VICTIMS]  # misses the prefetches saved: used by their call, less the hits they cost
    seen = torch.stack([counters[PREFETCHED] - saved, saved]).float()  # (wasted, paid) so far
    fresh_outcomes = (seen - outcomes[2:4]).clamp(min=0)
    outcomes[:2].mul_(OUTCOME_DECAY).add_(fresh_outcomes)
    outcomes[2:4].copy_(seen)
    wasted, used = outcomes[0], outcomes[1]  # decayed (wasted, paid)
    on = (used + 1) >= gate_precision(pace) * (used + wasted + 2)  # with no evidence yet: on
    fresh = predicted.masked_fill(expert_to_slot[:-1] >= 0, 0)
    likeliest = torch.zeros_like(fresh).scatter_(0, fresh.argmax().view(1), 1.0)
    calls = counters[CALLS]  # none yet: the first call after a stats reset (the suite's every round) does not explore
    explore = ~on & (calls > 0) & (calls % explore_period(pace) == 0)
    predicted.mul_(torch.where(on, 1.0, explore.float() * likeliest))


def observe(previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor, use_kernel: bool | None = None) -> None:
    """Learn expert transitions online: decay the counts, add (routed at the previous layer) x (routed here).

    On CUDA one Triton launch (kernels.predict); this is its reference."""
    if _use_kernel(transitions, use_kernel):
        predict_kernels.observe(previous, routed, transitions, TRANSITION_DECAY)
        return
    transitions.mul_(TRANSITION_DECAY).add_(previous[:, None].float() * routed[None, :].float())


def _use_kernel(t: torch.Tensor, use_kernel: bool | None) -> bool:
    return predict_kernels.use_kernels(t) if use_kernel is None else use_kernel


def _expert_bytes(slots: list[torch.Tensor]) -> int:
    return sum(s[0].numel() * s.element_size() for s in slots)


TRANSITION_DECAY = 0.99  # per call: transitions seen ~70 calls ago count half
