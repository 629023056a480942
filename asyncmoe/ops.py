"""Every custom op asyncmoe adds: the only surface torch.compile sees.

Each op is opaque to Dynamo and Inductor, so a compiled graph stays whole around cache decisions
whose insides (sorts, scatters, a Triton copy, a side stream) need not be traced. An op takes a
layer's `CacheState` as one flat tensor list (`state`), named again here, in one place; `mutates_args`
names every tensor an op may write, so functionalization orders the expert compute after the copies
it reads, and a layer's `ensure` after the `prefetch` into the same layer (both write its tables).
Each op has its fake beside it, whose `torch._check`s state the contract.

Streams: `gate_scores` and `prefetch` fork a side stream from the current (compute) stream and predict and
admit there, off the compute stream's path; `prefetch` copies on a second side stream, so that the next
prefetch's prediction need not queue behind this one's copies. Given the `routed` of the layer they predict
from (`source`), they fork from that layer's `ensure` once it has decided, not once its copies are done: the
prediction and the admission run while the misses copy, and the prefetch's own copy starts as soon as the
misses' copies end, so the link does not idle between them and misses still go first. `gate_scores` records
an event once it has read its input, which `gate_join` makes the compute stream wait on before that input may
be freed or reused. `prefetch` records two events per target cache: `planned` (its tables are written) and
`ready` (its copies are made). The target's `ensure(wait=True)` waits for `planned` before it decides, and for
`ready` only before its own copies: it decides while the prefetch copies, and its misses' copies follow the
prefetch's on the link with no decision between them. Every prefetch targets a later layer of the same forward,
whose `ensure` waits, so side-stream work has rejoined before the forward returns (a CUDA-graph capture must
end joined). On the CPU there are no streams: both run inline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import algorithm
from .cache.expert_cache import ExpertCache
from .cache.state import (
    COUNTERS,
    PACE_STAMP,
    TIMER_SIZE,
    TIMER_START,
    TIMER_WAIT_FROM,
    TIMER_WAITED,
    TRANSITION,
    CacheState,
)
from .formats import FP8, scale_shape
from .kernels import clock, dequant_mm, fp8_gemv, gemv4, slot_gemv
from .predict import predictors
from .predict.prefetch import Request, predict_and_plan, predict_and_prefetch


class SideStreams:
    """The two side streams of each device (`predict`: gate scores and prefetch decisions; `copy`: prefetch
    copies), the two events each target cache's last prefetch recorded (planned, ready), and the two each
    cache's last `ensure` recorded (decided, copied).

    Owned by this module: a custom op sees only tensors, so it finds a cache's event by the address of one of
    the cache's buffers, which never changes (buffers are allocated once)."""

    def __init__(self):
        self.streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self.events: dict[tuple[str, int], torch.cuda.Event] = {}

    def stream(self, device: torch.device, kind: str = "predict") -> torch.cuda.Stream:
        key = (kind, device.index)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device)
        return self.streams[key]

    def planned(self, target: Tensor) -> torch.cuda.Event:
        """The event of the last prefetch into the cache whose `expert_to_slot` is `target`: its tables are written."""
        return self._event("planned", target)

    def ready(self, target: Tensor) -> torch.cuda.Event:
        """The event of the last prefetch into the cache whose `expert_to_slot` is `target`: its copies are made."""
        return self._event("ready", target)

    def read(self, gate: Tensor) -> torch.cuda.Event:
        """The event of the last gate scoring into `gate`: its input has been read."""
        return self._event("read", gate)

    def mark(self, kind: str, routed: Tensor) -> None:
        """Record the event `kind` of an `ensure` (`decided`: its tables are written; `copied`: its copies are made)
        on the current stream, for the cache whose `routed` is `routed`. Only this creates those events, so
        `fork` and `copier` know by their existence that an `ensure` has recorded them."""
        self._event(kind, routed).record()

    def fork(self, device: torch.device, source: Tensor | None = None) -> torch.cuda.Stream:
        """The side stream, made to wait for the work queued so far on the current stream, or, given the `routed`
        of a cache whose `ensure` has run, only for that `ensure`'s decision (its copies may still run)."""
        side = self.stream(device)
        if source is not None and ("decided", source.data_ptr()) in self.events:
            side.wait_event(self._event("decided", source))
        else:
            side.wait_stream(torch.cuda.current_stream())
        return side

    def copier(self, target: Tensor, source: Tensor | None, copies: tuple[Tensor, ...]) -> torch.cuda.Stream:
        """The copy stream, made to wait for the prefetch decision into `target` (recorded `planned`) and for the
        copies of `source`'s last `ensure`, if any; the decision's `copies`, made on the predict stream, are kept
        from reuse until the copy stream is done with them."""
        copy = self.stream(target.device, "copy")
        copy.wait_event(self.planned(target))
        if source is not None and ("copied", source.data_ptr()) in self.events:
            copy.wait_event(self._event("copied", source))
        for t in copies:
            t.record_stream(copy)
        return copy

    def _event(self, kind: str, t: Tensor) -> torch.cuda.Event:
        key = (kind, t.data_ptr())
        if key not in self.events:
            self.events[key] = torch.cuda.Event()
        return self.events[key]


