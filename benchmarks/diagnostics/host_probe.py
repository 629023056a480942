"""What this host's CPU can do with experts kept in its memory: how fast its cores read that memory, and what one
expert's MLP costs on them at decode sizes, in bf16 and int4 through torch, and through asyncmoe's own CPU kernels in
every format the host store holds; what computing a cold expert on the CPU, instead of
copying it to the GPU, would cost here. No GPU needed; on a CUDA host the copy engine's bandwidth comes last.

    python benchmarks/diagnostics/host_probe.py --out host.json
    python benchmarks/diagnostics/host_probe.py --gib 0.25 --experts 8 --threads 1 all --repeats 3      # a quick look

read: `sum()` over a `--gib` GiB float32 buffer (STREAM-like), at each of `--threads` (`all`: every core this
process may use). bf16: x [T, D] through gate_up [2I, D], silu(gate) * up [T, I], down [D, I] for T in `--tokens`,
D and I of `--shapes` (shapes.py). A sample runs `--experts` experts in turn, so their weights come from memory, not
a cache: ms is per expert, GB/s its weights' bytes over that. int4: the same through torch's CPU int4 matmul (groups
of 32 along K, bf16 scales and zeros, random values: the time does not depend on them), GB/s over the packed weights
and their scales. asyncmoe: the same MLP through compute/cpu's kernels (bf16, fp8, mxfp4, int4), GB/s over the
stored weights and scales. Each figure is the median of `--repeats` samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from asyncmoe.compute.cpu import CpuExperts, Pool, Projection, experts_mlp
from asyncmoe.compute.cpu.build import ISA_FLAGS
from asyncmoe.compute.cpu.kernels import library
from asyncmoe.formats import FP8, Fp8, Int4, Mxfp4

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import h2d_bandwidth
from shapes import expert_dims

GROUP = 32  # int4 scales and zeros: one pair per 32 weights along K
INT4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
CPU_FORMATS = (
    "bf16",
    "fp8",
    "mxfp4",
    "int4",
)  # asyncmoe's CPU kernels, from the host store's layouts


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op threads set to `n`, and set back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_ms(repeats: int, fn, *args) -> float:
    """Median wall ms of `fn(*args)` over `repeats` calls, after one untimed call."""
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def read_bandwidth(gib: float, threads: list[int], repeats: int) -> list[dict]:
    """GB/s the cores read host memory at: a float32 sum streams every byte once."""
    buf = torch.ones(int(gib * 2**30) // 4)  # [N] float32, every page touched
    rows = []
    for n in threads:
        with num_threads(n):
            ms = median_ms(repeats, buf.sum)
        rows.append(dict(probe="read", threads=n, ms=ms, GB_per_s=buf.nbytes / ms / 1e6))
    return rows


def int4_weight(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int4 weight [rows, k] packed for the CPU matmul [rows, k / 2], and its scales and zeros
    [k / GROUP, rows, 2] (bf16)."""
    q = torch.randint(0, 16, (rows, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack(
        [torch.full((k // GROUP, rows), 0.01), torch.zeros(k // GROUP, rows)], dim=-1
    )
    return packed, scales_zeros.to(torch.bfloat16)


def linear_int4(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight[0], GROUP, weight[1])


def make_experts(fmt: str, n: int, D: int, I: int) -> list[tuple]:
    """`n` experts' (gate_up [2I, D], down [D, I]) in `fmt`."""
    if fmt == "int4":
        return [(int4_weight(2 * I, D), int4_weight(D, I)) for _ in range(n)]
    bf16 = dict(dtype=torch.bfloat16)
    return [
        (
            torch.empty(2 * I, D, **bf16).normal_(std=0.02),
            torch.empty(D, I, **bf16).normal_(std=0.02),
        )
        for _ in range(n)
    ]


def nbytes(weight) -> int:
    return weight.nbytes if isinstance(weight, torch.Tensor) else sum(map(nbytes, weight))


def run_experts(x: torch.Tensor, experts: list[tuple], linear) -> None:
    """x [T, D] through each expert's MLP in turn."""
    for gate_up, down in experts:
        gate, up = linear(x, gate_up).chunk(2, dim=-1)  # [T, I] each
        linear(F.silu(gate) * up, down)  # [T, D]


def expert_mlp(
    shape: str, fmt: str, threads: list[int], tokens: list[int], n: int, repeats: int
) -> list[dict]:
    """ms per expert MLP of `shape` in `fmt`, and GB/s of its weights, by threads and tokens."""
    D, I = expert_dims(shape)
    experts = make_experts(fmt, n, D, I)
    linear = linear_int4 if fmt == "int4" else F.linear
    rows = []
    for t in threads:
        with num_threads(t):
            for T in tokens:
                x = torch.randn(T, D, dtype=torch.bfloat16)  # [T, D]
                ms = median_ms(repeats, run_experts, x, experts, linear) / n
                gbps = nbytes(experts[0]) / ms / 1e6
                rows.append(
                    dict(
                        probe=f"{fmt} expert MLP",
                        shape=shape,
                        threads=t,
                        tokens=T,
                        ms=ms,
                        GB_per_s=gbps,
                    )
                )
    return rows


def cpu_layer(fmt: str, n: int, D: int, I: int) -> CpuExperts:
    """`n` random experts (gate_up [2I, D], down [D, I]) as asyncmoe's host store holds them in
    `fmt`: bf16, block-wise fp8, mxfp4 or int4 (random codes and scales: the time does not depend
    on them)."""

    def projection(N: int, K: int) -> Projection:
        if fmt == "bf16":
            return Projection(torch.empty(n, N, K, dtype=torch.bfloat16).normal_(std=0.02))
        if fmt == "fp8":
            w = torch.empty(n, N, K).normal_(std=0.02).to(FP8)
            return Projection(w, torch.full((n, -(-N // 128), -(-K // 128)), 0.01), fmt=Fp8())
        packed = torch.randint(0, 256, (n, N, K // 2), dtype=torch.uint8)
        if fmt == "mxfp4":
            scales = torch.randint(118, 122, (n, N, K // 32), dtype=torch.uint8)
            return Projection(packed, scales, fmt=Mxfp4())
        scales = torch.full((n, N, K // 32), 0.01, dtype=torch.bfloat16)
        return Projection(packed, scales, fmt=Int4())

    return CpuExperts(projection(2 * I, D), projection(D, I))


def asyncmoe_mlp(
    shape: str, fmt: str, threads: list[int], tokens: list[int], n: int, repeats: int, isa: str
) -> list[dict]:
    """asyncmoe's CPU kernels (compute/cpu) built for `isa`: ms per expert MLP of `shape` in `fmt`,
    every token of a sample through each of `n` experts, and GB/s of the weights (scales included)
    they read."""
    D, I = expert_dims(shape)
    layer = cpu_layer(fmt, n, D, I)
    rows = []
    built = library(isa).amc_isa().decode()  # what the build is on this host: avx512 may be avx2
    name = f"asyncmoe {fmt} expert MLP" + ("" if isa == "native" else f" ({built})")
    for t in threads:
        pool = Pool(t, isa=isa)
        for T in tokens:
            x = torch.randn(T, D, dtype=torch.bfloat16)
            token_ids = torch.arange(T).repeat(n)
            expert_ids = torch.arange(n).repeat_interleave(T)
            ms = median_ms(repeats, experts_mlp, layer, x, token_ids, expert_ids, pool) / n
            rows.append(
                dict(
                    probe=name,
                    shape=shape,
                    threads=t,
                    tokens=T,
                    ms=ms,
                    GB_per_s=layer.expert_bytes / ms / 1e6,
                )
            )
        pool.close()
    return rows


def probe(
    shapes: list[str],
    threads: list[int],
    tokens: list[int],
    experts: int,
    gib: float,
    repeats: int,
    formats: tuple[str, ...] = CPU_FORMATS,
    isas: tuple[str, ...] = ("native",),
):
    """The rows, each as soon as it is measured (so that a run cut short still shows its first)."""
    yield from read_bandwidth(gib, threads, repeats)
    for shape in shapes:
        for fmt in ["bf16", "int4"] if INT4 else ["bf16"]:
            if fmt in formats:
                yield from expert_mlp(shape, fmt, threads, tokens, experts, repeats)
        for fmt in formats:
            for isa in isas:
                yield from asyncmoe_mlp(shape, fmt, threads, tokens, experts, repeats, isa)
    if torch.cuda.is_available():
        yield dict(probe="copy engine: pinned host -> GPU", GB_per_s=h2d_bandwidth())


HEADER = "| probe | shape | threads | tokens | ms | GB/s |\n|---|---|--:|--:|--:|--:|"


def table_row(r: dict) -> str:
    ms = f"{r['ms']:.3f}" if "ms" in r else ""
    cells = [r["probe"], r.get("shape", ""), r.get("threads", ""), r.get("tokens", ""), ms]
    return "| " + " | ".join(map(str, [*cells, f"{r['GB_per_s']:.1f}"])) + " |"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["deepseek-v2-lite", "olmoe-1b-7b"])
    p.add_argument(
        "--threads", nargs="+", default=["1", "4", "8", "all"], help="thread counts, or all"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--experts",
        type=int,
        default=64,
        help="experts a sample runs in turn: more than the CPU caches",
    )
    p.add_argument("--gib", type=float, default=1.0, help="the read probe's buffer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--formats", nargs="+", choices=CPU_FORMATS, default=list(CPU_FORMATS))
    p.add_argument(
        "--isas",
        nargs="+",
        choices=list(ISA_FLAGS),
        default=["native"],
        help="builds of asyncmoe's kernels to time side by side",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = sorted(
        {cores if t == "all" else int(t) for t in args.threads} & set(range(1, cores + 1))
    )
    if not INT4:
        print(f"int4: skipped, torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu")
    host = {"cpu": cpu_name(), "cores": cores, "torch": torch.__version__}
    print(f"{host['cpu']}, {cores} cores, torch {torch.__version__}\n\n{HEADER}", flush=True)
    rows = []
    for r in probe(
        args.shapes,
        threads,
        args.tokens,
        args.experts,
        args.gib,
        args.repeats,
        args.formats,
        args.isas,
    ):
        rows.append(r)
        print(table_row(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**host, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
