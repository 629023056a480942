"""A prompt's waves streamed: an eager call over the slots served in waves of C // 2 experts, each
wave's copies made by the copy engine while the wave before it computes.

An eager call may wait on the host (a capture or trace never comes here: `providers._fixed_shapes`),
so its decisions come first, all on the compute stream: wave 0's, which ranks the call's experts
(resident first), and, once the host has read how many waves they fill, the others'
(`algorithm`'s streamed waves: each keeps the wave before it resident). One more host wait reads
every wave's copies; then each wave's copies go on the copy stream, at the host addresses the copy
engine takes (`ExpertCache.pinned`), and its compute on the compute stream, ordered by events:

    copy stream:     wave w's copies, once wave w - 2 has computed   -> ready[w]
    compute stream:  wave w's compute, once ready[w]                 -> done[w]

Wave w refills only slots that waves before w - 1 held, so its copies overlap wave w - 1's compute,
and the link moves the call's misses back to back, in the order the call computes them
(docs/decisions.md#streamed-prompts). With one slot there is no other half: each wave's copies wait
for the wave before it. On the CPU the same decisions run, the copies in line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from . import algorithm
from .expert_cache import ExpertCache
from .streams import SIDE


def streamed_waves(
    cache: ExpertCache,
    top_k_index: torch.Tensor,  # [T, k]
    compute: Callable[[torch.Tensor], torch.Tensor],  # slot ids [T, k] -> outputs [T*k, H]
    wait: bool = False,
) -> torch.Tensor:
    """Every pair's expert output [T*k, H], `compute` run once a wave on the slots it filled.
    `wait`: a prefetch into this layer was issued earlier in the forward (decide after it has)."""
    s, cuda = cache.state, cache.expert_to_slot.is_cuda
    streamed = cache.num_slots >= 2
    if wait and cuda:
        torch.cuda.current_stream().wait_event(SIDE.planned(s.expert_to_slot))
    plans = [algorithm.ensure_plan(top_k_index, 0, cache.policy, s, cache.slots, streamed=streamed)]
    waves = int(s.wave_of.max()) + 1  # host wait: how many waves the call's experts fill
    for wave in range(1, waves):
        plans.append(
            algorithm.ensure_plan(
                top_k_index, wave, cache.policy, s, cache.slots, streamed=streamed
            )
        )
    copies = _host_copies([c for _, c in plans])  # host wait: every wave's (src, dst) pairs
    lag = 2 if streamed else 1  # the wave whose slots wave w may refill must have computed
    copier = SIDE.stream(cache.expert_to_slot.device, "copy") if cuda else None
    if cuda:
        copier.wait_stream(torch.cuda.current_stream())  # the decisions, and a prefetch's tables
    out, done = None, []
    for wave, (slots, _) in enumerate(plans):
        if copies[wave]:
            if cuda and wave >= lag:
                copier.wait_event(done[wave - lag])
            with torch.cuda.stream(copier) if cuda else contextlib.nullcontext():
                _copy(cache.pinned, cache.slots, copies[wave])
            if cuda:
                torch.cuda.current_stream().wait_stream(copier)
        part = compute(slots)
        out = part if out is None else torch.where((slots >= 0).reshape(-1, 1), part, out)
        if cuda:
            done.append(torch.cuda.Event())
            done[-1].record()
    return out


def _host_copies(plans: list[algorithm.Copies]) -> list[list[tuple[int, int]]]:
    """Each wave's real (expert, slot) copies, read to the host in one transfer."""
    src = torch.stack([p[0] for p in plans]).cpu()
    dst = torch.stack([p[1] for p in plans]).cpu()
    count = torch.cat([p[2] for p in plans]).cpu()
    return [
        list(zip(src[w, :n].tolist(), dst[w, :n].tolist())) for w, n in enumerate(count.tolist())
    ]


def _copy(hosts: list[torch.Tensor], slots: list[torch.Tensor], pairs: list[tuple[int, int]]):
    """Expert rows host -> slot, one copy per run of consecutive experts into consecutive slots."""
    start = 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i] != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
            (e, c), n = pairs[start], i - start
            for host, slot in zip(hosts, slots):
                slot[c : c + n].copy_(host[e : e + n], non_blocking=True)
            start = i
