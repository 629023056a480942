"""Replay a routing trace through the runtime's own cache and predictor code, on the CPU, without
weights.

Each step is one call per layer, in layer order, as in a captured decode step: `ensure` of layer l
(the same function the `asyncmoe::ensure` op runs), then, with prefetch, the transition update and the
prediction and `prefetch` for layer l+1. A step decodes `batch` consecutive tokens of the trace, as
routing replayed into a batch does: a call of more distinct experts than slots runs every wave its
shapes allow, as a captured step does, and the gate predictor scores a call by its tokens' mean. On a
long trace the step over all layers is compiled once with torch.compile: its tokens run 4-8x faster,
after a wait of seconds a layer that a short trace would not win back (`compiles`).

With hybrid costs (`hybrid_us`: `compile` prints a model's, in ns), each call's misses split between the link and the
CPU first, as `hybrid/split.py` decides them on the GPU for a captured call (the CPU taking any excess over the
slots, one wave): the CPU's are routed but never copied, and count as misses beside the link's in the hit rate; the
time the cost model gives the misses is `miss_ms_per_token`.

The Belady bound: per layer, the fewest misses any cache of the same size can have on the trace:
on a miss, evict the resident expert (not needed by this token) whose next use is furthest away.
Dims: N tokens, L layers, k top-k, E experts, C slots.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache import algorithm
from ..cache.expert_cache import ExpertCache, num_waves
from ..cache.host import human_bytes
from ..cache.policies import DEFAULT_POLICY
from ..cache.state import COUNTERS, GATE, PACE_COPY, PACE_WINDOW, TEMPORAL, TRANSITION
from ..choices import PREDICTORS
from ..hybrid import split
from ..prefetch import predictors
from ..prefetch.prefetch import Request, predict_and_prefetch
from ..prefetch.state import PrefetchBuffers
from ..settings import budget_text, parse_budget
from .format import Trace

SIMULABLE = PREDICTORS  # gate: from a trace that recorded its nominations
RECOMPILES = 256  # configurations one process may simulate compiled (`simulate`)
# torch.compile of the step pays from about this many tokens on, and takes about these seconds a layer
# on one core, without prefetch and with it (docs/decisions.md#simulator-compile)
COMPILE_FROM_TOKENS = 30_000
COMPILE_S_PER_LAYER = {False: 10, True: 24}


@dataclass
class LayerResult:
    hits: int
    misses: int
    prefetched: int
    prefetch_hits: int
    belady_misses: int
    cpu_misses: int = 0  # the hybrid's: misses the CPU computed, not copied
    cost_ns: int = 0  # the hybrid's: the cost model's time for the misses

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.cpu_misses


@dataclass
class Simulation:
    cache: int
    policy: str
    prefetch: tuple[str, ...]
    tokens: int
    expert_bytes: int
    layers: list[LayerResult]
    batch: int = 1
    hybrid: bool = False  # misses split with the CPU by given costs
    totals: dict = field(default_factory=dict)

    def __post_init__(self):
        lookups = sum(r.lookups for r in self.layers)
        copied = sum(r.misses for r in self.layers)
        cpu = sum(r.cpu_misses for r in self.layers)
        misses = copied + cpu
        moved = copied + sum(r.prefetched for r in self.layers)
        belady = sum(r.belady_misses for r in self.layers)
        per_token = 1 / self.tokens if self.tokens else float("nan")
        self.totals = {
            "tokens": self.tokens,
            "lookups": lookups,
            "hit_rate": 1 - misses / lookups if lookups else float("nan"),
            "belady_hit_rate": 1 - belady / lookups if lookups else float("nan"),
            "misses_per_token": misses * per_token,
            "cpu_misses_per_token": cpu * per_token,
            "belady_misses_per_token": belady * per_token,
            "prefetched_per_token": sum(r.prefetched for r in self.layers) * per_token,
            "prefetch_recall": sum(r.prefetch_hits for r in self.layers) / lookups
            if lookups
            else float("nan"),
            "bytes_per_token": moved * self.expert_bytes * per_token,
            "belady_bytes_per_token": belady * self.expert_bytes * per_token,
            "miss_ms_per_token": sum(r.cost_ns for r in self.layers) * per_token / 1e6
            if self.hybrid
            else None,
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "cache": self.cache,
                "batch": self.batch,
                "policy": self.policy,
                "prefetch": list(self.prefetch),
                **self.totals,
            }
        )

    def __str__(self) -> str:
        head = f"{'layer':>5} {'hit%':>6} {'belady%':>8} {'miss/tok':>9} {'prefetch/tok':>13} {'pf-recall%':>10}"
        rows = [
            f"cache {self.cache} slots, policy {self.policy}, prefetch "
            f"{'+'.join(self.prefetch) or 'off'}, "
            f"{self.tokens} tokens" + (f" in steps of {self.batch}" if self.batch > 1 else ""),
            head,
            "-" * len(head),
        ]
        for i, r in enumerate(self.layers):
            rows.append(
                f"{i:>5} {100 * r.hits / r.lookups:>6.1f} "
                f"{100 * (1 - r.belady_misses / r.lookups):>8.1f} "
                f"{(r.misses + r.cpu_misses) / self.tokens:>9.2f} {r.prefetched / self.tokens:>13.2f} "
                f"{100 * r.prefetch_hits / r.lookups:>10.1f}"
            )
        t = self.totals
        rows += [
            "-" * len(head),
            f"{'all':>5} {100 * t['hit_rate']:>6.1f} {100 * t['belady_hit_rate']:>8.1f} "
            f"{t['misses_per_token']:>9.2f} {t['prefetched_per_token']:>13.2f} "
            f"{100 * t['prefetch_recall']:>10.1f}",
        ]
        if t["cpu_misses_per_token"]:
            rows.append(f"misses the CPU computed per token: {t['cpu_misses_per_token']:.2f}")
        if self.hybrid:
            rows.append(
                f"the cost model's time for the misses: {t['miss_ms_per_token']:.3f} ms a token"
            )
        if self.expert_bytes:
            rows.append(
                f"bytes per token: {t['bytes_per_token'] / 1e6:.1f} MB "
                f"(Belady floor {t['belady_bytes_per_token'] / 1e6:.1f} MB)"
            )
        return "\n".join(rows)


def _step(ids_t, gate_t, caches, targets, prefetch: tuple[str, ...], budget: int, cost):
    """One step's tokens ids_t [B, L, k] through every layer: what the providers do in a captured
    forward, minus the weights. gate_t [L, E]: the recorded gate predictor's scores for each layer
    (with "gate"); `targets`: each layer's prefetch buffers; `cost`: the hybrid's costs (split.Cost),
    or None."""
    bits = (GATE if "gate" in prefetch else 0) | (TEMPORAL if "temporal" in prefetch else 0)
    bits |= TRANSITION if "transition" in prefetch else 0
    B, _, k = ids_t.shape
    for l, c in enumerate(caches):
        ids = ids_t[:, l]  # [B, k]
        if cost is None:
            elsewhere, waves = None, num_waves(B * k, c.num_slots, c.num_experts)
        else:
            elsewhere, waves = split.split_reference(ids.reshape(-1), c.state, cost)[0], 1
        for wave in range(waves):
            algorithm.ensure(ids, wave, c.policy, c.state, [], [], elsewhere=elsewhere)
        if "transition" in prefetch and l > 0:
            predictors.observe(caches[l - 1].routed, c.routed, targets[l].transitions)
        if prefetch and l + 1 < len(caches):
            t, p = caches[l + 1], targets[l + 1]
            if "gate" in prefetch:
                p.gate.copy_(gate_t[l + 1])
            before = c.routed if "transition" in prefetch else None
            predict_and_prefetch(Request(bits, budget, t.policy), t.state, p.state, before, [], [])


def check(
    trace: Trace,
    cache: int,
    prefetch: tuple[str, ...] = (),
    budget: int = 1,
    pace_us: tuple | None = None,
    hybrid_us: tuple | None = None,
    batch: int = 1,
) -> None:
    """What `simulate` refuses, checked before it compiles or runs anything: a ValueError saying
    what is wrong."""
    trace.validate()  # again: a trace's arrays may have changed since it was built
    if not 1 <= batch <= trace.tokens:
        raise ValueError(
            f"batch={batch}: a step decodes 1 to the trace's {trace.tokens} tokens; give a batch "
            "in that range"
        )
    if "gate" in prefetch and trace.gate_ids is None:
        raise ValueError(
            "the gate predictor needs hidden states, and this trace did not record what it "
            "predicted; "
            "record one with asyncmoe.record(model, gate=True), or simulate temporal and transition"
        )
    unknown = set(prefetch) - set(SIMULABLE)
    if unknown:
        raise ValueError(f"unknown predictors {sorted(unknown)}; simulable: {', '.join(SIMULABLE)}")
    if budget < 1:
        raise ValueError(f"prefetch budget must be >= 1 (experts per layer per call), got {budget}")
    if pace_us is not None and not (len(pace_us) == 2 and min(pace_us) > 0):
        raise ValueError(
            "pace_us is (an expert's copy, a layer's window) in µs, both > 0, as asyncmoe.stats "
            "prints them on the "
            f"GPU; got {pace_us}"
        )
    if hybrid_us is not None and not (len(hybrid_us) == len(split.Cost) and min(hybrid_us) > 0):
        raise ValueError(
            "hybrid_us is (a request's round trip, an expert's CPU time, a token's, an expert's copy) in µs, "
            f"each > 0 (asyncmoe.compile prints a model's, in ns); got {hybrid_us}"
        )
    if not trace.top_k <= cache:
        raise ValueError(
            f"cache={cache} is below the trace's top_k={trace.top_k}; use cache>={trace.top_k}"
        )


def simulate(
    trace: Trace,
    cache: int | str,
    policy: str = DEFAULT_POLICY,
    prefetch: tuple[str, ...] = (),
    budget: int = predictors.Prefetch.budget,
    expert_bytes: int | None = None,
    compiled: bool | None = None,
    pace_us: tuple[float, float] | None = None,
    progress: Callable[[int, int], None] | None = None,
    hybrid_us: tuple[float, float, float, float] | None = None,
    batch: int = 1,
) -> Simulation:
    """Hit rates, misses and bytes per token of asyncmoe's cache on `trace`, beside the Belady
    bound. `expert_bytes`: one expert's bytes for bytes per token (default: the trace's recorded
    model's, in the format its cache stored; 0 where the trace has none). `pace_us`: (an expert's
    copy, the compute a prefetch hides behind) in µs as a GPU measured them (`asyncmoe.stats` prints
    both), so the prefetch gate decides as it does there; None: unmeasured, as on the CPU. `cache`:
    slots per MoE layer, or a GPU-memory budget for every layer's slots ("6GiB", `budget_slots`).
    `compiled`: the step through torch.compile (None: where it pays, `compiles`). `progress(done,
    total)`: called after each step (the first one, compiled, waits for torch.compile). `hybrid_us`:
    the hybrid's costs in µs, in `split.Cost`'s order; None: GPU-only. `batch`: tokens a step (the
    trace's last tokens short of a step are left out)."""
    if expert_bytes is None:
        expert_bytes = trace.expert_bytes or 0
    if isinstance(cache, str):
        cache = budget_slots(trace, cache, expert_bytes)[0]
    check(trace, cache, prefetch, budget, pace_us, hybrid_us, batch)
    E, L = trace.num_experts, trace.layers
    budget = min(budget, cache)
    # shared by the layers, as the runtime's linked ones share theirs
    pace = torch.zeros(3, dtype=torch.int64)
    if pace_us is not None:
        pace[PACE_COPY], pace[PACE_WINDOW] = (round(us * 1e3) for us in pace_us)
    caches = [
        ExpertCache({"w": torch.zeros(E, 0)}, min(cache, E), policy, pace=pace) for _ in range(L)
    ]
    targets = [PrefetchBuffers(E, torch.device("cpu"), E) for _ in range(L)]
    cost = None if hybrid_us is None else torch.tensor([round(us * 1e3) for us in hybrid_us])
    compiled = compiles(trace) if compiled is None else compiled
    step = torch.compile(_step, fullgraph=True, dynamic=False) if compiled else _step
    steps = trace.tokens // batch
    tokens = steps * batch
    ids = torch.from_numpy(np.ascontiguousarray(trace.ids[:tokens])).long()
    ids = ids.view(steps, batch, L, trace.top_k)
    gate = None
    if "gate" in prefetch:  # a call's tokens' mean, as the live gate scores a call
        gate = gate_scores(trace)[:tokens].view(steps, batch, L, E).mean(1)
    # each configuration (slots, layers, policy, predictors, budget) compiles its own graph of
    # `_step`; a sweep in one process needs more of them than dynamo's default recompile limit of 8,
    # a hard error under fullgraph
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=RECOMPILES):
        for t in range(steps):
            step(
                ids[t], None if gate is None else gate[t], caches, targets, tuple(prefetch), budget,
                cost,
            )  # fmt: skip
            if progress is not None:
                progress((t + 1) * batch, tokens)
    index = {name: i for i, name in enumerate(COUNTERS)}
    layers = []
    for l, c in enumerate(caches):
        n = c.counters.tolist()  # host read-out after the run (CPU tensors; no device involved)
        layers.append(
            LayerResult(
                n[index["hits"]],
                n[index["misses"]],
                n[index["prefetched"]],
                n[index["prefetch_hits"]],
                belady_misses(trace.ids[:tokens, l].reshape(steps, -1), min(cache, E)),
                n[index["cpu_misses"]],
                n[index["cost_ns"]],
            )
        )
    return Simulation(
        cache, policy, tuple(prefetch), tokens, expert_bytes, layers, batch, cost is not None
    )


