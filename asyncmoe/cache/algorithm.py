"""The cache's decisions, `ensure` and `prefetch`, in fixed-shape tensor ops.

Dims: E experts, C slots, T tokens, k top-k, M = min(C, E, T*k) (the most experts one call admits).

No `.item()`, `.tolist()`, `nonzero`, `unique`, boolean-mask indexing or Python branches on tensor
values: the same code runs on the CPU in CI, on the GPU in eager mode and inside a captured CUDA
graph, where every call replays with new routing and the host never learns which experts moved. On
CUDA one Triton program makes each decision (`cache/cache_step.py`); `ensure_reference` and
`prefetch_reference` here are its reference, and what the CPU and the simulator run. Either way the
decision returns the copies to make, (src [M] experts, dst [M] slots, count [1] real pairs), and the
gather-copy kernel makes them.

Waves: a call whose distinct experts exceed C (prefill, big batches) is served in waves of at most C
experts: first the ones already resident, then the missing ones, each in expert-id order. Resident
first, because a later wave would otherwise copy back what an earlier one evicted. Wave 0 decides
every expert's wave and keeps it in `wave_of`, so that later waves, which see a changed cache,
agree; wave w evicts only experts no later wave of the call needs while others are available, and
returns slot -1 for pairs of other waves (docs/decisions.md#resident-first-waves).

An expert id equal to E names no expert of this cache: expert parallelism routes that pair to
another rank's experts (transformers' sentinel, weight 0). It needs nothing here and gets slot -1,
as another wave's pair does. An expert in `elsewhere` (the hybrid's CPU computes it this call) is
routed here, so the history (`routed`, the policy's observations, the prefetch's outcomes) counts
it, but it is in no wave (`wave_of` WAVE_ELSEWHERE): neither copied nor a hit, and its pairs get slot
-1 too. The waves rank only the experts computed here, so a call whose excess the CPU takes (the
hybrid's split keeps the rest within C) is served in wave 0 alone.
"""

from __future__ import annotations

import torch

from .. import gpu
from . import cache_step
from .expert_cache import expert_bytes
from .gather_copy import gather_copy
from .policies import FREQ_DECAY_SHIFT, FREQ_UNIT, Policy, get_policy
from .state import SOURCES, WAVE_ELSEWHERE, CacheState, Counter

# (src [M] expert ids, dst [M] distinct slots, count [1])
Copies = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def ensure(
    top_k_index: torch.Tensor,  # [T, k] expert ids
    wave: int,
    policy: str,
    s: CacheState,
    hosts: list[torch.Tensor],  # [E, ...] each
    slots: list[torch.Tensor],  # [C, ...] each
    use_kernel: bool | None = None,
    elsewhere: torch.Tensor | None = None,  # [E] bool
) -> torch.Tensor:
    """Make wave `wave` of this call's experts resident, but those `elsewhere` computes; return slot
    ids [T, k] (-1: another wave's pair, or elsewhere's)."""
    out, copies = ensure_plan(top_k_index, wave, policy, s, slots, use_kernel, elsewhere)
    copy_in(hosts, slots, copies)
    return out


def ensure_plan(
    top_k_index: torch.Tensor,
    wave: int,
    policy: str,
    s: CacheState,
    slots: list[torch.Tensor],
    use_kernel=None,
    elsewhere: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Copies]:
    """`ensure`'s decision, tables updated: slot ids [T, k] and the copies still to make."""
    ids, policy, nbytes = top_k_index.long().reshape(-1), get_policy(policy), expert_bytes(slots)
    if _use_kernel(s, use_kernel):
        out, copies = cache_step.ensure_triton(ids, wave, policy.id, s, nbytes, elsewhere)
    else:
        out, copies = ensure_reference(ids, wave, policy, s, nbytes, elsewhere)
    return out.view(top_k_index.shape), copies


def copy_in(
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    copies: Copies,
    programs: int | None = None,
):
    """Make a decision's copies, host -> slot, every tensor of the experts."""
    gather_copy(hosts, slots, *copies, programs)


def prefetch(
    predicted: torch.Tensor,  # [E] float32
    nominated: torch.Tensor,  # [E] int8
    budget: int,
    policy: str,
    s: CacheState,
    hosts: list[torch.Tensor],
    slots: list[torch.Tensor],
    copy_programs: int | None = None,
    use_kernel: bool | None = None,
) -> None:
    """Admit the `budget` likeliest experts by `predicted` (score > 0) that are not resident, as
    prefetched-unused slots tagged with their `nominated` sources. `copy_programs` caps the copy's
    grid."""
    plan = prefetch_plan(predicted, nominated, budget, policy, s, slots, use_kernel)
    copy_in(hosts, slots, plan, copy_programs)