SIDE = SideStreams()


def _check_state(state: list[Tensor]) -> CacheState:
    torch._check(
        len(state) == len(CacheState._fields),
        lambda: (
            f"state must hold the {len(CacheState._fields)} "
            f"CacheState tensors ({', '.join(CacheState._fields)}), got {len(state)}"
        ),
    )
    s = CacheState._make(state)
    torch._check(s.expert_to_slot.dtype == torch.int64, lambda: "expert_to_slot must be int64")
    torch._check(s.counters.shape == (len(COUNTERS),), lambda: f"counters must be [{len(COUNTERS)}]")
    torch._check(
        s.timer.numel() in (0, TIMER_SIZE),
        lambda: f"timer must be empty (not timed) or [{TIMER_SIZE}], got {tuple(s.timer.shape)}",
    )
    torch._check(s.pace.shape == (3,), lambda: f"pace must be [3], got {tuple(s.pace.shape)}")
    return s


@torch.library.custom_op("asyncmoe::ensure", mutates_args=("state", "slots"))
def _ensure(
    top_k_index: Tensor,
    wave: int,
    wait: bool,
    lap: bool,
    policy: str,
    state: list[Tensor],
    hosts: list[Tensor],
    slots: list[Tensor],
) -> Tensor:
    """Make this call's wave of routed experts resident in the slots; return their slot ids.

    Decided on the device with fixed-shape ops (`cache.algorithm`); misses are copied host -> slot by the
    gather-copy kernel, whose count stays in device memory. `wait`: the prefetch into this layer issued earlier
    in the forward: decide once it has decided, copy once its copies are made (they may fill a slot this
    decision evicts). A non-empty `timer` (CUDA) times the wait for those copies and the rest on the GPU clock
    (kernels.clock). `lap`: first fold the time since the prefetch op stamped `pace` into its window (the
    compute that prefetch had to hide behind; see `providers.link`).
    """
    s = CacheState._make(state)
    cuda, timed = s.expert_to_slot.is_cuda, s.timer.numel() > 0
    if lap and cuda:
        clock.window(s.pace)
    if timed:
        clock.stamp(s.timer, TIMER_START)
    if wait and cuda:
        torch.cuda.current_stream().wait_event(SIDE.planned(s.expert_to_slot))
    out, copies = algorithm.ensure_plan(top_k_index, wave, policy, s, slots)
    if cuda:
        SIDE.mark("decided", s.routed)
    if timed:
        clock.stamp(s.timer, TIMER_WAIT_FROM)
    if wait and cuda:
        torch.cuda.current_stream().wait_event(SIDE.ready(s.expert_to_slot))
    if timed:
        clock.stamp(s.timer, TIMER_WAITED)
    algorithm.copy_in(hosts, slots, copies)
    if cuda:
        SIDE.mark("copied", s.routed)
    if timed:
        clock.lap(s.timer)
    return out


@_ensure.register_fake
def _(top_k_index, wave, wait, lap, policy, state, hosts, slots):
    s = _check_state(state)
    C = s.slot_to_expert.shape[0]
    torch._check(top_k_index.dim() == 2, lambda: f"top_k_index must be [tokens, top_k], got {top_k_index.dim()}D")
    torch._check(
        top_k_index.shape[1] <= C,
        lambda: (
            f"top_k={top_k_index.shape[1]} exceeds the cache's {C} slots: every token needs its top_k experts "
            f"resident at once; use cache>={top_k_index.shape[1]}"
        ),
    )
    torch._check(len(hosts) == len(slots), lambda: "hosts and slots must pair up")
    return torch.empty(top_k_index.shape, dtype=torch.int64, device=top_k_index.device)


