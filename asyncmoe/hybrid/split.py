"""Which of a call's misses the CPU computes and which the link copies: the cost model's decision, on
the device, in fixed shapes.

A call's misses are its routed experts that are not resident (m of them; h routed experts are). The
CPU takes them in the order of its cost (fewest tokens first: its time grows with each token, a
copy's does not), among equals the least likely to be routed again next call first (the Markov
policy's `follows`: `likely`), n of them; the link copies the other m - n one after another, so the
experts the slots keep are the ones worth keeping. Where the call's shapes fix its waves (a
CUDA graph capture, a torch.compile trace: `waves` False), the GPU's experts must fit the C slots at
once, so that `ensure` serves them in one wave: n >= h + m - C. Eager, the GPU may serve its experts
in waves, and the CPU takes only experts of at most `TOKENS` tokens each, the most the calibration
timed (past them its kernels' time grows faster than the costs say). Among those n, the one that
finishes both soonest:

    cpu(n) = round_trip + sum over the first n of (per_expert + tokens * per_pair)   (0 when n = 0)
    link(n) = busy + (m - n) * copy
    n = argmin over least <= n <= most of max(cpu(n), link(n)), the fewest on the CPU among equals
    least, most = max(0, h + m - C), m                  (waves False)
                  0, the misses of at most TOKENS tokens (waves True)

So a captured call of more distinct experts than slots (a batch) has the CPU compute the excess, and
the GPU the rest in one wave; an eager one splits by cost alone, the GPU's share in as many waves as
it fills. The caller sends a call of at most one CPU request (`max_tokens`).

`busy` is what the link still owes this call's prefetch: the experts a predictor admitted to this
layer for this call (slots born at its clock with a `source`), a copy each, less the compute they
hid behind (`pace`'s window). The misses' copies queue behind them on the link.

The costs are `cost` [len(Cost)] int64 ns, calibrated once (hybrid/calibrate.py). The decision adds n
to the layer's counter CPU_MISSES and max(cpu(n), link(n)) to COST_NS, the time the model predicts
for the call's misses. The CPU's experts go to `ensure` as `elsewhere`: routed, so the cache's history
and the prefetch's predictors see them, but never copied. `split_reference` is the plain-torch
decision (the CPU, and the kernels' reference); on CUDA `_split_kernel` makes it in one program, bit
for bit the same (integers), and `split_and_send` also sends the CPU's pairs to the worker from that
program (compute/cpu/request.py's `publish`).

Dims: E experts, T tokens, k experts a token, P = T*k pairs.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from .. import gpu
from ..cache.policies import LIKELY_MAX
from ..cache.state import PACE_WINDOW, CacheState, Counter
from ..compute.cpu.executor import CpuExecutor
from ..gpu import pointers

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None


# what the split kernels take of a `CacheState`: which experts are resident, which slots this call's
# prefetch filled, and the counters; their parameters `<field>_ptr`, bound by name
LIKELY = LIKELY_MAX + 1  # a sort key's factor: the likelihoods below it
TOKENS = 4  # an expert's most tokens in the calibration's requests: the costs hold up to there
CACHE_STATE = (
    "expert_to_slot", "slot_to_expert", "born", "source", "clock", "pace", "follows", "counters",
)  # fmt: skip


class Cost(IntEnum):
    """Indices of the cost model's `cost` [len(Cost)] int64, in ns."""

    ROUND_TRIP = 0  # a request to the CPU worker and its answer, beyond its experts' work
    PER_EXPERT = 1  # the CPU's work for one expert, beyond its tokens'
    PER_PAIR = 2  # ... for each of its tokens
    COPY = 3  # one expert copied host -> slot


def _busy(s: CacheState, cost: torch.Tensor) -> torch.Tensor:
    """[] int64 ns: what the link still owes this call's prefetch."""
    prefetched = ((s.born == s.clock) & (s.source != 0) & (s.slot_to_expert >= 0)).sum()
    return (prefetched * cost[Cost.COPY] - s.pace[PACE_WINDOW]).clamp(min=0)


def likely(routed: torch.Tensor, s: CacheState) -> torch.Tensor:
    """[E] int64 in [0, LIKELY): how often each expert followed the experts `routed` [E] bool in the
    calls after theirs (the Markov policy's `follows`, their mean); 0 where the policy learns none."""
    if s.follows.numel() == 0:
        return torch.zeros_like(routed, dtype=torch.int64)
    seen = (s.follows.long() * routed[:, None]).sum(0) // routed.sum().clamp(min=1)
    return seen.clamp(max=LIKELY - 1)


