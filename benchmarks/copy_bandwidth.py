"""Host -> GPU expert copies, alone and beside compute: the gather-copy kernel (SMs reading pinned memory through
UVA), variants of it (`unrolled`: more loads in flight, cache hints; `tma`: bulk tensor-memory-accelerator
loads and stores), the copy engine (`copy_` per expert, host-known addresses), and the copy engine driven from
the device inside a CUDA graph (conditional nodes pick each copy's source).

    python benchmarks/copy_bandwidth.py --out bw.json

OLMoE-size experts (gate_up 2048x2048 + down 2048x1024, bf16: 12.6 MB), 64 in host memory. Median of `--reps`
timed copies with CUDA events; the source experts rotate so every copy reads host memory, not a cache. "beside
compute": the copy runs on a side stream while the compute stream replays a graph of decode-sized GEMVs (bf16,
weights read from HBM) that outlasts it, as a prefetch runs beside a layer's compute; the copy's own events time it.

The conditional path (`conditional`): one graph per copy count n. Its first kernels compare each copy's source
expert with the split points of a binary tree over the experts; copy i's tree is a nest of IF nodes on those
predicates, each leaf a copy-engine memcpy of one expert into staging row i, the n trees on parallel branches;
then one device-to-device `index_copy_` puts the staged rows into their slots. Only the branch taken runs.
"""

from __future__ import annotations

import argparse
import json
import statistics

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


class ConditionalCopy:
    """A graph that copies `n` device-chosen experts from host memory with the copy engine (see the module doc)."""

    def __init__(self, host_rows: torch.Tensor, slots: torch.Tensor, n: int):
        dev = slots.device
        self.src = torch.zeros(n, dtype=torch.int64, device=dev)
        self.dst = torch.arange(n, device=dev)
        self.stage = torch.empty(n, *slots.shape[1:], dtype=slots.dtype, device=dev)
        self.mids, self.nodes = [], {}  # preorder split points; (lo, hi) -> node index
        self._plan(0, host_rows.shape[0])
        mids = torch.tensor(self.mids, device=dev)
        self.right = torch.zeros(n, len(self.mids), dtype=torch.bool, device=dev)
        self.left = torch.zeros_like(self.right)
        self.graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream()
        branches = [torch.cuda.Stream() for _ in range(n)]
        with torch.cuda.graph(self.graph, stream=capture):
            self.right.copy_(self.src[:, None] >= mids[None, :])
            self.left.copy_(self.src[:, None] < mids[None, :])
            fork = torch.cuda.current_stream()
            for i, b in enumerate(branches):
                b.wait_stream(fork)
                with torch.cuda.stream(b):
                    self._tree(host_rows, i, 0, host_rows.shape[0])
            for b in branches:
                fork.wait_stream(b)
            slots.index_copy_(0, self.dst, self.stage)

    def _plan(self, lo, hi):
        if hi - lo > 1:
            mid = (lo + hi) // 2
            self.nodes[(lo, hi)] = len(self.mids)
            self.mids.append(mid)
            self._plan(lo, mid)
            self._plan(mid, hi)

    def _tree(self, host_rows, i, lo, hi):
        if hi - lo == 1:
            self.stage[i].copy_(host_rows[lo], non_blocking=True)
            return
        mid, node = (lo + hi) // 2, self.nodes[(lo, hi)]
        g = self.graph
        for pred, (a, b) in ((self.left[i, node], (lo, mid)), (self.right[i, node], (mid, hi))):
            g.begin_capture_to_if_node(pred)
            self._tree(host_rows, i, a, b)
            g.end_capture_to_conditional_node()

    def __call__(self, src: torch.Tensor) -> None:
        self.src.copy_(src, non_blocking=True)
        self.graph.replay()


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
        choices=["kernel", "unrolled", "engine", "tma", "conditional"],
        help="conditional: its capture may leave the process unusable where the driver refuses it; run it alone",
    )
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

        def kernel(i, programs=None, src_dev=src_dev, dst=dst, count=count):
            gc.gather_copy_triton(view, slots, src_dev[i], dst, count, programs)

        variants = {}
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
        if "tma" in args.paths:
            for stages in (2, 4):
                for cap in (None, 32, 132):
                    name = f"tma stages={stages} programs={cap or 'full'}"
                    variants[name] = lambda i, st=stages, c=cap, s=src_dev, d=dst, k=count: tma(
                        view, slots, s[i], d, k, st, c
                    )
        if "conditional" in args.paths:
            for source, rows_from in (("UVA view", view), ("pinned tensor", host)):
                try:
                    c = ConditionalCopy(rows_from, slots, n)
                    variants[f"conditional copy engine ({source})"] = lambda i, s=src_dev, c=c: c(s[i])
                except Exception as e:  # noqa: BLE001 -- report what the driver or torch refused, then go on
                    print(f"conditional copy from the {source}: not captured: {type(e).__name__}: {e}", flush=True)
        compute = gemv_graph(3 * n * 0.25)
        compute_alone = timed(lambda i, g=compute: g.replay(), 5, None)
        for name, fn in variants.items():
            fn(args.reps)  # warm-up / compile
            torch.cuda.synchronize()
            for where, beside in (("alone", None), ("beside compute", compute)):
                ms = timed(fn, args.reps, beside)
                gbs = n * expert_mb / 1e3 / (ms / 1e3)
                rows.append({"experts": n, "variant": name, "where": where, "ms": ms, "GB_per_s": gbs})
                print(f"{n:>3} experts  {name:<48} {where:<15} {ms:8.3f} ms  {gbs:6.1f} GB/s", flush=True)
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
