"""The prefetch's custom ops with their fakes: `prefetch` (predict, admit and copy into a later
layer's cache, on the side streams), `gate_scores` (the gate predictor), `gate_join` (the compute
stream's wait for the gate's input to be read) and `observe` (the transition counts). The streams
and events they use: cache/streams.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import algorithm, clock
from ..cache.expert_cache import ExpertCache
from ..cache.ops import check_state
from ..cache.state import PACE_STAMP, TRANSITION, CacheState
from ..cache.streams import SIDE
from . import predictors
from .prefetch import Request, predict_and_plan, predict_and_prefetch
from .state import PrefetchBuffers, PrefetchState


@torch.library.custom_op("asyncmoe::prefetch", mutates_args=("state", "prefetch_state", "slots"))
def _prefetch(
    sources: int,
    budget: int,
    copy_programs: int,
    stamp: bool,
    policy: str,
    state: list[Tensor],
    prefetch_state: list[Tensor],
    routed_before: Tensor | None,
    hosts: list[Tensor],
    slots: list[Tensor],
    source: Tensor | None = None,
) -> None:
    """Predict a later layer's experts and admit up to `budget` of them into its cache, on a side
    stream.

    `state` is the target's cache, `prefetch_state` its `PrefetchState`. `sources`: bits of the
    predictors (cache.state GATE, TEMPORAL, TRANSITION): the gate's scores are in the target's
    `gate` (written by `gate_scores`, earlier on the same stream), temporal reads its `routed`,
    transition its `transitions` and `routed_before`, the previous layer's routing. The copy runs on
    at most `copy_programs` Triton programs (0: one per block), so the compute stream keeps most
    SMs. `stamp`: first stamp `pace` on the compute stream, from which the target's
    `ensure(lap=True)` measures the window. `source`: the `routed` of the layer predicted from,
    whose `ensure` ran before: predict and admit while its copies run, copy after them
    (SideStreams.fork).
    """
    s, p = CacheState._make(state), PrefetchState._make(prefetch_state)
    request = Request(sources, budget, policy, copy_programs or None)
    if not s.expert_to_slot.is_cuda:
        predict_and_prefetch(request, s, p, routed_before, hosts, slots)
        return
    if stamp:
        clock.stamp(s.pace, PACE_STAMP)
    with torch.cuda.stream(SIDE.fork(s.expert_to_slot.device, source)):
        copies = predict_and_plan(request, s, p, routed_before, slots)
        SIDE.planned(s.expert_to_slot).record()
    with torch.cuda.stream(SIDE.copier(s.expert_to_slot, source, copies)):
        algorithm.copy_in(hosts, slots, copies, request.copy_programs)
        SIDE.ready(s.expert_to_slot).record()


@_prefetch.register_fake
def _(
    sources,
    budget,
    copy_programs,
    stamp,
    policy,
    state,
    prefetch_state,
    routed_before,
    hosts,
    slots,
    source=None,
):
    s = check_state(state)
    torch._check(
        len(prefetch_state) == len(PrefetchState._fields),
        lambda: (
            f"prefetch_state must hold the {len(PrefetchState._fields)} PrefetchState tensors, "
            f"got {len(prefetch_state)}"
        ),
    )
    p = PrefetchState._make(prefetch_state)
    E, C = s.expert_to_slot.shape[0] - 1, s.slot_to_expert.shape[0]
    torch._check(sources > 0, lambda: "prefetch needs a predictor")
    torch._check(
        not (sources & TRANSITION) or routed_before is not None,
        lambda: "the transition predictor needs routed_before",
    )
    torch._check(
        not (sources & TRANSITION) or p.transitions.shape == (routed_before.shape[0], E),
        lambda: (
            f"transitions must be [{routed_before.shape[0]}, {E}], got {tuple(p.transitions.shape)}"
        ),
    )
    torch._check(
        0 < budget <= C, lambda: f"prefetch budget {budget} must be in 1..{C} (the cache's slots)"
    )


def prefetch(
    cache: ExpertCache,
    buffers: PrefetchBuffers,
    sources: int,
    budget: int,
    routed_before: Tensor | None = None,
    copy_programs: int | None = None,
    stamp: bool = False,
    source: ExpertCache | None = None,
) -> None:
    """`asyncmoe::prefetch` into `cache` (with its prefetch `buffers`) from the predictors in the
    bits `sources`; `source`: the cache of the layer predicted from, whose `ensure` ran before."""
    torch.ops.asyncmoe.prefetch(
        sources,
        budget,
        copy_programs or 0,
        stamp,
        cache.policy,
        list(cache.state),
        list(buffers.state),
        routed_before,
        cache.hosts,
        cache.slots,
        None if source is None else source.routed,
    )


@torch.library.custom_op("asyncmoe::gate_scores", mutates_args=("out",))
def _gate_scores(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    per_token: int,
    out: Tensor,
    recorded: list[Tensor],
    source: Tensor | None = None,
) -> None:
    """The gate predictor: layer l+1's router `weight` [E, H] on layer l's MoE input `x` [T, H] ->
    scores `out` [E].

    On CUDA on the side stream, so the router matmul and the scoring stay off the compute stream's
    path; the caller joins with `gate_join` before `x` may be freed. It writes the target layer's
    `gate` buffer, which the prefetch op reads on the same stream. `recorded` (a replayed trace's
    gate: ids, probs, cursor, or empty): the live scores are computed, then the recorded ones
    replace them (predictors.recorded_gate_scores). `source`: the `routed` of `x`'s layer, whose
    `ensure` ran before: score while its copies run.
    """
    if not out.is_cuda:
        _score_gate(x, weight, bias, per_token, out, recorded)
        return
    with torch.cuda.stream(SIDE.fork(out.device, source)):
        _score_gate(x, weight, bias, per_token, out, recorded, SIDE.read(out))


def _score_gate(
    x, weight, bias, per_token, out, recorded, read: torch.cuda.Event | None = None
) -> None:
    predictors.gate_scores(x, weight, bias, per_token, out)
    # the last read of x: `gate_join` waits for this, not for the recorded gate's work
    if read is not None:
        read.record()
    if recorded:
        predictors.recorded_gate_scores(recorded, x.shape[0], per_token, out)


@_gate_scores.register_fake
def _(x, weight, bias, per_token, out, recorded, source=None):
    torch._check(
        x.dim() == 2 and x.shape[1] == weight.shape[1],
        lambda: (
            f"gate scores need x [tokens, {weight.shape[1]}] for a router of {weight.shape[1]} "
            "inputs, "
            f"got {tuple(x.shape)}"
        ),
    )
    torch._check(per_token > 0, lambda: f"per_token must be positive, got {per_token}")
    torch._check(
        out.shape == (weight.shape[0],) and out.dtype == torch.float32,
        lambda: f"out must be float32 [{weight.shape[0]}], got {out.dtype} {tuple(out.shape)}",
    )
    torch._check(
        len(recorded) in (0, 3),
        lambda: f"recorded must be empty or (ids, probs, cursor), got {len(recorded)} tensors",
    )


def gate_scores(
    x: Tensor,
    router: tuple[Tensor, Tensor | None],
    per_token: int,
    buffers: PrefetchBuffers,
    recorded: list[Tensor] | None = None,
    source: ExpertCache | None = None,
) -> None:
    """Score the router's layer's experts (the prefetch target's) from `x` into its `buffers.gate`;
    `source`: the cache of `x`'s layer, whose `ensure` ran before."""
    routed = None if source is None else source.routed
    torch.ops.asyncmoe.gate_scores(
        x, router[0], router[1], per_token, buffers.gate, recorded or [], routed
    )


@torch.library.custom_op("asyncmoe::gate_join", mutates_args=("gate",))
def _gate_join(x: Tensor, gate: Tensor) -> None:
    """Make the compute stream wait until the gate scoring into `gate` has read `x`, its input:
    after this `x` may be freed and its memory reused (by the caching allocator, or by Inductor,
    which sees `x` live until here). `gate` is named as mutated so that nothing reorders the join
    before the scoring. CPU: nothing."""
    if gate.is_cuda:
        torch.cuda.current_stream().wait_event(SIDE.read(gate))


@_gate_join.register_fake
def _(x, gate):
    return None


def gate_join(x: Tensor, buffers: PrefetchBuffers) -> None:
    torch.ops.asyncmoe.gate_join(x, buffers.gate)


@torch.library.custom_op("asyncmoe::observe", mutates_args=("transitions",))
def _observe(previous: Tensor, routed: Tensor, transitions: Tensor) -> None:
    """Add this call's (expert at the previous MoE layer -> expert here) pairs to the decayed
    transition counts."""
    predictors.observe(previous, routed, transitions)


@_observe.register_fake
def _(previous, routed, transitions):
    torch._check(
        transitions.shape == (previous.shape[0], routed.shape[0]),
        lambda: (
            f"transitions must be [{previous.shape[0]}, {routed.shape[0]}], got "
            f"{tuple(transitions.shape)}"
        ),
    )


def observe(previous: ExpertCache, cache: ExpertCache, buffers: PrefetchBuffers) -> None:
    """Learn the transitions from `previous`'s experts to `cache`'s into `cache`'s prefetch
    `buffers`."""
    torch.ops.asyncmoe.observe(previous.routed, cache.routed, buffers.transitions)
