"""Counters read back from the device, only when asked: one transfer for all layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .cache.expert_cache import ExpertCache
from .cache.state import COUNTERS, TIMER_COPIED, TIMER_COPY_NS, TIMER_ENSURE_NS, TIMER_WAIT_NS
from .compute.cpu.kernels import STATS
from .compute.cpu.request import WAITED_NS
from .hybrid.calibrate import costs_of
from .prefetch.prefetch_gate import MIN_PRECISION, gate_precision
from .settings import HybridCosts


@dataclass
class LayerStats:
    layer: int  # index among the model's MoE layers
    name: str  # module path of the experts module
    slots: int
    experts: int
    calls: int
    hits: int
    misses: int
    evictions: int
    bytes_h2d: int  # every byte copied host -> GPU, prefetches included
    prefetched: int  # experts admitted by prefetch
    wasted: int  # prefetched experts evicted before any use
    prefetch_hits: int  # routed experts found resident because a prefetch put them there
    hits_gate: int  # ... nominated by each predictor (an expert can be nominated by several)
    hits_temporal: int
    hits_transition: int
    prefetch_timely: int  # prefetch hits in the very call the prefetch was for
    # experts a prefetch evicted that the very next call needed (hits it cost)
    prefetch_victims: int
    # a closed prefetch gate's exploring nominations, scored against their call with no copy
    explored: int
    explored_paid: int  # ... that the call routed to and did not hold
    # a prefetch's nominations past its likeliest (budget > 1), scored against their call
    runners_up: int
    runners_up_paid: int  # ... that the call routed to
    expert_bytes: int
    gpu_bytes: int  # slots + tables
    host_bytes: int  # the host store
    # GPU-clock time on the compute stream, summed over calls (compile(..., time_stalls=True); else
    # None):
    wait_ns: int | None = None  # waiting for the prefetch into this layer to finish its copies
    ensure_ns: int | None = None  # `ensure`'s decision and its copies of the misses
    miss_copy_ns: int | None = None  # ... those copies alone
    miss_copies: int | None = None  # ... and the experts they moved
    # experts computed by the host's CPU (cache=0: every routed expert, once per call that routes
    # to it), the bytes of weights it read, its compute time, and the GPU's wait for it (CUDA only)
    cpu_experts: int = 0
    cpu_bytes: int = 0
    cpu_ns: int = 0
    cpu_wait_ns: int | None = None
    # hybrid: misses the CPU computed instead of the link copying them (`misses` counts the copied
    # ones), and the ns the cost model predicted for the calls' misses, both sides
    cpu_misses: int = 0
    cost_ns: int = 0

    @property
    def hit_rate(self) -> float:
        """Recall: routed experts already resident (cached or prefetched) when `ensure` ran."""
        looked_up = self.hits + self.misses + self.cpu_misses
        return self.hits / looked_up if looked_up else float("nan")

    @property
    def prefetch_recall(self) -> float:
        looked_up = self.hits + self.misses + self.cpu_misses
        return self.prefetch_hits / looked_up if looked_up else float("nan")

    @property
    def stall_ns(self) -> int | None:
        """Time the layer's expert compute waited for the cache: the prefetch wait plus `ensure`."""
        return None if self.wait_ns is None else self.wait_ns + self.ensure_ns

    @property
    def prefetch_bytes(self) -> int:
        return self.prefetched * self.expert_bytes

    @property
    def wasted_bytes(self) -> int:
        return self.wasted * self.expert_bytes

    @property
    def miss_copy_bytes(self) -> int | None:
        """What `ensure`'s timed copies moved (stall timing; else None)."""
        return None if self.miss_copies is None else self.miss_copies * self.expert_bytes

    @property
    def miss_bytes(self) -> int:
        """The routed experts the slots lacked, the GPU's share: what had to cross the link."""
        return self.misses * self.expert_bytes


