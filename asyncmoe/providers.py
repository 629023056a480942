"""Expert weight providers: where an experts module's weights come from for one forward.

The transformers integration hands every experts call to the module's provider and knows nothing
else about caching. `ResidentProvider` is what `cache >= num_experts` gets: the experts stay where
the model put them and the model's own implementation runs (no tables, no copies, no overhead).
`CachedProvider` asks the layer's `ExpertCache` for slot ids, computes from the slot buffers, and
(with prefetch) predicts and prefetches the experts of the next layers while this one computes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import ops
from .cache.expert_cache import ExpertCache, num_waves
from .experts import combine, routed_outputs
from .kernels.gather_copy import gather_copy
from .kernels.predict import use_kernels
from .predict.predictors import Prefetch


class ExpertWeightProvider(nn.Module):
    def forward(self, experts: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        raise NotImplementedError


class ResidentProvider(ExpertWeightProvider):
    """Every expert resident: run the implementation the model used before asyncmoe (`implementation`)."""

    def __init__(self, implementation: str, fn: Callable):
        super().__init__()
        self.implementation, self.fn = implementation, fn

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        return self.fn(experts, hidden_states, top_k_index, top_k_weights)


class CachedProvider(ExpertWeightProvider):
    """Experts in host memory, C of them in GPU slots; calls with more than C distinct experts run in waves."""

    def __init__(self, cache: ExpertCache, router: tuple[torch.Tensor, torch.Tensor | None] | None):
        super().__init__()
        self.cache = cache
        self.router = router  # this layer's router (weight [E, H], bias): the gate predictor of the layer before uses it
        self.plan: Prefetch | None = None
        self.wait = False  # a prefetch into this layer is issued earlier in each forward
        self.stamps = self.laps = False  # the one layer pair that measures the prefetch's window (see `link`)
        # routing replayed from a trace with its gate recorded: (tokens, per_token, out) -> the recorded gate scores
        object.__setattr__(self, "replayed_gate", None)
        # neighbours, as plain attributes (not submodules): the previous cached layer, the layers to prefetch for
        object.__setattr__(self, "previous", None)
        object.__setattr__(self, "targets", ())

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        C, E = self.cache.num_slots, self.cache.num_experts
        if k > C:
            raise ValueError(
                f"this call routes each token to {k} experts but the cache has {C} slots per layer: every token "
                f"needs its top-{k} experts resident at once; use cache>={k}"
            )
        weights = self.cache.slot_weights()
        out, wave, waves, filled = None, 0, num_waves(T * k, C, E), None
        while wave < waves:
            slots = ops.ensure(self.cache, top_k_index, wave, wait=self.wait and wave == 0, lap=self.laps and wave == 0)  # [T, k]
            if filled is not None:  # wave 1, its plan and copies queued: a host sync, eager only (_fixed_shapes)
                waves, filled = filled(), None
                if wave == waves:
                    break  # wave 0 held every expert the call needs: this plan has nothing to copy
            if wave == 0 and waves > 1 and not _fixed_shapes(hidden_states):
                filled = self._waves_filled()
            if wave == 0 and self.plan is not None:
                self._prefetch(hidden_states)  # after this layer's misses, so it overlaps its compute
            part = routed_outputs(experts, hidden_states, slots, weights)  # [T*k, H]
            out = part if out is None else torch.where((slots >= 0).reshape(-1, 1), part, out)
            wave += 1
        return combine(out, top_k_weights, hidden_states.dtype)

    def _waves_filled(self) -> Callable[[], int]:
        """The waves this call's experts fill, from wave 0's plan, for the host. On CUDA the count is copied to pinned
        memory as soon as the plan is queued, and read once wave 0's compute and wave 1's plan and copies are queued
        too: the host waits for wave 0's copies while the GPU has the rest to run. Read right after wave 0's compute,
        it left only that compute queued: eager batch-32 decode steps that fill every wave took 2.1-3.2% longer
        (benchmarks/wave_ab.py, docs/results/2026-12-02)."""
        last = self.cache.wave_of.max()
        if not last.is_cuda:
            return lambda: int(last) + 1  # a CPU tensor: no queue to wait for
        host = torch.empty((), dtype=last.dtype, pin_memory=True)
        host.copy_(last, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> int:
            copied.synchronize()  # the host sync, eager only: `forward` never calls this under _fixed_shapes
            return int(host) + 1
        return read

    def _prefetch(self, hidden_states: torch.Tensor) -> None:
        plan = self.plan
        if "transition" in plan.sources and self.previous is not None:
            ops.observe(self.previous.cache, self.cache)
        for depth, target in enumerate(self.targets, start=1):
            gate = "gate" in plan.sources and depth == 1 and target.router is not None
            if gate:
                ops.gate_scores(hidden_states, target.router, target.per_token, target.cache)
                if target.replayed_gate is not None:  # the router's work runs, the trace says what it predicted
                    target.replayed_gate(hidden_states.shape[0], target.per_token, target.cache.gate)
            before = target.previous.cache.routed if "transition" in plan.sources and target.previous is not None else None
            if gate or "temporal" in plan.sources or before is not None:
                ops.prefetch(target.cache, target.budget, gate, "temporal" in plan.sources, before, plan.copy_programs,
                             stamp=self.stamps and depth == 1)


def _fixed_shapes(x: torch.Tensor) -> bool:
    """Whether this forward must run the worst case's waves, which shapes alone fix (`num_waves`): a CUDA graph
    capture or torch.compile trace. Eager, a call stops after the waves its experts fill, read on the host
    once wave 0 has ranked them (`wave_plan`): the rest would sort, gather and decide over every pair for
    nothing. A 2048-token prompt on Qwen3-30B-A3B's router at 32 of 128 slots fills 2 of its 4 waves; the
    waves' own kernels and launches took ~140 of its 407 ms (docs/results/2026-11-30, thirtieth session), and
    stopping after 2 took 0.72-0.87x the time of all 4 (docs/results/2026-12-02). The read (`_waves_filled`)
    waits for wave 0's plan and copies, not for the work queued after them."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def link(providers: list[CachedProvider], plan: Prefetch | None, top_k: int) -> None:
    """Wire consecutive cached layers for prefetch: each predicts for the next `plan.depth` layers.

    Every linked cache shares one `pace` (ExpertCache): on CUDA the first pair of layers measures, in every
    forward, the compute a prefetch hides behind (the first layer's prefetch op stamps the GPU clock, the
    second's `ensure` reads it: two one-thread launches a forward, not two a layer), and one expert's copy is
    timed here, once. The gate weighs a wasted copy against the compute a used one hides (gate_prefetch)."""
    if plan is not None and len(providers) > 1 and use_kernels(providers[0].cache.pace):  # the GPU clock is a Triton kernel
        providers[0].cache.pace[2] = copy_ns(providers[0].cache)
        providers[0].stamps, providers[1].laps = True, True
    for i, p in enumerate(providers):
        object.__setattr__(p, "previous", providers[i - 1] if i > 0 else None)
        p.plan = plan
        if plan is None:
            continue
        p.cache.pace = providers[0].cache.pace
        object.__setattr__(p, "targets", tuple(providers[i + 1 : i + 1 + plan.depth]))
        p.wait = i > 0
        p.per_token = plan.per_token or top_k
        p.budget = min(plan.budget, p.cache.num_slots)
        if i > 0 and "transition" in plan.sources:
            prev = providers[i - 1].cache
            p.cache.register_buffer(
                "transitions",
                torch.zeros(prev.num_experts, p.cache.num_experts, device=p.cache.expert_to_slot.device),
                persistent=False,
            )


def copy_ns(cache: ExpertCache, repeats: int = 5) -> int:
    """One expert's host -> slot copy on this GPU, in ns (the median of `repeats`, after one to warm up): what a
    wasted prefetch holds the link for. CUDA events and a sync, at compile only. Slot 0 is written: at compile
    no table points at it."""
    one = torch.ones(1, dtype=torch.int64, device=cache.expert_to_slot.device)
    src, dst = one - 1, one - 1
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for host, slot in zip(cache.hosts, cache.slots):
            gather_copy(host, slot, src, dst, one)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))  # ms
    return int(sorted(times[1:])[repeats // 2] * 1e6)
