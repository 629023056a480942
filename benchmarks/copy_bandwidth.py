"""Host -> GPU expert copies, alone and beside compute: the gather-copy kernel (SMs reading pinned memory through
UVA), variants of it (`unrolled`: more loads in flight, cache hints; `tma`: bulk tensor-memory-accelerator
loads and stores; `hinted`: PTX loads with L2 fetch-size hints, and bulk prefetches into L2), the copy engine
(`copy_` per expert, host-known addresses), and the copy engine driven from the device inside a CUDA graph
(switch nodes pick each copy's source).

    python benchmarks/copy_bandwidth.py --out bw.json

OLMoE-size experts (gate_up 2048x2048 + down 2048x1024, bf16: 12.6 MB), 64 in host memory (`--huge-pages`: on
2 MB transparent huge pages, not the allocator's 4 KB ones). Median of `--reps`
timed copies with CUDA events; the source experts rotate so every copy reads host memory, not a cache. "beside
compute": the copy runs on a side stream while the compute stream replays a graph of decode-sized GEMVs (bf16,
weights read from HBM) that outlasts it, as a prefetch runs beside a layer's compute; the copy's own events time it.

The switch path (`switch`, `switch_copy.py` beside this): a graph per planned row count; each row is a CUDA graph
switch node over the experts, whose body e is a copy-engine memcpy of expert e into staging row i, set by a
one-thread kernel from the device's `src`; the gather-copy kernel then moves the staged rows into their slots.
Only the taken bodies run. "switches only" times the same graph without that last move (not checked).
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time

import switch_copy as sc
import torch

import asyncmoe.kernels.gather_copy as gc
from asyncmoe.cache.host import PinnedBlock, carve, uva_view

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

EXPERT_ELEMS = 2048 * 2048 + 2048 * 1024  # one OLMoE expert, both projections
E = 64
_keep = []  # the compute graphs' tensors, alive as long as their graphs


if triton is not None:

    @triton.jit
    def _gather_copy_unrolled(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        count_ptr,
        row_elems,
        row_blocks,
        BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,
        HINTS: tl.constexpr,
    ):
        """gather_copy's kernel with UNROLL blocks' loads in flight before their stores, and optional streaming
        cache hints (host data read once: bypass L1; slots written once: evict first)."""
        work = tl.load(count_ptr) * row_blocks
        step = tl.num_programs(0) * UNROLL
        for w0 in range(tl.program_id(0) * UNROLL, work, step):
            for u in tl.static_range(UNROLL):
                w = w0 + u
                pair = w // row_blocks
                ok = w < work
                s = tl.load(src_idx_ptr + pair, mask=ok, other=0).to(tl.int64)
                d = tl.load(dst_idx_ptr + pair, mask=ok, other=0).to(tl.int64)
                offs = (w % row_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                mask = (offs < row_elems) & ok
                if HINTS:
                    x = tl.load(src_ptr + s * row_elems + offs, mask=mask, cache_modifier=".cg")
                    tl.store(dst_ptr + d * row_elems + offs, x, mask=mask, cache_modifier=".cs")
                else:
                    x = tl.load(src_ptr + s * row_elems + offs, mask=mask)
                    tl.store(dst_ptr + d * row_elems + offs, x, mask=mask)

    @triton.jit
    def _gather_copy_tma(
        src_desc,
        dst_desc,
        src_idx_ptr,
        dst_idx_ptr,
        count_ptr,
        row_tiles,
        TILE_ROWS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """gather_copy through the tensor memory accelerator: each tile of TILE_ROWS x 128 B is a bulk TMA load
        from the host store into shared memory (STAGES in flight) and a TMA store into the slot."""
        work = tl.load(count_ptr) * row_tiles
        for w in tl.range(tl.program_id(0), work, tl.num_programs(0), num_stages=STAGES):
            pair = w // row_tiles
            s = tl.load(src_idx_ptr + pair)
            d = tl.load(dst_idx_ptr + pair)
            t = w % row_tiles
            src_row = ((s * row_tiles + t) * TILE_ROWS).to(tl.int32)  # TMA coordinates are 32-bit: rows of 128 B
            dst_row = ((d * row_tiles + t) * TILE_ROWS).to(tl.int32)
            x = src_desc.load([src_row, 0])
            dst_desc.store([dst_row, 0], x)

    BULK_PREFETCH_BYTES = 32768
    _BULK_PREFETCH = tl.constexpr(  # one thread of the program asks the TMA unit to bring a block into L2
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        f"@p cp.async.bulk.prefetch.L2.global [$1], {BULK_PREFETCH_BYTES}; mov.u32 $0, 0; }}"
    )

    @triton.jit
    def _gather_copy_hinted(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        count_ptr,
        row_chunks,
        row_blocks,
        CHUNKS: tl.constexpr,
        LOAD: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        """gather_copy's kernel with its host reads written in PTX (`LOAD`: 16 B a thread, with an L2 fetch-size
        hint, `.L2::256B`, that may widen the link's read requests) and, with PREFETCH, a bulk prefetch into L2 of the
        block PREFETCH turns ahead, issued by one thread. Rows are whole blocks of CHUNKS 16 B chunks."""
        work = tl.load(count_ptr) * row_blocks
        for w in range(tl.program_id(0), work, tl.num_programs(0)):
            if PREFETCH > 0:
                ahead = tl.minimum(w + PREFETCH * tl.num_programs(0), work - 1)
                s_ahead = tl.load(src_idx_ptr + ahead // row_blocks).to(tl.int64)
                first = src_ptr + (s_ahead * row_chunks + (ahead % row_blocks).to(tl.int64) * CHUNKS) * 2
                tl.inline_asm_elementwise(
                    _BULK_PREFETCH, "=r,l", [first + tl.zeros([1], tl.int64)], dtype=tl.int32, is_pure=False, pack=1
                )
            pair = w // row_blocks
            s = tl.load(src_idx_ptr + pair).to(tl.int64)
            d = tl.load(dst_idx_ptr + pair).to(tl.int64)
            chunk = (w % row_blocks).to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)
            lo, hi = tl.inline_asm_elementwise(
                LOAD,
                "=l,=l,l",
                [src_ptr + (s * row_chunks + chunk) * 2],
                dtype=(tl.int64, tl.int64),
                is_pure=True,
                pack=1,
            )
            words = (w % row_blocks).to(tl.int64) * CHUNKS * 2 + tl.arange(0, 2 * CHUNKS)
            tl.store(dst_ptr + d * row_chunks * 2 + words, tl.join(lo, hi).reshape(2 * CHUNKS))


def tma(view, slots, src, dst, count, stages: int, programs: int | None, tile_rows=256):
    """The TMA variant: host store and slots as [rows, 64] int16 (128 B rows), tiles of `tile_rows` rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    word, width = torch.int16, 64
    host2d = view.view(word).reshape(-1, width)
    slots2d = slots.view(word).reshape(-1, width)
    row_tiles = slots[0].numel() * slots.element_size() // 2 // width // tile_rows
    src_desc = TensorDescriptor.from_tensor(host2d, [tile_rows, width])
    dst_desc = TensorDescriptor.from_tensor(slots2d, [tile_rows, width])
    full = src.numel() * row_tiles
    _gather_copy_tma[(min(full, programs or full),)](
        src_desc, dst_desc, src, dst, count.reshape(1), row_tiles, TILE_ROWS=tile_rows, STAGES=stages, num_warps=4
    )


