"""Expert weight providers: where an experts module's weights come from for one forward.

The transformers integration hands every experts call to the module's provider and knows nothing
else about caching. `ResidentProvider` is what `cache >= num_experts` gets: the experts stay where
the model put them and the model's own implementation runs (no tables, no copies, no overhead).
`QuantizedResidentProvider` is the same for experts kept quantized on the GPU, computed by
asyncmoe's dequantizing kernels (the model's own implementations take no fp8 weights).
`CachedProvider` asks the layer's `ExpertCache` for slot ids, computes from the slot buffers, and
(with prefetch) predicts and prefetches the experts of the next layers while this one computes;
with `hybrid`, the host's CPU computes some of each call's misses meanwhile, as a cost model splits
them.
`CpuProvider` (`cache=0`) has the host's CPU compute every routed expert from the host store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import gpu
from .cache import ops as cache_ops
from .cache.expert_cache import ExpertCache, num_waves
from .cache.gather_copy import copy_ns
from .cache.state import GATE, PACE_COPY, TEMPORAL, TRANSITION
from .compute.cpu import ops as cpu_ops
from .compute.cpu.executor import CpuExecutor
from .compute.experts import absent_zeroed, combine, routed_outputs
from .formats import Format
from .hybrid import ops as hybrid_ops
from .hybrid.ops import Hybrid
from .prefetch import ops as prefetch_ops
from .prefetch.predictors import Prefetch
from .prefetch.state import PrefetchBuffers


class ExpertWeightProvider(nn.Module):
    def forward(
        self, experts: nn.Module, hidden_states, top_k_index, top_k_weights
    ) -> torch.Tensor:
        raise NotImplementedError


class ResidentProvider(ExpertWeightProvider):
    """Every expert resident: run the implementation the model used before asyncmoe
    (`implementation`)."""

    def __init__(self, implementation: str, fn: Callable):
        super().__init__()
        self.implementation, self.fn = implementation, fn

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        return self.fn(experts, hidden_states, top_k_index, top_k_weights)


class QuantizedResidentProvider(ExpertWeightProvider):
    """Every expert resident on the GPU in a quantized format: `weights` [E, ...] each, read by
    expert id."""

    def __init__(
        self, weights: dict[str, torch.Tensor], fmt: Format, expert_parallel: bool = False
    ):
        super().__init__()
        self.fmt = fmt
        self.names = list(weights)
        self.expert_parallel = expert_parallel  # pairs may name another rank's experts (id E)
        for name, w in weights.items():
            self.register_buffer(name, w, persistent=False)

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        weights = {n: getattr(self, n) for n in self.names}
        E = weights[self.names[0]].shape[0]
        ids = torch.where(top_k_index < E, top_k_index, -1) if self.expert_parallel else top_k_index
        out = routed_outputs(experts, hidden_states, ids, weights, self.fmt)
        out = absent_zeroed(out, top_k_index, E) if self.expert_parallel else out
        return combine(out, top_k_weights, hidden_states.dtype)


class CpuProvider(ExpertWeightProvider):
    """Every routed expert of the layer computed by the host's CPU from the host store (`cache=0`):
    the model's `executor` computes each pair's output, which is rounded to the model's dtype as the
    slot path's is, then weighted and summed here on the model's device."""

    def __init__(self, executor: CpuExecutor, layer: int):
        super().__init__()
        self.executor, self.layer = executor, layer  # the layer's number in the executor's requests

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        out = cpu_ops.cpu_experts(hidden_states, top_k_index, self.executor.id, self.layer)
        return combine(out.to(hidden_states.dtype), top_k_weights, hidden_states.dtype)


@dataclass
class Links:
    """A cached layer's neighbours for prefetch: the previous cached layer's cache and the layers it
    prefetches for. A plain object, so that what it holds is not registered as submodules of each
    other. Links point forward only (a cache holds no provider), so consecutive layers form no
    reference cycle: a model freed by its last reference frees its slots at once, not at the next
    garbage collection."""

    previous: ExpertCache | None = None
    targets: tuple[CachedProvider, ...] = ()


class CachedProvider(ExpertWeightProvider):
    """Experts in host memory, C of them in GPU slots; calls with more than C distinct experts run
    in waves, but captured or compiled ones with `hybrid`, whose CPU takes the excess (calls of at
    most one CPU request); eager ones with `hybrid` split their misses with the CPU first."""

    def __init__(
        self,
        cache: ExpertCache,
        router: tuple[torch.Tensor, torch.Tensor | None] | None,
        fmt: Format | None = None,
    ):
        super().__init__()
        self.cache = cache
        self.fmt = fmt  # the slots' format (None: the model's dtype)
        self.router = (
            # this layer's router (weight [E, H], bias): the gate predictor of the layer before uses
            # it
            router
        )
        self.links = Links()  # set by `link`
        # this layer's, where it is a prefetch target (set by `link`)
        self.prefetch: PrefetchBuffers | None = None
        self.plan: Prefetch | None = None
        self.wait = False  # a prefetch into this layer is issued earlier in each forward
        # prefetch skipped in this forward, here and in every linked layer (`prefetch_paused`)
        self.paused = False
        # the one layer pair that measures the prefetch's window (see `link`)
        self.stamps = self.laps = False
        self.per_token = 1  # experts each token nominates to the gate predictor scoring this layer
        self.budget = 1  # most experts a prefetch admits into this layer per call
        # routing replayed from a trace with its gate recorded: what the gate op reads in place of
        # the live scores
        self.replayed_gate: list[torch.Tensor] = []
        # pairs may name another rank's experts (id E): set by the integration
        self.expert_parallel = False
        # the CPU computing some of each call's misses (hybrid/): set by the integration
        self.hybrid: Hybrid | None = None

    def clear(self) -> None:
        """Back to as built: the cache's tables and history, and this layer's prefetch state (in
        place)."""
        self.cache.clear()
        if self.prefetch is not None:
            self.prefetch.clear()

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        C, E = self.cache.num_slots, self.cache.num_experts
        if k > C:
            raise ValueError(
                f"this call routes each token to {k} experts but the cache has {C} slots per "
                "layer: every token "
                f"needs its top-{k} experts resident at once; use cache>={k}"
            )
        weights = self.cache.slot_weights()
        # A call of one CPU request goes hybrid. Captured or compiled, whose shapes would fix the
        # worst case's waves, the split leaves the GPU no more than the slots hold: one wave. Eager,
        # the GPU serves its share in the waves it fills, read as below.
        hybrid, waves, fixed = self.hybrid, num_waves(T * k, C, E), _fixed_shapes(hidden_states)
        if hybrid is not None and T > hybrid.executor.settings.max_tokens:
            hybrid = None
        waves = 1 if hybrid is not None and fixed else waves
        out, wave, filled, gated = None, 0, None, []
        linked = not self.paused
        elsewhere = None
        if hybrid is not None:
            elsewhere, cpu_ids = hybrid_ops.hybrid_send(
                hidden_states, top_k_index, self.wait and linked, not fixed, self.cache, hybrid
            )  # [E], [T, k]
        while wave < waves:
            first = wave == 0 and linked
            slots = cache_ops.ensure(
                self.cache,
                top_k_index,
                wave,
                wait=self.wait and first,
                lap=self.laps and first,
                elsewhere=elsewhere,
            )  # [T, k]
            # wave 1, its plan and copies queued: a host sync, eager only (_fixed_shapes)
            if filled is not None:
                waves, filled = filled(), None
                if wave == waves:
                    break  # wave 0 held every expert the call needs: this plan has nothing to copy
            if wave == 0 and waves > 1 and not fixed:
                filled = self._waves_filled()
            if first and self.plan is not None:
                # after this layer's misses, so it overlaps its compute
                gated = self._prefetch(hidden_states)
            part = routed_outputs(experts, hidden_states, slots, weights, self.fmt)  # [T*k, H]
            out = part if out is None else torch.where((slots >= 0).reshape(-1, 1), part, out)
            wave += 1
        for target in gated:
            # the side stream has read hidden_states: free it
            prefetch_ops.gate_join(hidden_states, target.prefetch)
        if hybrid is not None:  # the combine below, with the CPU's outputs (never expert-parallel)
            return hybrid_ops.hybrid_receive(
                out, cpu_ids, top_k_weights, hidden_states.dtype, hybrid
            )
        out = absent_zeroed(out, top_k_index, E) if self.expert_parallel else out
        return combine(out, top_k_weights, hidden_states.dtype)

    def _waves_filled(self) -> Callable[[], int]:
        """The waves this call's experts fill, from wave 0's plan, for the host. On CUDA the count
        is copied to pinned memory as soon as the plan is queued, and read once wave 0's compute and
        wave 1's plan and copies are queued too: the host waits for wave 0's copies while the GPU
        has the rest to run (docs/decisions.md#eager-waves)."""
        last = self.cache.wave_of.max()
        if not last.is_cuda:
            return lambda: int(last) + 1  # a CPU tensor: no queue to wait for
        host = torch.empty((), dtype=last.dtype, pin_memory=True)
        host.copy_(last, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> int:
            # the host sync, eager only: `forward` never calls this under _fixed_shapes
            copied.synchronize()
            return int(host) + 1

        return read

    def _prefetch(self, hidden_states: torch.Tensor) -> list[CachedProvider]:
        """Predict and prefetch for the targets; returns those whose gate scores read
        `hidden_states` on the side stream, which the compute stream must join
        (`prefetch_ops.gate_join`) before it may free them."""
        sources = self.plan.sources
        previous = self.links.previous
        if "transition" in sources and previous is not None:
            prefetch_ops.observe(previous, self.cache, self.prefetch)
        gated = []
        for depth, target in enumerate(self.links.targets, start=1):
            gate = "gate" in sources and depth == 1 and target.router is not None
            if gate:  # replayed routing: the router's work runs, the trace says what it predicted
                prefetch_ops.gate_scores(
                    hidden_states,
                    target.router,
                    target.per_token,
                    target.prefetch,
                    target.replayed_gate,
                    self.cache,
                )
                gated.append(target)
            before = target.links.previous
            before = before.routed if "transition" in sources and before is not None else None
            bits = (GATE if gate else 0) | (TEMPORAL if "temporal" in sources else 0)
            bits |= TRANSITION if before is not None else 0
            if bits:
                stamp = self.stamps and depth == 1
                copy_programs = self.plan.copy_programs
                prefetch_ops.prefetch(
                    target.cache,
                    target.prefetch,
                    bits,
                    target.budget,
                    before,
                    copy_programs,
                    stamp,
                    self.cache,
                )
        return gated


@contextlib.contextmanager
def prefetch_paused(providers: list[CachedProvider]):
    """Forwards in this block skip prefetch in the linked `providers`: no predictor, no prefetch, no
    wait for one, so a step captured here has none of the side streams' work or dependencies. The
    prefetch gates' state is left as it was (the evidence decays by the calls between
    prefetches)."""
    for p in providers:
        p.paused = True
    try:
        yield
    finally:
        for p in providers:
            p.paused = False


def _fixed_shapes(x: torch.Tensor) -> bool:
    """Whether this forward must run the worst case's waves, which shapes alone fix (`num_waves`): a
    CUDA graph capture or torch.compile trace. Eager, a call stops after the waves its experts fill,
    read on the host once wave 0 has ranked them (`wave_plan`): the rest would sort, gather and
    decide over every pair for nothing (docs/decisions.md#eager-waves)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def link(providers: list[CachedProvider], plan: Prefetch | None, top_k: int) -> None:
    """Wire consecutive cached layers for prefetch: each predicts for the next `plan.depth` layers.

    The caches share one `pace` (built so by the integration): on CUDA the first pair of layers
    measures, in every forward, the compute a prefetch hides behind (the first layer's prefetch op
    stamps the GPU clock, the second's `ensure` reads it: two one-thread launches a forward, not two
    a layer), and one expert's copy is timed here, once. The prefetch gate weighs a wasted copy
    against the compute a used one hides."""
    # GPU clock: Triton
    if plan is not None and len(providers) > 1 and gpu.available(providers[0].cache.pace):
        first = providers[0].cache
        first.pace[PACE_COPY] = int(copy_ns(first.hosts, first.slots))
        providers[0].stamps, providers[1].laps = True, True
    for i, p in enumerate(providers):
        targets = tuple(providers[i + 1 : i + 1 + plan.depth]) if plan is not None else ()
        p.links = Links(providers[i - 1].cache if i > 0 else None, targets)
        p.plan = plan
        if plan is not None and i > 0:  # a target of the layers before it
            before = providers[i - 1].cache.num_experts if "transition" in plan.sources else 0
            p.prefetch = PrefetchBuffers(p.cache.num_experts, p.cache.expert_to_slot.device, before)
        if plan is not None:
            p.wait = i > 0
            p.per_token = plan.per_token or top_k
            p.budget = min(plan.budget, p.cache.num_slots)