def ensure(cache: ExpertCache, top_k_index: Tensor, wave: int, wait: bool = False, lap: bool = False) -> Tensor:
    """`asyncmoe::ensure` on one layer's cache; slot ids [T, k], -1 for pairs of other waves."""
    state = list(cache.state)
    return torch.ops.asyncmoe.ensure(top_k_index, wave, wait, lap, cache.policy, state, cache.hosts, cache.slots)


@torch.library.custom_op("asyncmoe::prefetch", mutates_args=("state", "slots"))
def _prefetch(
    sources: int,
    budget: int,
    copy_programs: int,
    stamp: bool,
    policy: str,
    state: list[Tensor],
    routed_before: Tensor | None,
    hosts: list[Tensor],
    slots: list[Tensor],
    source: Tensor | None = None,
) -> None:
    """Predict a later layer's experts and admit up to `budget` of them into its cache, on a side stream.

    `sources`: bits of the predictors (cache.state GATE, TEMPORAL, TRANSITION): the gate's scores are in the
    target's `gate` (written by `gate_scores`, earlier on the same stream), temporal reads its `routed`,
    transition its `transitions` and `routed_before`, the previous layer's routing. The copy runs on at most
    `copy_programs` Triton programs (0: one per block), so the compute stream keeps most SMs. `stamp`: first
    stamp `pace` on the compute stream, from which the target's `ensure(lap=True)` measures the window.
    `source`: the `routed` of the layer predicted from, whose `ensure` ran before: predict and admit while its
    copies run, copy after them (SideStreams.fork).
    """
    s = CacheState._make(state)
    request = Request(sources, budget, policy, copy_programs or None)
    if not s.expert_to_slot.is_cuda:
        predict_and_prefetch(request, s, routed_before, hosts, slots)
        return
    if stamp:
        clock.stamp(s.pace, PACE_STAMP)
    with torch.cuda.stream(SIDE.fork(s.expert_to_slot.device, source)):
        copies = predict_and_plan(request, s, routed_before, slots)
        SIDE.planned(s.expert_to_slot).record()
    with torch.cuda.stream(SIDE.copier(s.expert_to_slot, source, copies)):
        algorithm.copy_in(hosts, slots, copies, request.copy_programs)
        SIDE.ready(s.expert_to_slot).record()


@_prefetch.register_fake
def _(sources, budget, copy_programs, stamp, policy, state, routed_before, hosts, slots, source=None):
    s = _check_state(state)
    E, C = s.expert_to_slot.shape[0] - 1, s.slot_to_expert.shape[0]
    torch._check(sources > 0, lambda: "prefetch needs a predictor")
    torch._check(
        not (sources & TRANSITION) or routed_before is not None, lambda: "the transition predictor needs routed_before"
    )
    torch._check(
        not (sources & TRANSITION) or s.transitions.shape == (routed_before.shape[0], E),
        lambda: f"transitions must be [{routed_before.shape[0]}, {E}], got {tuple(s.transitions.shape)}",
    )
    torch._check(0 < budget <= C, lambda: f"prefetch budget {budget} must be in 1..{C} (the cache's slots)")