@dataclass
class Stats:
    layers: list[LayerStats]
    resident_layers: int = 0  # MoE layers with cache >= num_experts: nothing to count
    totals: dict = field(default_factory=dict)
    # what the prefetch gate weighs (ExpertCache.pace; 0: not measured): one expert's copy, and the
    # compute a prefetch hid behind in the last call, in ns
    copy_ns: int = 0
    window_ns: int = 0
    # the share of prefetches that must save a miss (gate_precision)
    min_precision: float = MIN_PRECISION
    # the costs the hybrid splits misses by (calibrated or given); None where it is off
    hybrid_costs: HybridCosts | None = None

    def __post_init__(self):
        keys = (
            "calls",
            "hits",
            "misses",
            "evictions",
            "bytes_h2d",
            "prefetched",
            "wasted",
            "prefetch_hits",
            "hits_gate",
            "hits_temporal",
            "hits_transition",
            "prefetch_timely",
            "prefetch_victims",
            "explored",
            "explored_paid",
            "runners_up",
            "runners_up_paid",
            "prefetch_bytes",
            "wasted_bytes",
            "miss_bytes",
            "gpu_bytes",
            "host_bytes",
            "cpu_experts",
            "cpu_bytes",
            "cpu_ns",
            "cpu_misses",
            "cost_ns",
        )
        self.totals = {k: sum(getattr(r, k) for r in self.layers) for k in keys}
        timed = [r for r in self.layers if r.wait_ns is not None]
        for k in ("wait_ns", "ensure_ns", "miss_copy_ns", "miss_copy_bytes", "stall_ns"):
            self.totals[k] = sum(getattr(r, k) for r in timed) if timed else None
        waited = [r.cpu_wait_ns for r in self.layers if r.cpu_wait_ns is not None]
        self.totals["cpu_wait_ns"] = sum(waited) if waited else None
        looked_up = self.totals["hits"] + self.totals["misses"] + self.totals["cpu_misses"]
        self.totals["hit_rate"] = self.totals["hits"] / looked_up if looked_up else float("nan")
        self.totals["prefetch_recall"] = (
            self.totals["prefetch_hits"] / looked_up if looked_up else float("nan")
        )
        self.totals.update(self._bandwidths())

    def _bandwidths(self) -> dict:
        """GB/s of expert weights: the CPU's while it computed the step's misses (its own clock),
        beside an expert of one token alone at compile (the hybrid's calibration); the link's while
        it copied the misses (`ensure`'s copies, their bytes over their time on the GPU clock, stall
        timing), beside an expert's
        copy at compile, alone (the pace's) and while the CPU serves a request (the calibration's).
        None: unmeasured."""
        t, costs = self.totals, self.hybrid_costs
        nbytes = self.layers[0].expert_bytes if self.layers else 0

        def rate(num: int, ns: int | None) -> float | None:
            return num / ns if num and ns else None

        return {
            "link_GB_per_s": rate(t["miss_copy_bytes"], t["miss_copy_ns"]),
            "link_alone_GB_per_s": rate(nbytes, self.copy_ns),
            "link_beside_cpu_GB_per_s": rate(nbytes, costs and costs.copy),
            "cpu_GB_per_s": rate(t["cpu_bytes"], t["cpu_ns"]),
            "cpu_alone_GB_per_s": rate(nbytes, costs and costs.per_expert + costs.per_pair),
        }

    def __str__(self) -> str:
        if not self.layers:
            return f"all {self.resident_layers} MoE layers resident (cache >= num_experts): nothing to count"
        t = self.totals
        columns = [c for c in COLUMNS if c.shown(t)]

        def line(cells) -> str:
            return " ".join(f"{cell:>{c.width}}" for c, cell in zip(columns, cells))

        def row(r: dict) -> str:
            return line(c.cell(r) for c in columns)

        head = line(c.name for c in columns)
        layers = [
            {**vars(r), "hit_rate": r.hit_rate, "prefetch_recall": r.prefetch_recall}
            | {"label": r.layer, "slots": f"{r.slots}/{r.experts}"}
            for r in self.layers
        ]
        rule = "-" * len(head)
        table = [head, rule, *map(row, layers), rule, row(t | {"label": "all", "slots": ""})]
        return "\n".join(table + self._notes(columns))

    def _notes(self, columns: list[Column]) -> list[str]:
        """The lines below the table: what its optional columns and counters mean, where they show."""
        t = self.totals
        shown = {c.name for c in columns}
        notes = ["no expert looked up yet: no rates"] if not t["hits"] + t["misses"] else []
        if "prefetch" in shown:
            notes.append(
                "pf-recall%: routed experts found resident because a prefetch put them "
                "there (part of hit%)"
            )
        else:
            notes.append(
                "nothing prefetched (prefetch off, or it found nothing worth a copy): no "
                "prefetch columns"
            )
        if t["prefetch_hits"]:
            notes.append(
                "prefetch hits by predictor (an expert can have several): "
                + ", ".join(f"{s} {t['hits_' + s]}" for s in ("gate", "temporal", "transition"))
                + f"; {t['prefetch_timely']} of {t['prefetch_hits']} in the call they were fetched "
                "for"
            )
        if t["explored"]:
            notes.append(
                f"closed prefetch gates explored {t['explored']} times with no copy: "
                f"{t['explored_paid']} would have "
                "saved a miss"
            )
        if t["runners_up"]:
            notes.append(
                f"prefetch nominations past each call's likeliest: {t['runners_up']}, of which the "
                "call routed to "
                f"{t['runners_up_paid']} (copied only while enough of them are)"
            )
        notes.append(
            f"device slots+tables {t['gpu_bytes'] / 2**20:.1f} MiB, host store "
            f"{t['host_bytes'] / 2**20:.1f} MiB"
        )
        if self.copy_ns and self.window_ns:
            notes.append(
                f"prefetch gate: an expert's copy {self.copy_ns / 1e3:.1f} us, the compute a "
                "prefetch hid behind "
                f"{self.window_ns / 1e3:.1f} us: open while {100 * self.min_precision:.0f}% of "
                "prefetches save a miss"
            )
        if "wait us" in shown:
            notes.append(
                "wait us, ensure us: per call, on the GPU clock: waiting for the prefetch; "
                "deciding and copying misses"
            )
        if "cpu exp" in shown:
            waits = "; gpu wait us: the GPU's wait for it" if "gpu wait us" in shown else ""
            notes.append(
                "cpu exp, cpu MB, cpu us: experts the host's CPU computed, the weights it read, its "
                f"time a call{waits}"
            )
        if "cpu miss" in shown:
            notes.append(
                "misses: copied into slots; cpu miss: computed by the CPU instead (hybrid); model "
                "us: the cost model's time for a call's misses"
            )
        if t["cpu_misses"] and self.hybrid_costs is not None:
            gb = {
                k: "-" if v is None else f"{v:.1f}" for k, v in t.items() if k.endswith("GB_per_s")
            }
            notes.append(
                f"GB/s of expert weights: the CPU {gb['cpu_GB_per_s']} in the step, "
                f"{gb['cpu_alone_GB_per_s']} alone; the link {gb['link_GB_per_s']} in the step, "
                f"{gb['link_alone_GB_per_s']} alone, {gb['link_beside_cpu_GB_per_s']} beside the CPU "
                "(at compile)"
            )
        elif t["link_GB_per_s"] is not None:
            alone = t["link_alone_GB_per_s"]
            notes.append(
                f"GB/s of expert weights: the link {t['link_GB_per_s']:.1f} copying the misses"
                + (f", {alone:.1f} alone (at compile)" if alone else "")
            )
        if self.resident_layers:
            notes.append(f"{self.resident_layers} more MoE layers fully resident")
        return notes


