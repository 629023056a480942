"""Host -> GPU expert copies, alone and beside compute: the gather-copy kernel (SMs reading pinned memory through
UVA, the path asyncmoe's cache takes) against the copy engine (`copy_` per expert, host-known addresses).

    python benchmarks/diagnostics/copy_bandwidth.py --out bw.json

OLMoE-size experts (gate_up 2048x2048 + down 2048x1024, bf16: 12.6 MB), 64 in pinned host memory. Median of `--reps`
timed copies with CUDA events; the source experts rotate so every copy reads host memory, not a cache. "beside
compute": the copy runs on a side stream while the compute stream replays a graph of decode-sized GEMVs (bf16,
weights read from HBM) that outlasts it, as a prefetch runs beside a layer's compute; the copy's own events time it.
The kernel runs on its full grid and capped at 32 programs (prefetch's `copy_programs`) and 132.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from asyncmoe.cache.gather_copy import gather_copy_triton
from asyncmoe.cache.host import PinnedBlock, carve, uva_view

EXPERT_ELEMS = 2048 * 2048 + 2048 * 1024  # one OLMoE expert, both projections
E = 64
_keep = []  # the compute graphs' tensors, alive as long as their graphs


def host_experts(
    dev: torch.device, n: int = E, elems: int = EXPERT_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random bf16 experts [n, elems] (OLMoE-size by default) in pinned memory, and their UVA view on
    `dev`; the memory stays pinned for the process."""
    spec = [(torch.Size([n, elems]), torch.bfloat16)]
    block = PinnedBlock(n * elems * 2)
    (host,) = carve(block.data, spec)
    host.copy_(torch.randn(n, elems, dtype=torch.bfloat16))
    (view,) = carve(uva_view(block, dev), spec)
    _keep.append(block)
    return host, view


def gemv_graph(ms: float) -> torch.cuda.CUDAGraph:
    """A graph of decode-sized bf16 GEMVs (a [1, 2048] input through 32 MB of weights) lasting about `ms`."""
    w = torch.randn(8192, 2048, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, 1, dtype=torch.bfloat16, device="cuda")
    one = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        one[0].record()
        for _ in range(20):
            w @ x
        one[1].record()
        one[1].synchronize()
    n = max(1, int(ms / (one[0].elapsed_time(one[1]) / 20)))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w @ x  # cuBLAS's workspace for this stream, before the capture
    with torch.cuda.graph(g, stream=s):
        for _ in range(n):
            w @ x
    _keep.append((w, x))
    return g


def timed(fn, reps: int, beside: torch.cuda.CUDAGraph | None) -> float:
    """Median ms of `fn(i)` on a side stream, alone or while the compute stream replays `beside`."""
    side = torch.cuda.Stream()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if beside is not None:
            beside.replay()  # queued first on the compute stream, so it is running when the copy starts
        with torch.cuda.stream(side):
            a.record()
            fn(i)
            b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--counts", type=int, nargs="+", default=[1, 6, 8])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--paths", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    host, view = host_experts(dev)
    slots = torch.empty(max(args.counts), EXPERT_ELEMS, dtype=torch.bfloat16, device=dev)
    expert_mb = EXPERT_ELEMS * 2 / 1e6
    rows = []
    for n in args.counts:
        dst = torch.arange(n, device=dev)
        count = torch.tensor(n, device=dev)
        srcs = [torch.randperm(E)[:n] for _ in range(args.reps + 3)]
        src_dev = [s.to(dev) for s in srcs]

        def engine(i, srcs=srcs):
            for j, e in enumerate(srcs[i].tolist()):
                slots[j].copy_(host[e], non_blocking=True)

        def kernel(i, programs=None, src_dev=src_dev, dst=dst, count=count):
            gather_copy_triton([view], [slots], src_dev[i], dst, count, programs)

        variants = {}
        if "engine" in args.paths:
            variants["copy engine (copy_ per expert)"] = engine
        if "kernel" in args.paths:
            variants["kernel (gather_copy)"] = kernel
            variants["kernel programs=32"] = lambda i: kernel(i, 32)
            variants["kernel programs=132"] = lambda i: kernel(i, 132)
        compute = gemv_graph(3 * n * 0.25)
        compute_alone = timed(lambda i, g=compute: g.replay(), 5, None)
        for name, fn in variants.items():
            fn(args.reps)  # warm-up / compile
            torch.cuda.synchronize()
            for where, beside in (("alone", None), ("beside compute", compute)):
                ms = timed(fn, args.reps, beside)
                gbs = n * expert_mb / 1e3 / (ms / 1e3)
                rows.append(
                    {"experts": n, "variant": name, "where": where, "ms": ms, "GB_per_s": gbs}
                )
                print(
                    f"{n:>3} experts  {name:<48} {where:<15} {ms:8.3f} ms  {gbs:6.1f} GB/s",
                    flush=True,
                )
            torch.cuda.synchronize()
            want = host[srcs[args.reps - 1]]
            assert torch.equal(slots[:n].cpu(), want), f"{name} copied the wrong bytes"
            slots.zero_()
        rows.append({"experts": n, "variant": "compute graph alone", "ms": compute_alone})
        print(f"{n:>3} experts  compute graph alone: {compute_alone:.3f} ms", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "expert_MB": expert_mb, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
