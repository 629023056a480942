"""Copies per decode step and layer when a step's B trace tokens are one call served in waves (CPU, the cache's own code).

    PYTHONPATH=. python docs/results/2026-11-30/wave_misses.py   # from the repository root
"""
import sys
import torch
sys.path.insert(0, "benchmarks")
from test_latency import belady_misses_per_step, trace_for  # noqa: E402
from asyncmoe import ops  # noqa: E402
from asyncmoe.cache.expert_cache import COUNTERS, ExpertCache, num_waves  # noqa: E402

MISSES = COUNTERS.index("misses")
shape, steps = "olmoe-1b-7b", 192
trace = trace_for(shape)
for batch, cache in ((8, 8), (8, 16), (8, 32), (32, 16)):
    total = 0
    for layer in range(trace.layers):
        c = ExpertCache({"w": torch.zeros(64, 1)}, cache, "lfru")
        for s in range(steps):
            ids = torch.as_tensor(trace.ids[s * batch:(s + 1) * batch, layer]).long()
            for w in range(num_waves(ids.numel(), cache, 64)):
                ops.ensure(c, ids, w)
        total += c.counters[MISSES].item()
    print(f"batch {batch} cache {cache}: {total / trace.layers / steps:.2f} copies per step and layer; "
          f"Belady {belady_misses_per_step(shape, batch, cache):.2f}")
