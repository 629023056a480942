"""The hybrid's cost model, calibrated on this host when the model is compiled: what a request to
the CPU costs (a round trip, each expert, each of its tokens) and what one copy costs, in ns.

The CPU's costs are timed end to end as a layer's call meets them, on real requests of the model's
own layers (on CUDA through the channel, with CUDA events; on the CPU in-line), each request on
other experts than the last, so their weights come from memory and not from the CPU's caches. Eager,
the round trip counts the host's launches too: that larger fixed cost splits better than a captured
request's (docs/decisions.md#tried-and-dropped). Medians of a few repeats; a sync each, at compile
only.

Dims: T tokens, k experts a token, L layers, E experts.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..cache.expert_cache import ExpertCache
from ..cache.gather_copy import copy_ns, gather_copy
from ..compute.cpu.executor import CpuExecutor
from .split import Cost

REPEATS = 7


def calibrate(executor: CpuExecutor, cache: ExpertCache) -> list[int]:
    """The costs in ns, indexed by `Cost`, fitted to three requests: one pair, n
    tokens each routed to an expert of its own, and T tokens routed to one expert; and `cache`'s
    copy."""
    E = executor.layers[0].num_experts
    n, T = min(E, 8), min(executor.settings.max_tokens, 16)
    turn = iter(range(10**9))

    def timed(tokens: int, distinct: bool) -> float:
        def once() -> float:
            r = next(turn)
            first = r * tokens
            ids = (
                (torch.arange(tokens) + first) % E if distinct else torch.full((tokens,), first % E)
            )
            x = torch.zeros(tokens, executor.hidden, dtype=executor.x_dtype, device=executor.device)
            return _request_ns(
                executor, x, ids.view(tokens, 1).to(executor.device), r % len(executor.layers)
            )

        once()  # first use: kernels compiled, threads woken
        return statistics.median(once() for _ in range(REPEATS))

    one, experts, tokens = timed(1, True), timed(n, True), timed(T, False)
    per_pair = max(0.0, (tokens - one) / (T - 1))
    per_expert = max(0.0, (experts - one) / (n - 1) - per_pair)
    cost = [0] * len(Cost)
    cost[Cost.ROUND_TRIP] = int(max(0.0, one - per_expert - per_pair))
    cost[Cost.PER_EXPERT], cost[Cost.PER_PAIR] = int(per_expert), int(per_pair)
    cost[Cost.COPY] = _copy_ns(cache)
    executor.stats(reset=True)  # stats count the model's calls only
    return cost


def _request_ns(executor: CpuExecutor, x: torch.Tensor, ids: torch.Tensor, layer: int) -> float:
    """One request's round trip as a layer's call meets it: send, then wait for the outputs."""
    if executor.device.type != "cuda":
        start = time.perf_counter_ns()
        executor.send(x, ids, layer)
        executor.receive(layer, ids.numel())
        return float(time.perf_counter_ns() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(executor.device)  # at compile only, as every sync here
    start.record()
    executor.send(x, ids, layer)
    executor.receive(layer, ids.numel())
    end.record()
    end.synchronize()  # at compile only
    return start.elapsed_time(end) * 1e6


def _copy_ns(cache: ExpertCache) -> int:
    if cache.expert_to_slot.is_cuda:
        return copy_ns(cache.hosts, cache.slots)
    one = torch.ones(1, dtype=torch.int64)
    gather_copy(cache.hosts, cache.slots, one - 1, one - 1, one)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter_ns()
        gather_copy(cache.hosts, cache.slots, one - 1, one - 1, one)
        times.append(time.perf_counter_ns() - start)
    return int(statistics.median(times))


def pays(c: list[int], top_k: int) -> bool:
    """Whether the split would send the CPU any of a decode call's `top_k` misses, by the costs `c`
    (`calibrate`): the hybrid's default is on where it would."""
    for n in range(1, top_k + 1):
        cpu = c[Cost.ROUND_TRIP] + n * (c[Cost.PER_EXPERT] + c[Cost.PER_PAIR])
        if max(cpu, (top_k - n) * c[Cost.COPY]) < top_k * c[Cost.COPY]:
            return True
    return False