def split_reference(
    ids: torch.Tensor, s: CacheState, cost: torch.Tensor, waves: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` [P] -> (elsewhere [E] bool: the experts the CPU computes, cpu_ids [P]: -1 for the pairs
    it does not); `waves`: the GPU may serve its experts in waves."""
    expert_to_slot, counters = s.expert_to_slot, s.counters
    E = expert_to_slot.numel() - 1
    experts = torch.arange(E, device=ids.device)
    tokens = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    tokens = tokens.scatter_add_(0, ids, torch.ones_like(ids))[:E]  # [E]
    resident = expert_to_slot[:E] >= 0
    miss, hits = (tokens > 0) & ~resident, ((tokens > 0) & resident).sum()
    # misses first, by tokens, then by how likely the next call routes to them, then expert id
    key = torch.where(miss, tokens * LIKELY + likely(tokens > 0, s), ids.numel() * LIKELY + LIKELY)
    key = key * E + experts
    order = torch.argsort(key)
    rank = torch.empty_like(order).scatter_(0, order, experts)  # [E]: position in that order
    work = torch.where(miss, cost[Cost.PER_EXPERT] + tokens * cost[Cost.PER_PAIR], 0)[order]
    cpu = torch.cat([work.new_zeros(1), cost[Cost.ROUND_TRIP] + torch.cumsum(work, 0)])  # [E+1]
    m, n, C = miss.sum(), torch.arange(E + 1, device=ids.device), s.slot_to_expert.numel()
    finish = torch.maximum(cpu, _busy(s, cost) + (m - n).clamp(min=0) * cost[Cost.COPY])
    if waves:  # the CPU's experts within the costs' timed tokens (first in the order)
        least, most = 0, (miss & (tokens <= TOKENS)).sum()
    else:  # the GPU's experts fit the slots: h + m - n <= C
        least, most = hits + m - C, m
    allowed = (n <= most) & (n >= least)
    finish = finish.masked_fill(~allowed, torch.iinfo(torch.int64).max)
    n_cpu = torch.argmin(finish)  # the first of equal minima: the fewest on the CPU
    elsewhere = miss & (rank < n_cpu)
    on_cpu = torch.cat([elsewhere, miss.new_zeros(1)])[ids]  # [P]; id E: no expert
    counters[Counter.CPU_MISSES] += n_cpu
    counters[Counter.COST_NS] += finish[n_cpu]
    return elsewhere, torch.where(on_cpu, ids, -1)


if triton is not None:
    _ROUND_TRIP, _PER_EXPERT = tl.constexpr(Cost.ROUND_TRIP), tl.constexpr(Cost.PER_EXPERT)
    _PER_PAIR, _COPY = tl.constexpr(Cost.PER_PAIR), tl.constexpr(Cost.COPY)
    _CPU_MISSES, _COST_NS = tl.constexpr(Counter.CPU_MISSES), tl.constexpr(Counter.COST_NS)
    _WINDOW = tl.constexpr(PACE_WINDOW)
    _LIKELY, _ROWS = tl.constexpr(LIKELY), tl.constexpr(16)  # `follows` rows a block
    _TOKENS = tl.constexpr(TOKENS)

    from ..compute.cpu.request import BLOCK, SENT, publish

    @triton.jit
    def _likely(ids, tokens, follows_ptr, E, BE: tl.constexpr, FOLLOWS: tl.constexpr):
        """`likely` of the experts the call routes to: [BE] int64, the rows of `follows` summed a
        block of rows at a time (a whole [E, E] table would not fit one program's registers)."""
        e = tl.arange(0, BE)
        likely = tl.zeros([BE], dtype=tl.int64)
        if FOLLOWS:
            seen = tl.zeros([BE], dtype=tl.int64)
            for r0 in range(0, BE, _ROWS):
                rows = r0 + tl.arange(0, _ROWS)
                routed = tl.sum((ids[:, None] == rows[None, :]).to(tl.int32), axis=0) > 0
                table = tl.load(
                    follows_ptr + rows[:, None] * E + e[None, :],
                    mask=(routed & (rows < E))[:, None] & (e < E)[None, :],
                    other=0,
                )
                seen += tl.sum(table.to(tl.int64), axis=0)
            # the experts routed: not the padding pairs' id E, whose row is no expert's
            n = tl.maximum(tl.sum(((tokens > 0) & (e < E)).to(tl.int64)), 1)
            likely = tl.minimum(seen // n, _LIKELY - 1)
        return likely

    @triton.jit
    def _decide(
        ids_ptr, expert_to_slot_ptr, slot_to_expert_ptr, born_ptr, source_ptr, clock_ptr, pace_ptr,
        follows_ptr, cost_ptr, counters_ptr, elsewhere_ptr, cpu_ids_ptr, P, E, C,
        BP: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, FOLLOWS: tl.constexpr, WAVES: tl.constexpr,
    ):  # fmt: skip
        """The split, stored; returns the CPU's pair ids [BP] (-1: the GPU's) and their offsets."""
        p, e = tl.arange(0, BP), tl.arange(0, BE)
        ids = tl.load(ids_ptr + p, mask=p < P, other=E)
        tokens = tl.sum((ids[:, None] == e[None, :]).to(tl.int64), axis=0)  # [BE]
        slot = tl.load(expert_to_slot_ptr + e, mask=e < E, other=0)
        miss = (tokens > 0) & (slot < 0) & (e < E)
        hits = tl.sum(((tokens > 0) & (slot >= 0) & (e < E)).to(tl.int64))
        # sorted keys carry the expert in their low bits: misses first, by tokens, then by how likely
        # the next call routes to them, then expert id
        likely = _likely(ids, tokens, follows_ptr, E, BE, FOLLOWS)
        keys = tl.sort(tl.where(miss, tokens * _LIKELY + likely, (P + 1) * _LIKELY) * BE + e)
        expert, miss_sorted = keys % BE, keys < (P + 1) * _LIKELY * BE
        work = tl.where(
            miss_sorted,
            tl.load(cost_ptr + _PER_EXPERT)
            + (keys // BE // _LIKELY) * tl.load(cost_ptr + _PER_PAIR),
            0,
        )
        m, copy = tl.sum(miss.to(tl.int64)), tl.load(cost_ptr + _COPY)
        # the link's debt to this call's prefetch
        c = tl.arange(0, BC)
        prefetched = (
            (tl.load(born_ptr + c, mask=c < C, other=-1) == tl.load(clock_ptr))
            & (tl.load(source_ptr + c, mask=c < C, other=0) != 0)
            & (tl.load(slot_to_expert_ptr + c, mask=c < C, other=-1) >= 0)
        )
        busy = tl.maximum(tl.sum(prefetched.to(tl.int64)) * copy - tl.load(pace_ptr + _WINDOW), 0)
        n = e + 1  # the CPU taking the first n misses, n >= 1
        finish = tl.maximum(
            tl.load(cost_ptr + _ROUND_TRIP) + tl.cumsum(work, 0), busy + (m - n) * copy
        )
        if WAVES:  # the CPU's experts within the costs' timed tokens (first in the order)
            least = tl.full([], 0, tl.int64)
            most = tl.sum((miss & (tokens <= _TOKENS)).to(tl.int64))
        else:  # the GPU's experts fit the slots: n >= h + m - C
            least, most = hits + m - C, m
        finish = tl.where((n <= most) & (n >= least), finish, 0x7FFFFFFFFFFFFFFF)
        best = tl.min(finish, 0)
        none = tl.where(least <= 0, busy + m * copy, 0x7FFFFFFFFFFFFFFF)  # n = 0
        n_cpu = tl.where(best < none, tl.min(tl.where(finish == best, n, BE + 1), 0), 0)
        cpu_sorted = miss_sorted & (n <= n_cpu)
        on_cpu = (
            tl.max(((ids[:, None] == expert[None, :]) & cpu_sorted[None, :]).to(tl.int32), axis=1)
            > 0
        )
        cpu_ids = tl.where(on_cpu, ids, -1)
        tl.store(elsewhere_ptr + expert, cpu_sorted, mask=expert < E)  # a permutation of 0..BE-1
        tl.store(cpu_ids_ptr + p, cpu_ids, mask=p < P)
        tl.store(counters_ptr + _CPU_MISSES, tl.load(counters_ptr + _CPU_MISSES) + n_cpu)
        tl.store(counters_ptr + _COST_NS, tl.load(counters_ptr + _COST_NS) + tl.minimum(best, none))
        return cpu_ids, p

    @triton.jit
    def _split_kernel(
        ids_ptr, cost_ptr, elsewhere_ptr, cpu_ids_ptr, P, E, C,
        # the cache's state (CACHE_STATE, by name)
        expert_to_slot_ptr, slot_to_expert_ptr, born_ptr, source_ptr, clock_ptr, pace_ptr, follows_ptr,
        counters_ptr,
        BP: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, FOLLOWS: tl.constexpr, WAVES: tl.constexpr,
    ):  # fmt: skip
        _decide(
            ids_ptr, expert_to_slot_ptr, slot_to_expert_ptr, born_ptr, source_ptr, clock_ptr, pace_ptr,
            follows_ptr, cost_ptr, counters_ptr, elsewhere_ptr, cpu_ids_ptr, P, E, C, BP, BE, BC, FOLLOWS,
            WAVES,
        )  # fmt: skip

    @triton.jit
    def _split_send_kernel(
        ids_ptr, cost_ptr, elsewhere_ptr, cpu_ids_ptr, P, E, C, x_ptr, seq_ptr, layer, T, k, H,
        # the cache's state (CACHE_STATE, by name)
        expert_to_slot_ptr, slot_to_expert_ptr, born_ptr, source_ptr, clock_ptr, pace_ptr, follows_ptr,
        counters_ptr,
        # the channel's (request.SENT, by name)
        chan_request_ptr, chan_awake_ptr, chan_layer_ptr, chan_token_ids_ptr, chan_expert_ids_ptr, chan_x_ptr,
        BP: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, FOLLOWS: tl.constexpr, WAVES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        cpu_ids, p = _decide(
            ids_ptr, expert_to_slot_ptr, slot_to_expert_ptr, born_ptr, source_ptr, clock_ptr, pace_ptr,
            follows_ptr, cost_ptr, counters_ptr, elsewhere_ptr, cpu_ids_ptr, P, E, C, BP, BE, BC, FOLLOWS,
            WAVES,
        )  # fmt: skip
        publish(
            x_ptr, cpu_ids, p, seq_ptr, chan_request_ptr, chan_awake_ptr, chan_layer_ptr, chan_token_ids_ptr,
            chan_expert_ids_ptr, chan_x_ptr, layer, T, k, H, BLOCK,
        )  # fmt: skip


def split(
    top_k_index: torch.Tensor, s: CacheState, cost: torch.Tensor, use_kernel: bool | None = None,
    waves: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`top_k_index` [T, k] -> (elsewhere [E] bool, cpu_ids [T, k]): the experts the CPU computes,
    which the cache counts as routed but does not copy, and each pair's expert where the CPU computes
    it (-1 elsewhere, which the CPU worker skips). Adds to `s.counters`. `waves`: the GPU may serve
    its experts in waves (an eager call)."""
    ids = top_k_index.long().reshape(-1)
    if not (gpu.available(ids) if use_kernel is None else use_kernel):
        elsewhere, cpu_ids = split_reference(ids, s, cost, waves)
        return elsewhere, cpu_ids.view(top_k_index.shape)
    elsewhere, cpu_ids, sizes, (BP, BE, BC) = _outputs(ids, s)
    _split_kernel[(1,)](
        ids, cost, elsewhere, cpu_ids, *sizes, **pointers(s, CACHE_STATE), BP=BP, BE=BE, BC=BC,
        FOLLOWS=s.follows.numel() > 0, WAVES=waves,
    )  # fmt: skip
    return elsewhere, cpu_ids.view(top_k_index.shape)


def split_and_send(
    x: torch.Tensor, top_k_index: torch.Tensor, s: CacheState, cost: torch.Tensor,
    executor: CpuExecutor, layer: int, waves: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`split`, and the CPU's pairs of rows `x` [T, H] sent to the worker of `executor` (on CUDA) as
    a request of `layer`, in the same kernel."""
    executor.check_request(x, top_k_index)
    ids = top_k_index.long().reshape(-1)
    elsewhere, cpu_ids, sizes, (BP, BE, BC) = _outputs(ids, s)
    T, k = top_k_index.shape
    _split_send_kernel[(1,)](
        ids, cost, elsewhere, cpu_ids, *sizes, x.contiguous(), executor.seq, layer, T, k, x.shape[1],
        **pointers(s, CACHE_STATE), **pointers(executor.gpu, SENT, "chan_"),
        BP=BP, BE=BE, BC=BC, FOLLOWS=s.follows.numel() > 0, WAVES=waves, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return elsewhere, cpu_ids.view(top_k_index.shape)


def _outputs(ids: torch.Tensor, s: CacheState):
    """The split kernels' outputs, empty; their sizes (P, E, C) and blocks (BP, BE, BC)."""
    sizes = ids.numel(), s.expert_to_slot.numel() - 1, s.slot_to_expert.numel()
    elsewhere = torch.empty(sizes[1], dtype=torch.bool, device=ids.device)
    blocks = tuple(triton.next_power_of_2(max(n, 2)) for n in sizes)
    return elsewhere, torch.empty_like(ids), sizes, blocks