@dataclass(frozen=True)
class Column:
    """A column of `Stats`' table: its header, its width, its cell from a row (a layer's fields, or
    the totals, with `label` and `slots` as the row shows them), and whether a table shows it, from
    the totals: an optional column shows only where its counters counted something."""

    name: str
    width: int
    cell: Callable[[dict], object]
    shown: Callable[[dict], bool] = lambda t: True


def _per_call_us(key: str) -> Callable[[dict], str]:
    """A row's ns counter `key` as µs per call ("-" where it is None)."""
    return lambda r: "-" if r[key] is None else f"{r[key] / 1e3 / max(r['calls'], 1):.1f}"


def _mb(key: str) -> Callable[[dict], str]:
    return lambda r: f"{r[key] / 1e6:.1f}"


def _hybrid(t: dict) -> bool:
    return t["cpu_misses"] > 0


def _prefetched(t: dict) -> bool:
    return t["prefetched"] > 0


def _timed(t: dict) -> bool:
    return t["stall_ns"] is not None


def _cpu(t: dict) -> bool:
    return t["cpu_experts"] > 0


COLUMNS = [
    Column("layer", 5, lambda r: r["label"]),
    Column("slots", 7, lambda r: r["slots"]),
    Column("calls", 7, lambda r: r["calls"]),
    Column("hits", 8, lambda r: r["hits"]),
    Column("misses", 8, lambda r: r["misses"]),
    Column("hit%", 6, lambda r: _percent(r["hit_rate"])),
    Column("evict", 7, lambda r: r["evictions"]),
    Column("cpu miss", 8, lambda r: r["cpu_misses"], _hybrid),
    Column("model us", 8, _per_call_us("cost_ns"), _hybrid),
    Column("prefetch", 8, lambda r: r["prefetched"], _prefetched),
    Column("pf-recall%", 10, lambda r: _percent(r["prefetch_recall"]), _prefetched),
    Column("wasted", 7, lambda r: r["wasted"], _prefetched),
    Column("MB h2d", 9, _mb("bytes_h2d")),
    Column("wait us", 8, _per_call_us("wait_ns"), _timed),
    Column("ensure us", 9, _per_call_us("ensure_ns"), _timed),
    Column("cpu exp", 8, lambda r: r["cpu_experts"], _cpu),
    Column("cpu MB", 9, _mb("cpu_bytes"), _cpu),
    Column("cpu us", 8, _per_call_us("cpu_ns"), _cpu),
    Column(
        "gpu wait us",
        11,
        _per_call_us("cpu_wait_ns"),
        lambda t: _cpu(t) and t["cpu_wait_ns"] is not None,
    ),
]