def unrolled(view, slots, src, dst, count, unroll: int, hints: bool, programs: int | None, block_bytes=32768, warps=4):
    word = torch.int64
    row_elems = slots[0].numel() * slots.element_size() // 8
    block = block_bytes // 8
    row_blocks = triton.cdiv(row_elems, block)
    full = triton.cdiv(src.numel() * row_blocks, unroll)
    _gather_copy_unrolled[(min(full, programs or full),)](
        view.view(view.shape[0], -1).view(word),
        slots.view(slots.shape[0], -1).view(word),
        src,
        dst,
        count.reshape(1),
        row_elems,
        row_blocks,
        BLOCK=block,
        UNROLL=unroll,
        HINTS=hints,
        num_warps=warps,
    )


HINTED_LOADS = {  # PTX for one thread's 16 B read of host memory, by L2 fetch-size hint
    "no hint": "ld.global.v2.b64 {$0, $1}, [$2];",
    "L2::128B": "ld.global.L2::128B.v2.b64 {$0, $1}, [$2];",
    "L2::256B": "ld.global.L2::256B.v2.b64 {$0, $1}, [$2];",
    "nc L2::256B": "ld.global.nc.L1::no_allocate.L2::256B.v2.b64 {$0, $1}, [$2];",
}


def hinted(view, slots, src, dst, count, load: str, prefetch: int, programs: int | None, block_bytes=32768):
    """The PTX-load variant; rows must be whole blocks."""
    row_bytes = slots[0].numel() * slots.element_size()
    assert row_bytes % block_bytes == 0, "the hinted variant copies whole blocks only"
    row_blocks = row_bytes // block_bytes
    full = src.numel() * row_blocks
    _gather_copy_hinted[(min(full, programs or full),)](
        view.view(view.shape[0], -1).view(torch.int64),
        slots.view(slots.shape[0], -1).view(torch.int64),
        src,
        dst,
        count.reshape(1),
        row_bytes // 16,
        row_blocks,
        CHUNKS=block_bytes // 16,
        LOAD=HINTED_LOADS[load],
        PREFETCH=prefetch,
        num_warps=4,
    )


