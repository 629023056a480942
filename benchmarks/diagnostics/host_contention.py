"""Can the host's memory feed the link and the CPU at once? The hybrid reads experts from host memory two ways at
the same time: the GPU copies misses over the link, the CPU's kernels compute others. Each is timed alone, then
both together, each over the other's whole run: GB/s of expert weights each side moves, and their sum beside the
cores' read bandwidth alone.

    python benchmarks/diagnostics/host_contention.py --shape deepseek-v2-lite --threads 14 --out contention.json

Experts of `--shape` in bf16, `--experts` of them in turn (more than the CPU's caches hold). The link: asyncmoe's
gather-copy kernel (SMs reading pinned memory through UVA, the decode path) and the copy engine (`copy_` per
expert), `--copies` experts a call, calls queued back to back for `--seconds`. The CPU: asyncmoe's bf16 expert MLP
at one token (compute/cpu, a pool of `--threads`), in a loop on a Python thread (the kernels run without the GIL).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time

import torch

from asyncmoe.cache.gather_copy import gather_copy_triton
from asyncmoe.compute.cpu import Pool, experts_mlp
from asyncmoe.compute.cpu.kernels import default_threads

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from copy_bandwidth import host_experts
from host_probe import cpu_layer, read_bandwidth

from shapes import expert_dims


class CpuLoop(threading.Thread):
    """Expert MLPs on the CPU until stopped, each call's end time and bytes kept."""

    def __init__(self, layer, pool: Pool, D: int, n: int):
        super().__init__(daemon=True)
        self.layer, self.pool = layer, pool
        self.x = torch.randn(1, D, dtype=torch.bfloat16)
        self.tokens, self.experts = torch.zeros(n, dtype=torch.long), torch.arange(n)
        self.nbytes = n * layer.expert_bytes
        self.ends: list[float] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            experts_mlp(self.layer, self.x, self.tokens, self.experts, self.pool)
            self.ends.append(time.perf_counter())

    def gb_per_s(self, start: float, end: float) -> float:
        """The rate of the calls that ran wholly inside [start, end]."""
        inside = [t for t in self.ends if start <= t <= end]
        return (len(inside) - 1) * self.nbytes / (inside[-1] - inside[0]) / 1e9


def link_gb_per_s(copy, nbytes: int, seconds: float) -> tuple[float, float, float]:
    """(GB/s, start, end) of `copy(i)` calls queued back to back on a side stream for about `seconds`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copy(0)
        stream.synchronize()
        t = time.perf_counter()
        copy(1)
        stream.synchronize()
        calls = max(3, int(seconds / (time.perf_counter() - t)))
        start = time.perf_counter()
        for i in range(calls):
            copy(i)
        stream.synchronize()
        end = time.perf_counter()
    return calls * nbytes / (end - start) / 1e9, start, end


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v2-lite")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the CPU's pool (default: as a model beside a GPU)",
    )
    p.add_argument("--experts", type=int, default=48)
    p.add_argument(
        "--copies", type=int, default=2, help="experts a copy call moves (a layer's misses)"
    )
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    D, I = expert_dims(args.shape)
    threads = args.threads or default_threads(beside_gpu=True)
    n, c = args.experts, args.copies
    elems = 3 * I * D  # gate_up [2I, D] and down [D, I]
    host, view = host_experts(dev, n, elems)
    slots = torch.empty(c, elems, dtype=torch.bfloat16, device=dev)
    turns = [torch.arange(i * c, i * c + c) % n for i in range(n)]
    turns_dev = [t.to(dev) for t in turns]
    dst, count = torch.arange(c, device=dev), torch.tensor(c, device=dev)

    def kernel(i):
        gather_copy_triton([view], [slots], turns_dev[i % n], dst, count)

    def engine(i):
        for j, e in enumerate(turns[i % n].tolist()):
            slots[j].copy_(host[e], non_blocking=True)

    layer, pool = cpu_layer("bf16", n, D, I), Pool(threads)
    copy_bytes = c * elems * 2
    read = read_bandwidth(1.0, [threads], 5)[0]["GB_per_s"]
    print(
        f"{torch.cuda.get_device_name()}; {args.shape} bf16 experts of {elems * 2 / 1e6:.1f} MB; CPU pool "
        f"{threads} threads; the cores read host memory at {read:.1f} GB/s",
        flush=True,
    )
    alone = CpuLoop(layer, pool, D, n)
    alone.start()
    time.sleep(args.seconds)
    alone.stop.set()
    alone.join()
    cpu_alone = alone.gb_per_s(alone.ends[0], alone.ends[-1])
    rows = []
    for name, copy in (("gather-copy kernel", kernel), ("copy engine", engine)):
        link_alone, _, _ = link_gb_per_s(copy, copy_bytes, args.seconds)
        loop = CpuLoop(layer, pool, D, n)
        loop.start()
        time.sleep(0.2)
        link_beside, start, end = link_gb_per_s(copy, copy_bytes, args.seconds)
        loop.stop.set()
        loop.join()
        cpu_beside = loop.gb_per_s(start, end)
        r = dict(
            link=name, link_alone=link_alone, link_beside_cpu=link_beside,
            cpu_alone=cpu_alone, cpu_beside_link=cpu_beside, read_alone=read,
        )  # fmt: skip
        rows.append(r)
        print(
            f"{name}: link {link_alone:.1f} GB/s alone, {link_beside:.1f} beside the CPU "
            f"({100 * link_beside / link_alone:.0f}%); CPU {cpu_alone:.1f} alone, {cpu_beside:.1f} beside the link "
            f"({100 * cpu_beside / cpu_alone:.0f}%); together {link_beside + cpu_beside:.1f} GB/s of host memory",
            flush=True,
        )
    pool.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "shape": args.shape,
                    "threads": threads,
                    "rows": rows,
                },
                f,
            )


if __name__ == "__main__":
    main()
