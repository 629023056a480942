"""The fused cache step's time per decision on the GPU, `ensure` and `prefetch`, by policy and cache shape.

    python benchmarks/cache_step_time.py [--kernel old_cache_step.py] [--policies markov lfru]

Per shape (E experts, C slots, k experts a token) and policy: 50 decode-sized decisions (one token's top-k from
a skewed distribution) captured in one CUDA graph, decisions only (no copy launches); the median over 7 replays
of the graph's time / 50. "prefetch" is the graph of ensure + prefetch less the ensure-only graph. Before timing,
40 ensure + prefetch calls run through the kernel and through the plain-torch reference, and every table is
compared ("DIFF" marks a difference; tests/test_cache_step.py is the test). `--kernel`: time another file's
`_cache_step` (e.g. `git show REV:asyncmoe/kernels/cache_step.py > old.py`) in place of the package's.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch

from asyncmoe.cache import algorithm
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.kernels import cache_step

SHAPES = [(64, 16, 8), (64, 60, 8), (128, 32, 8), (256, 64, 8)]  # E, C, k
REPS = 50


def decode_calls(E: int, k: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(3, 1, E)
    return [(torch.rand(1, E, generator=g) * skew).topk(k, dim=-1).indices.cuda() for _ in range(n)]


def decide(cache: ExpertCache, ids: torch.Tensor, prefetch: bool) -> None:
    algorithm.ensure_plan(ids, 0, cache.policy, cache.state, cache.slots, use_kernel=True)
    if prefetch:
        algorithm.prefetch_plan(1, cache.policy, cache.state, cache.slots, use_kernel=True)


def us_per_call(E: int, C: int, k: int, policy: str, prefetch: bool) -> float:
    cache = ExpertCache({"w": torch.zeros(E, 1, 8, device="cuda")}, C, policy)
    calls = decode_calls(E, k, REPS, seed=0)
    for ids in calls[:5]:
        decide(cache, ids, prefetch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decide(cache, calls[0], prefetch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for ids in calls:
            decide(cache, ids, prefetch)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPS)
    return statistics.median(times)


def tables_after(E: int, C: int, k: int, policy: str, use_kernel: bool) -> list[torch.Tensor]:
    """Every table the reference and the kernel must agree on, after 40 ensure + prefetch calls."""
    cache = ExpertCache({"w": torch.zeros(E, 1, 8, device="cuda")}, C, policy)
    g = torch.Generator().manual_seed(1)
    for ids in decode_calls(E, k, 40, seed=2):
        algorithm.ensure(ids, 0, cache.policy, cache.state, cache.hosts, cache.slots, use_kernel=use_kernel)
        cache.predicted.copy_(torch.rand(E, generator=g) * (torch.rand(E, generator=g) < 0.4))
        cache.nominated.copy_(torch.randint(0, 8, (E,), generator=g, dtype=torch.int8))
        algorithm.prefetch(2, cache.policy, cache.state, cache.hosts, cache.slots, use_kernel=use_kernel)
    skip = {"scratch", "predicted", "nominated", "outcomes"}  # the kernel's scratch; floats the reference rounds
    trash_row = {"expert_to_slot", "evicted_at"}  # the reference's row for masked writes
    s = cache.state
    return [t[:-1] if n in trash_row else t for n, t in zip(s._fields, s) if n not in skip]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", help="a cache_step.py whose _cache_step to time instead of the package's")
    p.add_argument("--policies", nargs="+", default=["markov", "lfru"])
    args = p.parse_args()
    if args.kernel:
        spec = importlib.util.spec_from_file_location("other_cache_step", args.kernel)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        cache_step._cache_step = other._cache_step
    print(f"{torch.cuda.get_device_name()}: us a decision, {args.kernel or 'the package'}'s kernel")
    for E, C, k in SHAPES:
        for policy in args.policies:
            want, got = tables_after(E, C, k, policy, False), tables_after(E, C, k, policy, True)
            same = all(torch.equal(a, b) for a, b in zip(want, got))
            ensure = us_per_call(E, C, k, policy, False)
            prefetch = us_per_call(E, C, k, policy, True) - ensure
            print(
                f"E{E} C{C} k{k} {policy:<7} ensure {ensure:5.1f}  prefetch {prefetch:5.1f}{'' if same else '  DIFF'}"
            )


if __name__ == "__main__":
    main()