class SwitchCopy:
    """A graph of `switch_copy` with `planned` rows, `count` of them real (switch_copy.py)."""

    def __init__(self, rows_from: torch.Tensor, slots: torch.Tensor, planned: int, scatter: bool = True):
        dev = slots.device
        self.src = torch.zeros(planned, dtype=torch.int64, device=dev)
        self.dst = torch.arange(planned, device=dev)
        self.count = torch.zeros(1, dtype=torch.int64, device=dev)
        stage = torch.empty(planned, *slots.shape[1:], dtype=slots.dtype, device=dev)
        self.rows = torch.arange(planned, device=dev)
        sc._set_switches(dev.index)  # load the kernel before the capture
        self.graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream()
        t0 = time.perf_counter()
        keep = sc.gather_copy_triton
        if not scatter:  # time the switches alone: the staged rows stay where they are
            sc.gather_copy_triton = lambda *args: None
        try:
            with torch.cuda.graph(self.graph, stream=capture):
                sc.switch_copy([rows_from], [slots], [stage], self.src, self.dst, self.count, self.rows)
        finally:
            sc.gather_copy_triton = keep
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        _keep.append(stage)

    def __call__(self, src: torch.Tensor) -> None:
        self.src[: src.numel()].copy_(src, non_blocking=True)
        self.count.fill_(src.numel())
        self.graph.replay()


