"""Host -> GPU expert copies: the Triton gather-copy kernel (SMs reading pinned memory through UVA)
against the copy engine (`copy_` from pinned memory, one call per expert).

    python benchmarks/copy_bandwidth.py --out bw.json

OLMoE-size experts (gate_up 2048x2048 + down 2048x1024, bf16: 12.6 MB); the kernel with its full grid
(block size and warps swept) and with its grid capped at 8-128 programs (prefetch's setting). Median of `--reps` timed
copies with CUDA events; the source experts rotate so every copy reads host memory, not a cache.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import asyncmoe.kernels.gather_copy as gc
from asyncmoe.cache.host import PinnedBlock, carve, uva_view

EXPERT_ELEMS = 2048 * 2048 + 2048 * 1024  # one OLMoE expert, both projections
E = 64


def timed(fn, reps: int) -> float:
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    spec = [(torch.Size([E, EXPERT_ELEMS]), torch.bfloat16)]
    block = PinnedBlock(E * EXPERT_ELEMS * 2)
    (host,) = carve(block.data, spec)
    host.copy_(torch.randn(E, EXPERT_ELEMS, dtype=torch.bfloat16))
    (view,) = carve(uva_view(block, dev), spec)
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

        variants = {"copy engine (copy_ per expert)": engine}
        for block_bytes in (16384, 32768, 65536):
            for warps in (4, 8):

                def kernel(i, block_bytes=block_bytes, warps=warps, src_dev=src_dev, dst=dst, count=count):
                    gc.BLOCK_BYTES, gc.NUM_WARPS = block_bytes, warps
                    gc.gather_copy_triton(view, slots, src_dev[i], dst, count)

                variants[f"triton kernel block={block_bytes // 1024}K warps={warps}"] = kernel
        for programs in (8, 16, 32, 64, 128):  # a capped grid, as prefetch runs it beside the compute

            def capped(i, programs=programs, src_dev=src_dev, dst=dst, count=count):
                gc.BLOCK_BYTES, gc.NUM_WARPS = 32768, 4
                gc.gather_copy_triton(view, slots, src_dev[i], dst, count, programs)

            variants[f"triton kernel programs={programs}"] = capped
        for name, fn in variants.items():
            fn(args.reps)  # warm-up / compile
            torch.cuda.synchronize()
            ms = timed(fn, args.reps)
            gbs = n * expert_mb / 1e3 / (ms / 1e3)
            rows.append({"experts": n, "variant": name, "ms": ms, "GB_per_s": gbs})
            print(f"{n:>3} experts  {name:<36} {ms:8.3f} ms  {gbs:6.1f} GB/s", flush=True)
        # correctness of the last kernel copy
        torch.cuda.synchronize()
        assert torch.equal(slots[:n].cpu(), host[srcs[args.reps - 1]]), "kernel copied the wrong bytes"
    result = {"gpu": torch.cuda.get_device_name(), "expert_MB": expert_mb, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