def prefetch_plan(
    predicted, nominated, budget: int, policy: str, s: CacheState, slots, use_kernel=None
) -> Copies:
    """`prefetch`'s decision, tables updated: the copies still to make."""
    policy, nbytes = get_policy(policy), expert_bytes(slots)
    if _use_kernel(s, use_kernel):
        return cache_step.prefetch_triton(predicted, nominated, budget, policy.id, s, nbytes)
    return prefetch_reference(predicted, nominated, budget, policy, s, nbytes)


def _use_kernel(s: CacheState, use_kernel: bool | None) -> bool:
    return gpu.available(s.expert_to_slot) if use_kernel is None else use_kernel


def ensure_reference(
    ids: torch.Tensor,
    wave: int,
    policy: Policy,
    s: CacheState,
    nbytes: int,
    elsewhere: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Copies]:
    """`ensure`'s decision for the routed experts `ids` [P], but those `elsewhere` [E] computes: slot
    of each pair [P] and the copies to make."""
    E, C = s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    s.clock.add_(1)
    resident = s.expert_to_slot[:E] >= 0
    need, now, later = wave_plan(ids, wave, C, resident, s.wave_of, elsewhere)
    if wave == 0:
        policy.observe(s, need)
    s.routed.copy_(need)
    # a prefetch since the last call evicted an expert this call needs (any wave): counted once, at
    # wave 0
    victims = (need & ~resident & (s.evicted_at[:E] == s.clock - 1)).sum() * (wave == 0)
    nominations = nomination_outcomes(need, resident, s)
    src, dst, _, count, gone, wasted = admit(now, later, min(C, E, ids.numel()), policy, s)
    prefetch_hits = touch(now, s)

    calls = torch.ones_like(count) if wave == 0 else torch.zeros_like(count)
    zero = torch.zeros_like(count)
    add = [calls, now.sum() - count, count, (gone < E).sum(), count * nbytes, zero, wasted]
    add = torch.cat([torch.stack(add), prefetch_hits, victims.view(1), nominations])
    s.counters[: add.numel()] += add  # the hybrid's counters after these are its split's
    # [E + 1]: id E, another rank's expert, is in no wave here
    here = torch.cat([now, now.new_zeros(1)])
    return torch.where(here[ids], s.expert_to_slot[ids], -1), (src, dst, count.view(1))


def nomination_outcomes(need: torch.Tensor, resident: torch.Tensor, s: CacheState) -> torch.Tensor:
    """The last prefetch's nominations scored against this call, then cleared (so a call's later
    waves find none): a closed gate's exploring one (`s.explored`, -1: none), and would a copy of it
    have saved a miss; the runners-up (`s.runners_up`, not resident when nominated), and how many
    this call routed to. The counters EXPLORED, EXPLORED_PAID, RUNNERS_UP and RUNNERS_UP_PAID."""
    nominated = s.explored[0]
    paid = (need & ~resident & (torch.arange(need.numel(), device=need.device) == nominated)).any()
    outcome = torch.stack([nominated >= 0, paid, s.runners_up.sum(), (s.runners_up & need).sum()])
    s.explored.fill_(-1)
    s.runners_up.zero_()
    return outcome.to(s.counters.dtype)


def prefetch_reference(
    predicted, nominated, budget: int, policy: Policy, s: CacheState, nbytes: int
) -> Copies:
    """`prefetch`'s decision: the copies that admit the `budget` likeliest non-resident experts by
    `predicted`."""
    E = s.expert_to_slot.numel() - 1
    resident = s.expert_to_slot[:E] >= 0
    # a resident expert needs no copy: spend the budget elsewhere
    fresh = predicted.masked_fill(resident, 0)
    # ties: lower expert id first, as the kernel does
    top = torch.argsort(-fresh, stable=True)[:budget]
    want = torch.zeros_like(s.routed).index_fill_(0, top, True) & (fresh > 0)
    keep = resident & (predicted > 0)  # ... but do not evict it for a likelier one's sake
    src, dst, valid, count, gone, wasted = admit(want, keep, budget, policy, s)
    _put(s.source, dst, valid, nominated[src])
    # gone: distinct experts, or E (the trash row)
    s.evicted_at.index_put_((gone,), s.clock.expand_as(gone))
    add = torch.zeros_like(s.counters)
    add[Counter.EVICTIONS], add[Counter.BYTES_H2D] = (gone < E).sum(), count * nbytes
    add[Counter.PREFETCHED], add[Counter.WASTED] = count, wasted
    s.counters.add_(add)
    return src, dst, count.view(1)