class HugePageBlock:
    """`nbytes` of anonymous memory backed by 2 MB transparent huge pages where the kernel grants them, pinned in
    place: the host store's memory on another page size (PinnedBlock's has the allocator's 4 KB pages)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.data, self.nbytes = torch.frombuffer(self.map, dtype=torch.uint8), nbytes
        self.data.zero_()  # fault the pages in now, as huge pages
        rc = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 1 | 2))  # portable | mapped
        assert rc == 0, f"cudaHostRegister failed with CUDA error {rc}"
        with open("/proc/self/smaps_rollup") as f:
            huge_kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        print(f"host store: {huge_kb / 1024:.0f} of {nbytes / 2**20:.0f} MB on huge pages", flush=True)


def host_experts(dev: torch.device, huge_pages: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """E random OLMoE-size experts [E, EXPERT_ELEMS] in pinned memory, and their UVA view on `dev`."""
    spec = [(torch.Size([E, EXPERT_ELEMS]), torch.bfloat16)]
    block = (HugePageBlock if huge_pages else PinnedBlock)(E * EXPERT_ELEMS * 2)
    (host,) = carve(block.data, spec)
    host.copy_(torch.randn(E, EXPERT_ELEMS, dtype=torch.bfloat16))
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
    p.add_argument(
        "--paths",
        nargs="+",
        default=["kernel", "engine"],
        choices=["kernel", "unrolled", "engine", "tma", "switch", "hinted"],
    )
    p.add_argument("--huge-pages", action="store_true", help="the host store on 2 MB transparent huge pages")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    host, view = host_experts(dev, args.huge_pages)
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
            gc.gather_copy_triton([view], [slots], src_dev[i], dst, count, programs)

        variants, timing_only = {}, {}  # timing_only: not checked, they leave the slots as they were
        if "engine" in args.paths:
            variants["copy engine (copy_ per expert)"] = engine
        if "kernel" in args.paths:
            variants["kernel (gather_copy)"] = kernel
            variants["kernel programs=32"] = lambda i: kernel(i, 32)
            variants["kernel programs=132"] = lambda i: kernel(i, 132)
        if "unrolled" in args.paths:
            for unroll, hints in [(2, False), (4, False), (1, True), (2, True)]:
                for cap in (None, 32):
                    name = f"unrolled x{unroll}{' hints' if hints else ''} programs={cap or 'full'}"
                    variants[name] = lambda i, u=unroll, h=hints, c=cap, s=src_dev, d=dst, k=count: unrolled(
                        view, slots, s[i], d, k, u, h, c
                    )
        if "hinted" in args.paths:
            for load in HINTED_LOADS:
                for cap in (None, 32):
                    name = f"hinted {load} programs={cap or 'full'}"
                    variants[name] = lambda i, ld=load, c=cap, s=src_dev, d=dst, k=count: hinted(
                        view, slots, s[i], d, k, ld, 0, c
                    )
            for ahead in (1, 2):
                for cap in (32, 132):
                    name = f"hinted L2::256B bulk prefetch {ahead} ahead programs={cap}"
                    variants[name] = lambda i, a=ahead, c=cap, s=src_dev, d=dst, k=count: hinted(
                        view, slots, s[i], d, k, "L2::256B", a, c
                    )
        if "tma" in args.paths:
            for stages in (2, 4):
                for cap in (None, 32, 132):
                    name = f"tma stages={stages} programs={cap or 'full'}"
                    variants[name] = lambda i, st=stages, c=cap, s=src_dev, d=dst, k=count: tma(
                        view, slots, s[i], d, k, st, c
                    )
        if "switch" in args.paths:
            for source, rows_from in (("UVA view", view), ("pinned tensor", host)):
                for planned in sorted({n, max(args.counts)}):
                    try:
                        c = SwitchCopy(rows_from, slots, planned)
                    except Exception as e:  # noqa: BLE001 -- report what the driver refused, then go on
                        print(f"switch copy from the {source}: not captured: {type(e).__name__}: {e}", flush=True)
                        continue
                    print(f"switch copy, {planned} rows: captured and instantiated in {c.capture_s:.2f} s", flush=True)
                    name = f"switch copy engine ({source}, {planned} rows)"
                    variants[name] = lambda i, s=src_dev, c=c: c(s[i])
                    if planned == n:
                        c = SwitchCopy(rows_from, slots, planned, scatter=False)
                        timing_only[f"switches only ({source}, {planned} rows)"] = lambda i, s=src_dev, c=c: c(s[i])
        compute = gemv_graph(3 * n * 0.25)
        compute_alone = timed(lambda i, g=compute: g.replay(), 5, None)
        for name, fn in {**variants, **timing_only}.items():
            fn(args.reps)  # warm-up / compile
            torch.cuda.synchronize()
            for where, beside in (("alone", None), ("beside compute", compute)):
                ms = timed(fn, args.reps, beside)
                gbs = n * expert_mb / 1e3 / (ms / 1e3)
                rows.append({"experts": n, "variant": name, "where": where, "ms": ms, "GB_per_s": gbs})
                print(f"{n:>3} experts  {name:<48} {where:<15} {ms:8.3f} ms  {gbs:6.1f} GB/s", flush=True)
            torch.cuda.synchronize()
            if name in timing_only:
                continue
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
