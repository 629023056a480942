"""Every custom op asyncmoe adds: the only surface torch.compile sees.

Each op is opaque to Dynamo and Inductor, so a compiled graph stays whole around cache decisions
whose insides (sorts, scatters, a Triton copy, a side stream) need not be traced; `mutates_args`
names every tensor an op writes, so functionalization orders the expert compute after the copies it
reads, and a layer's `ensure` after the `prefetch` into the same layer (both write its tables).
Each op has its fake beside it, whose `torch._check`s state the contract.

Streams: `prefetch` forks a side stream from the current (compute) stream, predicts, admits and copies there,
and records one event per target cache; `ensure(wait=True)` makes the compute stream wait on that
event before it reads the tables. Every prefetch targets a later layer of the same forward, whose
`ensure` waits, so side-stream work has rejoined before the forward returns (a CUDA-graph capture
must end joined). On the CPU there are no streams: `prefetch` runs inline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import expert_cache
from .cache.expert_cache import ExpertCache
from .kernels import clock
from .predict import predictors

_side_streams: dict[int, torch.cuda.Stream] = {}
_ready: dict[int, torch.cuda.Event] = {}  # per target cache (keyed by its expert_to_slot address)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


def _event(key: int) -> torch.cuda.Event:
    if key not in _ready:
        _ready[key] = torch.cuda.Event()
    return _ready[key]


@torch.library.custom_op(
    "asyncmoe::ensure",
    mutates_args=("expert_to_slot", "slot_to_expert", "state", "counters", "timer", "pace", "slots"),
)
def _ensure(
    top_k_index: Tensor,
    wave: int,
    wait: bool,
    lap: bool,
    policy: str,
    expert_to_slot: Tensor,
    slot_to_expert: Tensor,
    state: list[Tensor],
    counters: Tensor,
    timer: Tensor,
    pace: Tensor,
    hosts: list[Tensor],
    slots: list[Tensor],
) -> Tensor:
    """Make this call's wave of routed experts resident in the slots; return their slot ids.

    Decided on the device with fixed-shape ops (see `cache.expert_cache`); misses are copied
    host -> slot by the gather-copy kernel, whose count stays in device memory. `wait`: first wait
    for the prefetch into this layer issued earlier in the forward. A non-empty `timer` (CUDA) times
    the wait and the rest on the GPU clock (kernels.clock). `lap`: first fold the time since the prefetch
    op stamped `pace` into its window (the compute that prefetch had to hide behind; see `providers.link`).
    """
    if lap and expert_to_slot.is_cuda:
        clock.window(pace)
    timed = timer.numel() > 0
    if timed:
        clock.stamp(timer, 0)
    if wait and expert_to_slot.is_cuda:
        torch.cuda.current_stream().wait_event(_event(expert_to_slot.data_ptr()))
    if timed:
        clock.stamp(timer, 1)
    out = expert_cache.ensure(top_k_index, wave, policy, expert_to_slot, slot_to_expert, state, counters, hosts, slots)
    if timed:
        clock.lap(timer)
    return out


@_ensure.register_fake
def _(top_k_index, wave, wait, lap, policy, expert_to_slot, slot_to_expert, state, counters, timer, pace, hosts, slots):
    C = slot_to_expert.shape[0]
    torch._check(top_k_index.dim() == 2, lambda: f"top_k_index must be [tokens, top_k], got {top_k_index.dim()}D")
    torch._check(
        top_k_index.shape[1] <= C,
        lambda: f"top_k={top_k_index.shape[1]} exceeds the cache's {C} slots: every token needs its top_k experts "
        f"resident at once; use cache>={top_k_index.shape[1]}",
    )
    torch._check(len(hosts) == len(slots), lambda: "hosts and slots must pair up")
    torch._check(timer.numel() in (0, 4), lambda: f"timer must be empty (not timed) or [4], got {tuple(timer.shape)}")
    torch._check(pace.shape == (3,), lambda: f"pace must be [3], got {tuple(pace.shape)}")
    torch._check(expert_to_slot.dtype == torch.int64, lambda: "expert_to_slot must be int64")
    return torch.empty(top_k_index.shape, dtype=torch.int64, device=top_k_index.device)


def ensure(cache: ExpertCache, top_k_index: Tensor, wave: int, wait: bool = False, lap: bool = False) -> Tensor:
    """`asyncmoe::ensure` on one layer's cache buffers; slot ids [T, k], -1 for pairs of other waves."""
    return torch.ops.asyncmoe.ensure(
        top_k_index, wave, wait, lap, cache.policy, cache.expert_to_slot, cache.slot_to_expert, cache.state,
        cache.counters, cache.timer, cache.pace, cache.hosts, cache.slots,
    )


