"""Counters read back from the device, only when asked: one transfer for all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .expert_cache import COUNTERS, ExpertCache


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
    bytes_h2d: int
    gpu_bytes: int  # slots + tables
    host_bytes: int  # the host store

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else float("nan")


@dataclass
class Stats:
    layers: list[LayerStats]
    resident_layers: int = 0  # MoE layers with cache >= num_experts: nothing to count
    totals: dict = field(default_factory=dict)

    def __post_init__(self):
        keys = ("calls", "hits", "misses", "evictions", "bytes_h2d", "gpu_bytes", "host_bytes")
        self.totals = {k: sum(getattr(r, k) for r in self.layers) for k in keys}
        looked_up = self.totals["hits"] + self.totals["misses"]
        self.totals["hit_rate"] = self.totals["hits"] / looked_up if looked_up else float("nan")

    def __str__(self) -> str:
        if not self.layers:
            return f"all {self.resident_layers} MoE layers resident (cache >= num_experts): nothing to count"
        head = f"{'layer':>5} {'slots':>5} {'calls':>7} {'hits':>8} {'misses':>8} {'hit%':>6} {'evict':>7} {'MB h2d':>9}"
        rows = [head, "-" * len(head)]
        for r in self.layers:
            rows.append(
                f"{r.layer:>5} {r.slots:>3}/{r.experts:<3}{r.calls:>6} {r.hits:>8} {r.misses:>8} "
                f"{100 * r.hit_rate:>6.1f} {r.evictions:>7} {r.bytes_h2d / 1e6:>9.1f}"
            )
        t = self.totals
        rows.append("-" * len(head))
        rows.append(
            f"{'all':>5} {'':>7}{t['calls']:>6} {t['hits']:>8} {t['misses']:>8} {100 * t['hit_rate']:>6.1f} "
            f"{t['evictions']:>7} {t['bytes_h2d'] / 1e6:>9.1f}"
        )
        rows.append(f"GPU slots+tables {t['gpu_bytes'] / 2**20:.1f} MiB, host store {t['host_bytes'] / 2**20:.1f} MiB")
        if self.resident_layers:
            rows.append(f"{self.resident_layers} more MoE layers fully resident")
        return "\n".join(rows)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def read_stats(caches: list[tuple[str, ExpertCache]], resident_layers: int = 0, reset: bool = False) -> Stats:
    if not caches:
        return Stats([], resident_layers)
    counters = torch.stack([c.counters for _, c in caches]).tolist()  # the one host sync, on request
    if reset:
        for _, c in caches:
            c.counters.zero_()
    layers = []
    for i, ((name, c), row) in enumerate(zip(caches, counters)):
        vals = dict(zip(COUNTERS, row))
        gpu = _nbytes(c.slots) + _nbytes(b for n, b in c.named_buffers() if not n.startswith(("host_", "slot_")))
        layers.append(
            LayerStats(
                layer=i, name=name, slots=c.num_slots, experts=c.num_experts, calls=vals["calls"], hits=vals["hits"],
                misses=vals["misses"], evictions=vals["evictions"], bytes_h2d=vals["bytes_h2d"],
                gpu_bytes=gpu, host_bytes=_nbytes(c.hosts),
            )
        )
    return Stats(layers, resident_layers)
