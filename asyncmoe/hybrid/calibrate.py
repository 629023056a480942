"""The hybrid's cost model, calibrated on this host when the model is compiled: what a request to
the CPU costs (a round trip, each expert, each of its tokens) and what one copy costs, in ns.

Four requests of the model's own layers, taken in turns: one pair; n experts of a token each; the
same n of `TOKENS` tokens each (a decode batch's, well short of the kernels' prompt sizes); and, to
check the fit, half of them of two tokens each. Each request is on other experts than the last, so
their weights come from memory and not from the CPU's caches. The CPU's work on its own clock (the
executor's counters) gives an expert's and a token's cost, which n experts make stand above the
noise however small they are; the round trip is the pair's time end to end as a layer's call meets
it (on CUDA through the channel, with CUDA events; on the CPU in-line), less its work's costs. Eager,
it counts the host's launches too: that larger fixed cost splits better than a captured request's
(docs/decisions.md#tried-and-dropped). A copy is timed while the CPU serves the second request, as
in a step, where the two read host memory at once.

The requests repeat until every cost is above zero and known within `BOUND` of the smallest time it
enters (the medians' 95% notches, McGill et al. 1978, carried through the fit), and the costs
predict the fourth request within `FIT`; past `BUDGET_S` without that, or sooner where the spread so
far asks for more (work too small against the timings' noise), `CalibrationError` says what
was too noisy (docs/decisions.md#calibration-each-cost-within-20-in-3-s). A sync each, at compile
only.

Dims: T tokens, L layers, E experts, C slots, k experts a token.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from ..cache.expert_cache import ExpertCache
from ..cache.gather_copy import copy_ns, gather_copy
from ..compute.cpu.executor import CpuExecutor
from ..compute.cpu.kernels import STATS
from ..settings import HybridCosts
from .split import TOKENS, Cost

BOUND = 0.2  # a cost's 95% confidence half-width, at most this share of the smallest time it enters
FIT = 0.25  # the fourth request's work, as the costs predict it, off by at most this share
BUDGET_S = 3.0  # for all the requests together
MIN_REPEATS = 5
HOPELESS_AFTER = 40  # rounds before the spread so far may end the calibration ahead of its budget


class CalibrationError(RuntimeError):
    """The costs could not be timed on this host within the budget; the message says which."""


def calibrate(executor: CpuExecutor, cache: ExpertCache) -> HybridCosts:
    """The costs of `executor`'s requests and of `cache`'s copy, timed here; raises CalibrationError
    where the host is too noisy to time them within `BUDGET_S`."""
    E = executor.layers[0].num_experts
    n = min(E, executor.settings.max_tokens // TOKENS)
    # (experts, tokens each)
    shapes = {"one": (1, 1), "spread": (n, 1), "stacked": (n, TOKENS), "check": (max(2, n // 2), 2)}
    turn = iter(range(10**9))

    def payload(experts: int, each: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A request's hidden rows, expert ids and layer, on other experts than the last's."""
        r, tokens = next(turn), experts * each
        ids = (torch.arange(tokens) % experts + r * experts) % E
        x = torch.zeros(tokens, executor.hidden, dtype=executor.x_dtype, device=executor.device)
        return x, ids.view(tokens, 1).to(executor.device), r % len(executor.layers)

    def request(experts: int, each: int) -> Callable[[], tuple[float, float]]:
        return lambda: _request_ns(executor, *payload(experts, each))

    samplers = {name: request(*shape) for name, shape in shapes.items()}
    samplers["copy"] = lambda: (_copy_ns(cache, executor, *payload(n, 1)),)
    for sample in samplers.values():
        sample()  # first use: kernels compiled, threads woken
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in samplers}
    start = time.monotonic()
    while True:
        for name, sample in samplers.items():
            times[name].append(sample())
        rounds = len(times["one"])
        if rounds < MIN_REPEATS:
            continue
        costs, problem, short = _fit(times, shapes)
        if problem is None:
            return costs
        # a half-width shrinks as 1/sqrt(rounds): `short` times the rounds so far would meet BOUND
        spent = time.monotonic() - start
        if spent > BUDGET_S or (rounds >= HOPELESS_AFTER and spent * short > BUDGET_S):
            raise CalibrationError(
                f"{problem} after {rounds} rounds in {spent:.2g} s (the spread so far asks for "
                f"~{min(spent * short, 1e4):.2g} s, the budget is {BUDGET_S:g} s): the work is "
                "too small against the timings' noise, or other work on this host's cores or its "
                "memory bus upset them"
            )


def _notch(values: list[float]) -> tuple[float, float]:
    """The median and its 95% confidence half-width (1.58 IQR / sqrt(n))."""
    q1, median, q3 = statistics.quantiles(values, n=4)
    return median, 1.58 * (q3 - q1) / math.sqrt(len(values))