def compiles(trace: Trace) -> bool:
    """Whether compiling the step wins its wait back on this trace: both the wait and the time a
    token saves grow with the layers, so the number of tokens decides."""
    return trace.tokens >= COMPILE_FROM_TOKENS


def compile_seconds(trace: Trace, prefetch: tuple[str, ...]) -> float:
    """About how long torch.compile takes on the step, on one core."""
    return COMPILE_S_PER_LAYER[bool(prefetch)] * trace.layers


def budget_slots(trace: Trace, cache: str, expert_bytes: int) -> tuple[int, str]:
    """Slots per MoE layer that a GPU-memory budget for every layer's slots ("6GiB") gives the
    trace's model, as `asyncmoe.compile` gives them (at most num_experts), from one expert's bytes;
    and a line that says so."""
    if cache.strip().lower() == "auto":
        raise ValueError(
            "cache='auto' sizes the cache from the free memory of the GPU the model runs on, and "
            "the simulator runs "
            "on the CPU without one: give slots per MoE layer (16) or the budget of the GPU you "
            "mean ('6GiB')"
        )
    budget = parse_budget(cache)
    if not expert_bytes:
        raise ValueError(
            f"cache={cache!r} is a GPU-memory budget, and this trace records no expert size to "
            "divide it by: give "
            "one expert's bytes (--expert-bytes, expert_bytes=) or the cache in slots per MoE layer"
        )
    L, E, k = trace.layers, trace.num_experts, trace.top_k
    slots = min(E, budget // (L * expert_bytes))
    what = f"{L} MoE layers, experts of {human_bytes(expert_bytes)}"
    if slots < k:
        raise ValueError(
            f"cache={cache!r} holds {slots} experts per MoE layer ({what}), below the trace's "
            f"top_k={k}: every token "
            f"needs its {k} experts resident at once; the smallest budget that works is "
            f"cache={budget_text(L * k * expert_bytes)!r}"
        )
    return (
        slots,
        f"cache={cache!r} gives {slots} slots per MoE layer ({what}; "
        f"{human_bytes(L * slots * expert_bytes)} of slots)",
    )


def gate_scores(trace: Trace) -> torch.Tensor:
    """[N, L, E]: the recorded gate predictor's score of each expert for each token and layer, as
    the runtime scores one token (`predictors.gate_scores` with per_token = top-k): its probability
    if among the top-k."""
    ids = torch.from_numpy(trace.gate_ids[:, :, : trace.top_k]).long()
    probs = torch.from_numpy(np.asarray(trace.gate_probs[:, :, : trace.top_k], dtype=np.float32))
    return predictors.top_scores(ids, probs, trace.num_experts)


def next_uses(ids: np.ndarray) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Each row's distinct experts, in order, and for each of them the next row that uses it (inf:
    none)."""
    rows = [list(dict.fromkeys(row.tolist())) for row in ids]
    next_use: list[dict[int, float]] = [{} for _ in rows]
    upcoming: dict[int, float] = {}
    for t in range(len(rows) - 1, -1, -1):
        for e in rows[t]:
            next_use[t][e] = upcoming.get(e, float("inf"))
        for e in rows[t]:
            upcoming[e] = t
    return rows, next_use


def belady_misses(ids: np.ndarray, cache: int, from_row: int = 0) -> int:
    """Fewest misses of a `cache`-slot cache serving `ids` [N, k]: each row's experts resident
    together, or, for a row with more distinct experts than slots (a batch's decode step), in waves;
    counted from row `from_row` on (the rows before it warm the cache).

    Belady's rule: after each row keep the experts used soonest again. A row of d <= cache experts
    leaves room for cache - d others; a row served in waves, for at most cache - 1 (one slot at
    least cycles through the row's experts). With waves this bounds every cache from below; it may
    not be reachable (it lets the waves be as small as one expert)."""
    rows, next_use = next_uses(ids)
    resident: dict[int, float] = {}  # expert -> its next use
    misses = 0
    for t, need in enumerate(rows):
        misses += sum(e not in resident for e in need) if t >= from_row else 0
        resident.update((e, next_use[t][e]) for e in need)
        used = set(need)
        # for experts this row did not use
        room = cache - len(need) if len(need) <= cache else cache - 1
        kept: dict[int, float] = {}
        for e, use in sorted(resident.items(), key=lambda item: item[1]):
            if len(kept) < cache and (e in used or room > 0):
                kept[e] = use
                room -= e not in used
        resident = kept
    return misses