def _percent(share: float) -> str:
    """A share as a percentage; "-" where nothing was counted (a share of zero lookups)."""
    return "-" if math.isnan(share) else f"{100 * share:.1f}"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gpu_bytes(c: ExpertCache) -> int:
    return _nbytes(b for n, b in c.named_buffers() if not n.startswith("host_"))


def read_stats(
    caches: list[tuple[str, ExpertCache]],
    resident_layers: int = 0,
    reset: bool = False,
    group=None,
    hybrids: list | None = None,
) -> Stats:
    """The caches' counters, or with a torch.distributed process group `group` their sums over its
    ranks (each rank caching its own experts, as under expert parallelism: slots, experts and bytes
    add up too). `hybrids`, one per cache (a `hybrid.ops.Hybrid` or None): where the CPU computes
    some of its misses, the CPU executor's counters join its row."""
    if not caches:
        return Stats([], resident_layers)
    # the timer's two sums (zeros for an untimed cache) and the layer's sizes ride along with the
    # counters
    rows = torch.stack(
        [
            torch.cat(
                [
                    c.counters,
                    c.timer[[TIMER_WAIT_NS, TIMER_ENSURE_NS, TIMER_COPY_NS, TIMER_COPIED]]
                    if c.timer.numel()
                    else c.counters.new_zeros(4),
                    c.counters.new_tensor(
                        [c.num_slots, c.num_experts, _gpu_bytes(c), _nbytes(c.hosts)]
                    ),
                ]
            )
            for _, c in caches
        ]
    )
    if group is not None:
        dist.all_reduce(rows, group=group)  # every rank of the group calls stats
    rows = rows.tolist()  # the one host sync: stats are read on request, never inside a forward
    if reset:
        for _, c in caches:
            c.counters.zero_()
            c.timer.zero_()
    layers, read = [], {}
    n = len(COUNTERS)
    hybrids = hybrids or [None] * len(caches)
    for i, ((name, c), row, hybrid) in enumerate(zip(caches, rows, hybrids)):
        cpu = {} if hybrid is None else cpu_fields(hybrid.executor, hybrid.layer, reset, read)[0]
        vals = dict(zip(COUNTERS, row))
        wait, ensure, copy_ns, copied = row[n : n + 4] if c.timer.numel() else (None,) * 4
        slots, experts, gpu, host = row[n + 4 :]
        layers.append(
            LayerStats(
                layer=i,
                name=name,
                slots=slots,
                experts=experts,
                **vals,
                expert_bytes=c.expert_bytes,
                gpu_bytes=gpu,
                host_bytes=host,
                wait_ns=wait,
                ensure_ns=ensure,
                miss_copy_ns=copy_ns,
                miss_copies=copied,
                **cpu,
            )
        )
    # a host sync on request (stats read-out), never inside a forward
    pace = caches[0][1].pace.cpu()
    _, window, copy = pace.tolist()  # a host tensor from here: no further sync
    return Stats(
        layers,
        resident_layers,
        copy_ns=copy,
        window_ns=window,
        min_precision=gate_precision(pace).item(),
        hybrid_costs=next((costs_of(h.cost) for h in hybrids if h is not None), None),
    )


def cpu_fields(executor, layer: int, reset: bool, read: dict) -> tuple[dict, int]:
    """A CPU executor's counters of one of its layers as LayerStats fields, and its requests; `read`
    holds each executor's read-out by id, made once (a host sync on CUDA, on request only)."""
    if executor.id not in read:
        read[executor.id] = executor.stats(reset)
    counts, waited = read[executor.id]
    c = dict(zip(STATS, counts[layer].tolist()))  # a host tensor: no sync
    wait = None if waited is None else int(waited[layer, WAITED_NS])
    fields = dict(cpu_experts=c["experts"], cpu_bytes=c["bytes"], cpu_ns=c["ns"], cpu_wait_ns=wait)
    return fields, c["requests"]


def cpu_layer_stats(layers: list[tuple[str, object]], reset: bool = False) -> list[LayerStats]:
    """Rows for layers computed on the host's CPU (`CpuProvider`s, in MoE-layer order): the
    executor's counters, read once per executor (a host sync on CUDA, on request only)."""
    read, rows = {}, []
    for i, (name, p) in enumerate(layers):
        cpu, requests = cpu_fields(p.executor, p.layer, reset, read)
        layer = p.executor.layers[p.layer]
        host = layer.num_experts * layer.expert_bytes
        cache = dict.fromkeys(COUNTERS, 0) | dict(calls=requests, misses=cpu["cpu_experts"])
        rows.append(
            LayerStats(
                layer=i, name=name, slots=0, experts=layer.num_experts, **cache,
                expert_bytes=layer.expert_bytes, gpu_bytes=0, host_bytes=host, **cpu,
            )
        )  # fmt: skip
    return rows