def prefetch(
    cache: ExpertCache,
    sources: int,
    budget: int,
    routed_before: Tensor | None = None,
    copy_programs: int | None = None,
    stamp: bool = False,
    source: ExpertCache | None = None,
) -> None:
    """`asyncmoe::prefetch` into `cache` from the predictors in the bits `sources`; `source`: the cache of the
    layer predicted from, whose `ensure` ran before."""
    state = list(cache.state)
    torch.ops.asyncmoe.prefetch(
        sources,
        budget,
        copy_programs or 0,
        stamp,
        cache.policy,
        state,
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
    """The gate predictor: layer l+1's router `weight` [E, H] on layer l's MoE input `x` [T, H] -> scores `out` [E].

    On CUDA on the side stream, so the router matmul and the scoring stay off the compute stream's path; the
    caller joins with `gate_join` before `x` may be freed. It writes the target layer's `gate` buffer, which
    the prefetch op reads on the same stream. `recorded` (a replayed trace's gate: ids, probs, cursor, or
    empty): the live scores are computed, then the recorded ones replace them (predictors.recorded_gate_scores).
    `source`: the `routed` of `x`'s layer, whose `ensure` ran before: score while its copies run.
    """
    if not out.is_cuda:
        _score_gate(x, weight, bias, per_token, out, recorded)
        return
    with torch.cuda.stream(SIDE.fork(out.device, source)):
        _score_gate(x, weight, bias, per_token, out, recorded, SIDE.read(out))


def _score_gate(x, weight, bias, per_token, out, recorded, read: torch.cuda.Event | None = None) -> None:
    predictors.gate_scores(x, weight, bias, per_token, out)
    if read is not None:  # the last read of x: `gate_join` waits for this, not for the recorded gate's work
        read.record()
    if recorded:
        predictors.recorded_gate_scores(recorded, x.shape[0], per_token, out)


@_gate_scores.register_fake
def _(x, weight, bias, per_token, out, recorded, source=None):
    torch._check(
        x.dim() == 2 and x.shape[1] == weight.shape[1],
        lambda: (
            f"gate scores need x [tokens, {weight.shape[1]}] for a router of {weight.shape[1]} inputs, "
            f"got {tuple(x.shape)}"
        ),
    )
    torch._check(per_token > 0, lambda: f"per_token must be positive, got {per_token}")
    torch._check(
        out.shape == (weight.shape[0],) and out.dtype == torch.float32,
        lambda: f"out must be float32 [{weight.shape[0]}], got {out.dtype} {tuple(out.shape)}",
    )
    torch._check(
        len(recorded) in (0, 3), lambda: f"recorded must be empty or (ids, probs, cursor), got {len(recorded)} tensors"
    )


def gate_scores(
    x: Tensor,
    router: tuple[Tensor, Tensor | None],
    per_token: int,
    cache: ExpertCache,
    recorded: list[Tensor] | None = None,
    source: ExpertCache | None = None,
) -> None:
    """Score the router's layer's experts (`cache`, the prefetch target) from `x` into `cache.gate`; `source`:
    the cache of `x`'s layer, whose `ensure` ran before."""
    routed = None if source is None else source.routed
    torch.ops.asyncmoe.gate_scores(x, router[0], router[1], per_token, cache.gate, recorded or [], routed)


@torch.library.custom_op("asyncmoe::gate_join", mutates_args=("gate",))
def _gate_join(x: Tensor, gate: Tensor) -> None:
    """Make the compute stream wait until the gate scoring into `gate` has read `x`, its input: after this `x`
    may be freed and its memory reused (by the caching allocator, or by Inductor, which sees `x` live until
    here). `gate` is named as mutated so that nothing reorders the join before the scoring. CPU: nothing."""
    if gate.is_cuda:
        torch.cuda.current_stream().wait_event(SIDE.read(gate))


@_gate_join.register_fake
def _(x, gate):
    return None


def gate_join(x: Tensor, cache: ExpertCache) -> None:
    torch.ops.asyncmoe.gate_join(x, cache.gate)


@torch.library.custom_op("asyncmoe::observe", mutates_args=("transitions",))
def _observe(previous: Tensor, routed: Tensor, transitions: Tensor) -> None:
    """Add this call's (expert at the previous MoE layer -> expert here) pairs to the decayed transition counts."""
    predictors.observe(previous, routed, transitions)


@_observe.register_fake
def _(previous, routed, transitions):
    torch._check(
        transitions.shape == (previous.shape[0], routed.shape[0]),
        lambda: f"transitions must be [{previous.shape[0]}, {routed.shape[0]}], got {tuple(transitions.shape)}",
    )


def observe(previous: ExpertCache, cache: ExpertCache) -> None:
    torch.ops.asyncmoe.observe(previous.routed, cache.routed, cache.transitions)


@torch.library.custom_op("asyncmoe::slot_gemv", mutates_args=())
def _slot_gemv(x: Tensor, w: Tensor, slots: Tensor) -> Tensor:
    """Each pair's expert matmul from dense slots: out [S, N] = w[slots[s]] @ x[s] (kernels/slot_gemv.py); a pair
    of another wave (slot -1) gets zeros. An op so that torch.compile need not trace the Triton kernel."""
    return slot_gemv.slot_gemv(x, w, slots)


@_slot_gemv.register_fake
def _(x, w, slots):
    S, K = x.shape
    torch._check(slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}")
    torch._check(
        w.dim() == 3 and K == w.shape[2],
        lambda: f"x has {K} inputs, the weights {tuple(w.shape)} ([slots, out, in]) take another number",
    )
    return x.new_empty(S, w.shape[1], dtype=w.dtype)


@torch.library.custom_op("asyncmoe::fp8_gemv", mutates_args=())
def _fp8_gemv(
    x: Tensor, w: Tensor, scale: Tensor, slots: Tensor, block_rows: int, block_cols: int, transposed: bool
) -> Tensor:
    """Each pair's expert matmul from fp8 slots: out [S, N] = dequantize(w[slots[s]]) @ x[s] (kernels/fp8_gemv.py).

    An op so that torch.compile need not trace the Triton kernel, and a CUDA graph captures one launch. `w` is
    the fp8 weights' bytes (uint8), viewed as float8_e4m3fn inside: torch has few fp8 kernels on the CPU."""
    return fp8_gemv.fp8_gemv(x, w.view(FP8), scale, slots, (block_rows, block_cols), transposed)


@_fp8_gemv.register_fake
def _(x, w, scale, slots, block_rows, block_cols, transposed):
    S, K = x.shape
    N = w.shape[2] if transposed else w.shape[1]
    torch._check(w.dtype == torch.uint8, lambda: f"fp8_gemv takes the fp8 weights' bytes (uint8), got {w.dtype}")
    torch._check(slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}")
    torch._check(
        K == (w.shape[1] if transposed else w.shape[2]),
        lambda: f"x has {K} inputs, the weights {tuple(w.shape)} (transposed={transposed}) take another number",
    )
    torch._check(
        scale.shape == (w.shape[0], *scale_shape(w.shape[1:], (block_rows, block_cols))),
        lambda: (
            f"scales {tuple(scale.shape)} do not tile weights {tuple(w.shape)} in blocks of {block_rows}x{block_cols}"
        ),
    )
    return x.new_empty(S, N)


def fp8_matmul(x: Tensor, w: Tensor, scale: Tensor, slots: Tensor, block: tuple[int, int], transposed: bool) -> Tensor:
    """`asyncmoe::fp8_gemv`: x [S, K], the slots' fp8 weights w [C, R, Q] and scales -> [S, N]."""
    return torch.ops.asyncmoe.fp8_gemv(x, w.view(torch.uint8), scale, slots, block[0], block[1], transposed)


@torch.library.custom_op("asyncmoe::dequant_mm", mutates_args=())
def _dequant_mm(x: Tensor, w: Tensor, scales: Tensor, offs: Tensor, kind: str) -> Tensor:
    """A prompt's expert matmul from 4-bit slots (`kind` "mxfp4" or "int4"), rows sorted by slot
    (kernels/dequant_mm.py): out [S, N], row r = x[r] @ dequantize(w[its slot])^T, the slot's rows ending at `offs`."""
    return dequant_mm.dequant_mm(x, w, scales, offs, kind)


@_dequant_mm.register_fake
def _(x, w, scales, offs, kind):
    S, K = x.shape
    torch._check(kind in dequant_mm.KINDS, lambda: f"dequant_mm kind must be one of {dequant_mm.KINDS}, got {kind!r}")
    torch._check(w.dtype == torch.uint8, lambda: f"dequant_mm takes packed 4-bit weights (uint8), got {w.dtype}")
    torch._check(offs.shape == (w.shape[0],), lambda: f"offs must be [{w.shape[0]}] (one per slot), got {offs.shape}")
    torch._check(K == 2 * w.shape[2], lambda: f"x has {K} inputs, the weights {tuple(w.shape)} take {2 * w.shape[2]}")
    return x.new_empty(S, w.shape[1])


@torch.library.custom_op("asyncmoe::gemv4", mutates_args=())
def _gemv4(x: Tensor, packed: Tensor, scales: Tensor, slots: Tensor, kind: str) -> Tensor:
    """Each pair's expert matmul from 4-bit slots (`kind` "mxfp4" or "int4"; kernels/gemv4.py):
    out [S, N] = dequantize(packed[slots[s]], scales[slots[s]]) @ x[s]."""
    return gemv4.gemv4(x, packed, scales, slots, kind)


@_gemv4.register_fake
def _(x, packed, scales, slots, kind):
    S, K = x.shape
    torch._check(kind in gemv4.KINDS, lambda: f"gemv4 kind must be one of {gemv4.KINDS}, got {kind!r}")
    torch._check(packed.dtype == torch.uint8, lambda: f"gemv4 takes packed uint8 weights, got {packed.dtype}")
    torch._check(slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}")
    torch._check(
        packed.shape[2] * 2 == K and scales.shape[:2] == packed.shape[:2] and K % scales.shape[2] == 0,
        lambda: (
            f"x has {K} inputs; packed weights {tuple(packed.shape)} and scales {tuple(scales.shape)} must be "
            f"[C, N, {K // 2}] and [C, N, {K}/group]"
        ),
    )
    return x.new_empty(S, packed.shape[1])
