"""Counters read back from the device, only when asked: one transfer for all layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .cache.expert_cache import ExpertCache
from .cache.state import COUNTERS, TIMER_ENSURE_NS, TIMER_WAIT_NS
from .compute.cpu.kernels import STATS
from .compute.cpu.request import WAITED_NS
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
        for k in ("wait_ns", "ensure_ns", "stall_ns"):
            self.totals[k] = sum(getattr(r, k) for r in timed) if timed else None
        waited = [r.cpu_wait_ns for r in self.layers if r.cpu_wait_ns is not None]
        self.totals["cpu_wait_ns"] = sum(waited) if waited else None
        looked_up = self.totals["hits"] + self.totals["misses"] + self.totals["cpu_misses"]
        self.totals["hit_rate"] = self.totals["hits"] / looked_up if looked_up else float("nan")
        self.totals["prefetch_recall"] = (
            self.totals["prefetch_hits"] / looked_up if looked_up else float("nan")
        )

    def __str__(self) -> str:
        if not self.layers:
            return f"all {self.resident_layers} MoE layers resident (cache >= num_experts): nothing to count"
        t = self.totals
        timed = t["stall_ns"] is not None
        # the prefetch columns only where a prefetch copied something
        prefetched = t["prefetched"] > 0
        widths = {"layer": 5, "slots": 7, "calls": 7, "hits": 8, "misses": 8, "hit%": 6, "evict": 7}
        hybrid = t["cpu_misses"] > 0
        widths |= {"cpu miss": 8, "model us": 8} if hybrid else {}
        widths |= {"prefetch": 8, "pf-recall%": 10, "wasted": 7} if prefetched else {}
        widths |= {"MB h2d": 9}
        widths |= {"wait us": 8, "ensure us": 9} if timed else {}
        cpu = t["cpu_experts"] > 0
        widths |= {"cpu exp": 8, "cpu MB": 9, "cpu us": 8} if cpu else {}
        widths |= {"gpu wait us": 11} if cpu and t["cpu_wait_ns"] is not None else {}

        def line(cells: dict) -> str:
            return " ".join(f"{cells[name]:>{w}}" for name, w in widths.items())

        def row(label, slots, r: dict) -> str:
            calls = max(r["calls"], 1)
            return line(
                {
                    "layer": label,
                    "slots": slots,
                    "calls": r["calls"],
                    "hits": r["hits"],
                    "misses": r["misses"],
                    "cpu miss": r["cpu_misses"],
                    "model us": f"{r['cost_ns'] / 1e3 / calls:.1f}",
                    "hit%": _percent(r["hit_rate"]),
                    "evict": r["evictions"],
                    "prefetch": r["prefetched"],
                    "pf-recall%": _percent(r["prefetch_recall"]),
                    "wasted": r["wasted"],
                    "MB h2d": f"{r['bytes_h2d'] / 1e6:.1f}",
                    "wait us": f"{r['wait_ns'] / 1e3 / calls:.1f}" if timed else "",
                    "ensure us": f"{r['ensure_ns'] / 1e3 / calls:.1f}" if timed else "",
                    "cpu exp": r["cpu_experts"],
                    "cpu MB": f"{r['cpu_bytes'] / 1e6:.1f}",
                    "cpu us": f"{r['cpu_ns'] / 1e3 / calls:.1f}",
                    "gpu wait us": "-"
                    if r["cpu_wait_ns"] is None
                    else f"{r['cpu_wait_ns'] / 1e3 / calls:.1f}",
                }
            )

        head = line({name: name for name in widths})
        rows = [head, "-" * len(head)]
        for r in self.layers:
            rows.append(
                row(
                    r.layer,
                    f"{r.slots}/{r.experts}",
                    {**vars(r), "hit_rate": r.hit_rate, "prefetch_recall": r.prefetch_recall},
                )
            )
        rows += ["-" * len(head), row("all", "", t)]
        if not t["hits"] + t["misses"]:
            rows.append("no expert looked up yet: no rates")
        if prefetched:
            rows.append(
                "pf-recall%: routed experts found resident because a prefetch put them "
                "there (part of hit%)"
            )
        else:
            rows.append(
                "nothing prefetched (prefetch off, or it found nothing worth a copy): no "
                "prefetch columns"
            )
        if t["prefetch_hits"]:
            rows.append(
                "prefetch hits by predictor (an expert can have several): "
                + ", ".join(f"{s} {t['hits_' + s]}" for s in ("gate", "temporal", "transition"))
                + f"; {t['prefetch_timely']} of {t['prefetch_hits']} in the call they were fetched "
                "for"
            )
        if t["explored"]:
            rows.append(
                f"closed prefetch gates explored {t['explored']} times with no copy: "
                f"{t['explored_paid']} would have "
                "saved a miss"
            )
        if t["runners_up"]:
            rows.append(
                f"prefetch nominations past each call's likeliest: {t['runners_up']}, of which the "
                "call routed to "
                f"{t['runners_up_paid']} (copied only while enough of them are)"
            )
        rows.append(
            f"device slots+tables {t['gpu_bytes'] / 2**20:.1f} MiB, host store "
            f"{t['host_bytes'] / 2**20:.1f} MiB"
        )
        if self.copy_ns and self.window_ns:
            rows.append(
                f"prefetch gate: an expert's copy {self.copy_ns / 1e3:.1f} us, the compute a "
                "prefetch hid behind "
                f"{self.window_ns / 1e3:.1f} us: open while {100 * self.min_precision:.0f}% of "
                "prefetches save a miss"
            )
        if timed:
            rows.append(
                "wait us, ensure us: per call, on the GPU clock: waiting for the prefetch; "
                "deciding and copying misses"
            )
        if cpu:
            waits = "; gpu wait us: the GPU's wait for it" if "gpu wait us" in widths else ""
            rows.append(
                "cpu exp, cpu MB, cpu us: experts the host's CPU computed, the weights it read, its "
                f"time a call{waits}"
            )
        if hybrid:
            rows.append(
                "misses: copied into slots; cpu miss: computed by the CPU instead (hybrid); model "
                "us: the cost model's time for a call's misses"
            )
        if self.resident_layers:
            rows.append(f"{self.resident_layers} more MoE layers fully resident")
        return "\n".join(rows)


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
                    c.timer[[TIMER_WAIT_NS, TIMER_ENSURE_NS]]
                    if c.timer.numel()
                    else c.counters.new_zeros(2),
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
        wait, ensure = row[n : n + 2] if c.timer.numel() else (None, None)
        slots, experts, gpu, host = row[n + 2 :]
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
        hybrid_costs=next((h.costs for h in hybrids if h is not None), None),
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