def wave_plan(
    ids: torch.Tensor,
    wave: int,
    num_slots: int,
    resident: torch.Tensor,
    wave_of: torch.Tensor,
    elsewhere: torch.Tensor | None = None,  # [E] bool
):
    """Experts needed by this call [E], those in wave `wave` [E], those of later waves [E].

    Wave 0 ranks the needed experts but those `elsewhere` computes, resident ones first, and writes
    each one's wave to `wave_of` (-1: not needed, WAVE_ELSEWHERE: elsewhere's, in no wave); later
    waves of the call read it. An id E (another rank's expert) needs nothing."""
    E = resident.numel()
    need = resident.new_zeros(E + 1).index_fill_(0, ids.reshape(-1), True)[:E]
    if wave == 0:
        here = need if elsewhere is None else need & ~elsewhere
        first = here & resident
        rank = torch.where(first, first.cumsum(0), first.sum() + (here & ~first).cumsum(0)) - 1
        wave_of.copy_(torch.where(here, rank // num_slots, torch.where(need, WAVE_ELSEWHERE, -1)))
    return need, wave_of == wave, wave_of > wave


def _put(t: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, value) -> None:
    """t[idx] = value where valid, unchanged elsewhere; idx must hold distinct entries."""
    t.index_put_((idx,), torch.where(valid, value, t[idx]))


def admit(
    want: torch.Tensor,  # [E] bool: experts to make resident
    protect: torch.Tensor,  # [E] bool: evict these only if nothing else can go
    max_new: int,  # M
    policy: Policy,
    s: CacheState,
):
    """Plan and book the admission of the wanted experts not yet resident; the caller copies the
    data.

    Returns src [M] expert ids, dst [M] slots, valid [M], count [] (pairs i < count are real), gone
    [M] (the expert each pair evicted, E: none) and wasted [] (evicted prefetches that were never
    used). Victims are ranked by tier (empty < prefetched-unused < used < protected < wanted), then
    by the policy's score, so a wanted expert is never evicted: at most C are wanted, and every
    missing wanted expert leaves a slot not holding a wanted one.
    """
    E = want.numel()
    missing = want & (s.expert_to_slot[:E] < 0)
    count = missing.sum()
    src = torch.argsort((~missing).to(torch.int8), stable=True)[:max_new]  # missing experts first

    held = s.slot_to_expert.clamp(min=0)
    used_tier = torch.where(s.used, 2, 1)
    tier = torch.where(
        s.slot_to_expert < 0,
        0,
        torch.where(want[held], 4, torch.where(protect[held], 3, used_tier)),
    )
    by_score = torch.argsort(policy.score(s), stable=True)
    # victims, most evictable first
    dst = by_score[torch.argsort(tier[by_score], stable=True)][:max_new]

    valid = torch.arange(max_new, device=want.device) < count
    old = s.slot_to_expert[dst]
    evicted = valid & (old >= 0)
    wasted = evicted & ~s.used[dst]
    s.expert_to_slot.index_put_((torch.where(evicted, old, E),), torch.full_like(old, -1))
    s.expert_to_slot.index_put_((torch.where(valid, src, E),), dst)
    _put(s.slot_to_expert, dst, valid, src)
    _put(s.born, dst, valid, s.clock)
    _put(s.last_use, dst, valid, s.clock)
    _put(s.freq, dst, valid, torch.zeros_like(s.freq[dst]))
    _put(s.used, dst, valid, torch.zeros_like(s.used[dst]))
    _put(s.source, dst, valid, torch.zeros_like(s.source[dst]))
    return src, dst, valid, count, torch.where(evicted, old, E), wasted.sum()


def touch(want: torch.Tensor, s: CacheState) -> torch.Tensor:
    """Record a use of every slot holding a wanted expert; decay every frequency once per call.

    Returns [prefetch hits, the same by nominator (len(SOURCES)), timely ones]: slots a prefetch
    filled, used now for the first time; timely: by the call right after the prefetch (`clock` has
    moved once since it was `born`), the call the prediction was for.
    """
    hit = (s.slot_to_expert >= 0) & want[s.slot_to_expert.clamp(min=0)]
    first_use = hit & ~s.used & (s.source != 0)
    timely = first_use & (s.born == s.clock - 1)
    # built on the device: capturable
    bits = (2 ** torch.arange(len(SOURCES), device=hit.device)).to(s.source.dtype)
    by_source = (first_use[:, None] & ((s.source[:, None] & bits) != 0)).sum(0)
    s.used.logical_or_(hit)
    s.last_use.copy_(torch.where(hit, s.clock, s.last_use))
    s.freq.sub_(s.freq >> FREQ_DECAY_SHIFT).add_(hit.to(s.freq.dtype) * FREQ_UNIT)
    return torch.cat([first_use.sum().view(1), by_source, timely.sum().view(1)])