@torch.library.custom_op(
    "asyncmoe::prefetch",
    mutates_args=("predicted", "nominated", "expert_to_slot", "slot_to_expert", "state", "counters", "outcomes", "pace", "slots"),
)
def _prefetch(
    gate: Tensor | None,
    temporal: bool,
    routed_before: Tensor | None,
    transitions: Tensor | None,
    budget: int,
    copy_programs: int,
    stamp: bool,
    policy: str,
    predicted: Tensor,
    nominated: Tensor,
    expert_to_slot: Tensor,
    slot_to_expert: Tensor,
    state: list[Tensor],
    counters: Tensor,
    outcomes: Tensor,
    pace: Tensor,
    hosts: list[Tensor],
    slots: list[Tensor],
) -> None:
    """Predict a later layer's experts and admit up to `budget` of them into its cache, on a side stream.

    Predictors (predict.predictors): `gate`, the target's gate buffer [E], scored by `gate_scores` on
    the compute stream from this layer's hidden states (the one predictor input that is a compute-stream
    temporary); `temporal` (the target's routing last call, its own `routed`); `routed_before` and
    `transitions` for the transition predictor. On CUDA the side stream runs one kernel for the
    scores and the prefetch gate, one for the decision, then the copy (in torch ops it was ~40 kernels per layer
    beside the compute). The copy runs on at most `copy_programs` Triton programs (0: one per block),
    so the compute stream keeps most SMs. `stamp`: first stamp `pace` on the compute stream, which the
    target's `ensure(lap=True)` measures the compute this prefetch hides behind from.
    """

    def run():
        expert_cache.predict_and_prefetch(
            gate, temporal, routed_before, transitions, budget, policy, predicted,
            nominated, expert_to_slot, slot_to_expert, state, counters, hosts, slots, outcomes, pace, copy_programs or None,
        )

    if not expert_to_slot.is_cuda:
        run()
        return
    if stamp:
        clock.stamp(pace, 0)
    compute = torch.cuda.current_stream()
    side = _side_stream(expert_to_slot.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        run()
        _event(expert_to_slot.data_ptr()).record(side)


@_prefetch.register_fake
def _(gate, temporal, routed_before, transitions, budget, copy_programs, stamp, policy, predicted, nominated, expert_to_slot,
      slot_to_expert, state, counters, outcomes, pace, hosts, slots):
    E, C = expert_to_slot.shape[0] - 1, slot_to_expert.shape[0]
    torch._check(gate is not None or temporal or routed_before is not None, lambda: "prefetch needs a predictor")
    torch._check(gate is None or gate.shape == (E,), lambda: f"gate scores must be [num_experts={E}], got {tuple(gate.shape)}")
    torch._check(
        (routed_before is None) == (transitions is None), lambda: "the transition predictor needs routed_before and transitions"
    )
    torch._check(
        transitions is None or transitions.shape == (routed_before.shape[0], E),
        lambda: f"transitions must be [{routed_before.shape[0]}, {E}], got {tuple(transitions.shape)}",
    )
    torch._check(0 < budget <= C, lambda: f"prefetch budget {budget} must be in 1..{C} (the cache's slots)")


def prefetch(
    cache: ExpertCache,
    budget: int,
    gate: bool = False,
    temporal: bool = False,
    routed_before: Tensor | None = None,
    copy_programs: int | None = None,
    stamp: bool = False,
) -> None:
    """`asyncmoe::prefetch` into `cache`. `gate`: use the scores `gate_scores` left in `cache.gate`;
    `routed_before` (the previous layer's routing) turns on the transition predictor."""
    transitions = cache.transitions if routed_before is not None else None
    torch.ops.asyncmoe.prefetch(
        cache.gate if gate else None, temporal, routed_before, transitions, budget, copy_programs or 0, stamp,
        cache.policy, cache.predicted, cache.nominated, cache.expert_to_slot, cache.slot_to_expert, cache.state, cache.counters, cache.outcomes,
        cache.pace, cache.hosts, cache.slots,
    )


@torch.library.custom_op("asyncmoe::gate_scores", mutates_args=("out",))
def _gate_scores(x: Tensor, weight: Tensor, bias: Tensor | None, per_token: int, out: Tensor) -> None:
    """The gate predictor: layer l+1's router `weight` [E, H] on layer l's MoE input `x` [T, H] -> scores `out` [E].

    An op so that torch.compile need not trace the Triton kernel it launches on CUDA (predict.predictors).
    It writes the target layer's `gate` buffer, which the prefetch op reads on the side stream.
    """
    predictors.gate_scores(x, weight, bias, per_token, out)


@_gate_scores.register_fake
def _(x, weight, bias, per_token, out):
    torch._check(
        x.dim() == 2 and x.shape[1] == weight.shape[1],
        lambda: f"gate scores need x [tokens, {weight.shape[1]}] for a router of {weight.shape[1]} inputs, got {tuple(x.shape)}",
    )
    torch._check(per_token > 0, lambda: f"per_token must be positive, got {per_token}")
    torch._check(
        out.shape == (weight.shape[0],) and out.dtype == torch.float32,
        lambda: f"out must be float32 [{weight.shape[0]}], got {out.dtype} {tuple(out.shape)}",
    )


def gate_scores(x: Tensor, router: tuple[Tensor, Tensor | None], per_token: int, cache: ExpertCache) -> None:
    """Score the router's layer's experts (`cache`, the prefetch target) from `x` into `cache.gate`."""
    torch.ops.asyncmoe.gate_scores(x, router[0], router[1], per_token, cache.gate)


@torch.library.custom_op("asyncmoe::observe", mutates_args=("transitions",))
def _observe(previous: Tensor, routed: Tensor, transitions: Tensor) -> None:
    """Add this call's (expert at the previous MoE layer -> expert here) pairs to the decayed transition counts."""
    expert_cache.observe(previous, routed, transitions)


@_observe.register_fake
def _(previous, routed, transitions):
    torch._check(
        transitions.shape == (previous.shape[0], routed.shape[0]),
        lambda: f"transitions must be [{previous.shape[0]}, {routed.shape[0]}], got {tuple(transitions.shape)}",
    )


def observe(previous: ExpertCache, cache: ExpertCache) -> None:
    torch.ops.asyncmoe.observe(previous.routed, cache.routed, cache.transitions)