def _fit(
    times: dict[str, list[tuple[float, ...]]], shapes: dict[str, tuple[int, int]]
) -> tuple[HybridCosts | None, str | None, float]:
    """The costs from the medians (work = fixed + experts * per_expert + pairs * per_pair), or what
    keeps them from standing: a cost not above zero or not within BOUND, or a fit that misses the
    check request by more than FIT; and how many times the rounds so far that cost's half-width
    needs to come within BOUND of the time it enters."""
    (total, u_total), (one, u_one) = (_notch([t[i] for t in times["one"]]) for i in (0, 1))
    (spread, u_spread), (stacked, u_stacked), (check, _), (copy, u_copy) = (
        _notch([t[-1] for t in times[name]]) for name in ("spread", "stacked", "check", "copy")
    )
    n, m = shapes["spread"][0], shapes["check"][0]
    extra = n * (TOKENS - 1)  # the pairs `stacked` has beyond `spread`'s
    pair, u_pair = (stacked - spread) / extra, (u_stacked + u_spread) / extra
    expert = (spread - one) / (n - 1) - pair
    u_expert = (u_spread + u_one) / (n - 1) + u_pair
    trip, u_trip = total - expert - pair, u_total + u_expert + u_pair
    fitted = {  # the value, its uncertainty, the smallest time it enters, what it is
        "round_trip": (trip, u_trip, total, "a request's round trip"),
        "per_expert": (expert, u_expert, expert + pair, f"an expert's work ({n} of a token)"),
        "per_pair": (pair, u_pair, expert + pair, f"a token's ({n} experts of {TOKENS})"),
        "copy": (copy, u_copy, copy, "an expert's copy"),
    }
    for ns, uncertain, scale, what in fitted.values():
        if ns <= 0 or uncertain > BOUND * scale:
            short = (uncertain / (BOUND * abs(scale))) ** 2 if scale else math.inf
            return (
                None,
                (
                    f"{what} timed {ns / 1e3:.3g} µs ± {uncertain / 1e3:.2g} µs, not above zero "
                    f"within {BOUND:.0%} of {scale / 1e3:.3g} µs"
                ),
                short,
            )
    predicted = one + (m - 1) * expert + (2 * m - 1) * pair
    if abs(predicted - check) > FIT * check:
        return (
            None,
            (
                f"the costs predict {predicted / 1e3:.3g} µs of work for {m} experts of 2 tokens, "
                f"which took {check / 1e3:.3g} µs"
            ),
            1.0,
        )
    return HybridCosts(**{name: max(1, round(v[0])) for name, v in fitted.items()}), None, 1.0


def _request_ns(
    executor: CpuExecutor, x: torch.Tensor, ids: torch.Tensor, layer: int
) -> tuple[float, float]:
    """One request as a layer's call meets it, send then wait for the outputs, in ns: its time end
    to end, and the CPU's work in it (the executor's counters, zeroed: the model's stats count its
    own calls only)."""
    if executor.device.type != "cuda":
        start = time.perf_counter_ns()
        executor.send(x, ids, layer)
        executor.receive(layer, ids.numel())
        total = float(time.perf_counter_ns() - start)
    else:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(executor.device)  # at compile only, as every sync here
        start.record()
        executor.send(x, ids, layer)
        executor.receive(layer, ids.numel())
        end.record()
        end.synchronize()  # at compile only
        total = start.elapsed_time(end) * 1e6
    counts, _ = executor.stats(reset=True)
    return total, float(counts[layer, STATS.index("ns")])


def _copy_ns(
    cache: ExpertCache,
    executor: CpuExecutor,
    x: torch.Tensor,
    ids: torch.Tensor,
    layer: int,
) -> float:
    """One expert's copy, in ns. On CUDA it is timed while the CPU serves a request (`x`, `ids`) of
    the layer's, as in a hybrid step, where the link and the CPU read host memory at once and each
    copy takes longer than alone (docs/decisions.md#the-hybrids-cost-model). On the CPU, one copy
    in-line: there it cannot overlap."""
    one = torch.ones(1, dtype=torch.int64, device=cache.expert_to_slot.device)
    if not one.is_cuda:
        start = time.perf_counter_ns()
        gather_copy(cache.hosts, cache.slots, one - 1, one - 1, one)
        return float(time.perf_counter_ns() - start)
    ns = copy_ns(cache.hosts, cache.slots, beside=lambda: executor.send(x, ids, layer))
    executor.receive(layer, ids.numel())
    torch.cuda.synchronize(one.device)  # at compile only: the request done
    executor.stats(reset=True)  # the model's stats count its own calls only
    return ns


def cost_tensor(costs: HybridCosts, device: torch.device) -> torch.Tensor:
    """`costs` as the split reads them: [len(Cost)] int64, indexed by `Cost`."""
    return torch.tensor(
        [getattr(costs, c.name.lower()) for c in Cost], dtype=torch.int64, device=device
    )


def costs_of(cost: torch.Tensor) -> HybridCosts:
    """`cost_tensor`'s costs read back (a host sync: stats only)."""
    return HybridCosts(
        **{c.name.lower(): int(ns) for c, ns in zip(Cost, cost.tolist(), strict=True)}
    )


def split_ns(c: HybridCosts, misses: int) -> int:
    """The split's time for a call of `misses` misses of a token each, the link owing nothing else:
    min over the CPU's share n of max(its time, the link's for the rest)."""
    return min(
        max(c.round_trip + n * (c.per_expert + c.per_pair) if n else 0, (misses - n) * c.copy)
        for n in range(misses + 1)
    )


def pays(c: HybridCosts, top_k: int) -> bool:
    """Whether the split would send the CPU any of a decode call's `top_k` misses: the hybrid's
    default is on where it would."""
    return split_ns(c, top_k) < top_k * c.copy


def decode_miss_ns(c: HybridCosts, E: int, C: int, k: int, hybrid: bool) -> float:
    """A decode token's expected miss time in a layer of E experts and C slots, under uniform
    routing: its k distinct experts drawn alike, so m of them miss with the hypergeometric
    probability (k(1 - C/E) on average); each miss a copy, or `hybrid` the split's time."""
    return sum(
        math.comb(E - C, m) * math.comb(C, k - m) / math.comb(E, k)
        * (split_ns(c, m) if hybrid else m * c.copy)
        for m in range(min(k, E - C) + 1)
    )  # fmt: skip
