"""Copy device-chosen experts with the copy engine, issued by a host thread that a captured graph signals.

A measured alternative to the gather-copy kernel (`python proxy_copy.py`: a decode step's sequence of small
calls, against the kernel and host-issued copies in the same run). The copy engine needs addresses the host
knows; in a captured step only the device knows which experts move. Here the graph tells a host thread:

    graph (any stream)                      proxy thread                     copy stream
    _post: request row -> pinned memory
    wake the thread                  ->     reads the row,
                                            issues cuMemcpyAsync       ->    copies; done = seq
    _wait: spins until done == seq
    ... work that reads the slots

Two ways to wake it (`wake`):
- "doorbell": a host node that is libc's `sem_post` itself (no Python, no GIL, no CUDA call in the driver's
  callback thread); the thread blocks in `sem_wait` with the GIL released. The row is complete when the host node
  runs: it follows `_post`'s completion.
- "poll": no host node. `_post` fences its row at system scope, then writes the request's number to pinned memory;
  the thread polls that number, yielding the GIL between reads (`os.sched_yield`), so it costs a CPU core.
Either way nothing stays queued on any stream between steps (a pending stream wait would hang every
`torch.cuda.synchronize()`). The spin gives up after `TIMEOUT_NS` and sets `stalled`, so a dead thread is an
error, not a hang. Dims: E experts, C slots, M planned copies (rows).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch
import triton
import triton.language as tl
from switch_copy import check, driver
from triton.language.extra.cuda import globaltimer

TIMEOUT_NS = 2_000_000_000

_P, _U32, _SIZE = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t
_SIGNATURES = {
    "cuCtxSetCurrent": [_P],
    "cuCtxGetCurrent": [_P],
    "cuLaunchHostFunc": [_P, _P, _P],
    "cuStreamWriteValue32_v2": [_P, ctypes.c_uint64, _U32, ctypes.c_uint],
    "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, _SIZE, _P],
    "cuThreadExchangeStreamCaptureMode": [_P],
}
_CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: this thread's calls never break another thread's capture
_SEM_BYTES = 32  # sizeof(sem_t), glibc x86-64 and aarch64


@functools.cache
def _driver() -> ctypes.CDLL:
    return driver(_SIGNATURES)


@functools.cache
def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL("libc.so.6", use_errno=True)
    for name in ("sem_init", "sem_wait", "sem_post"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


@triton.jit
def _post(row_ptr, seq_ptr, posted_ptr, src_ptr, dst_ptr, count_ptr, M: tl.constexpr, BM: tl.constexpr):
    """row = [count, src[0:M], dst[0:M]] in pinned memory; seq += 1 on the device, then posted = seq in pinned
    memory (read by a polling thread) once every thread's row stores are fenced at system scope."""
    i = tl.arange(0, BM)
    tl.store(row_ptr + 1 + i, tl.load(src_ptr + i, mask=i < M).to(tl.int32), mask=i < M)
    tl.store(row_ptr + 1 + M + i, tl.load(dst_ptr + i, mask=i < M).to(tl.int32), mask=i < M)
    tl.store(row_ptr, tl.load(count_ptr).to(tl.int32))
    s = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, s)
    fenced = tl.inline_asm_elementwise("fence.sc.sys;\n mov.b32 $0, $1;", "=r,r", [i], tl.int32, False, 1)
    tl.debug_barrier()
    tl.store(posted_ptr + 0 * tl.max(fenced, 0), s)


@triton.jit
def _wait(seq_ptr, done_ptr, stalled_ptr, timeout_ns):
    """Spin until the copy stream has written done == seq, or the timeout passes (then stalled = 1)."""
    s = tl.load(seq_ptr)
    start = globaltimer()
    waiting = tl.load(done_ptr, volatile=True) != s
    while waiting:
        late = (globaltimer() - start) > timeout_ns
        waiting = (tl.load(done_ptr, volatile=True) != s) & ~late
        if late:
            tl.store(stalled_ptr, 1)


class CopyProxy:
    """`slots[dst[i]] = host[src[i]]` for i < count, by the copy engine, from device-side `src`, `dst`, `count`.

    `host` is [E, ...] pinned memory, `slots` [C, ...] on the GPU; `planned` is the most pairs a call carries.
    `copy(src, dst, count)` is stream-ordered and capturable; a replayed graph posts a new request each time.
    """

    def __init__(self, host: torch.Tensor, slots: torch.Tensor, planned: int, wake: str = "doorbell"):
        if wake not in ("doorbell", "poll"):
            raise ValueError(f"wake is 'doorbell' or 'poll', not {wake!r}")
        if not host.is_pinned():
            raise ValueError("CopyProxy copies from pinned host memory: pass host.pin_memory()")
        dev = slots.device
        self.host, self.slots, self.M, self.wake = host, slots, planned, wake
        self.row = torch.zeros(1 + 2 * planned, dtype=torch.int32).pin_memory()
        self.posted = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.seq = torch.zeros(1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        self.stalled = torch.zeros(1, dtype=torch.int32, device=dev)
        self._copy = torch.cuda.Stream(dev)
        self._row, self._posted = self.row.numpy(), self.posted.numpy()
        self._bytes = host[0].numel() * host.element_size()
        self._bell = ctypes.create_string_buffer(_SEM_BYTES)
        if _libc().sem_init(self._bell, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._ring = ctypes.cast(_libc().sem_post, ctypes.c_void_p)  # the host node: sem_post(&bell)
        ctx = ctypes.c_void_p()
        with torch.cuda.device(dev):
            torch.cuda.current_stream().synchronize()  # the primary context exists and is current
            check(_driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        self._ctx = ctx
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="asyncmoe-copy-proxy", daemon=True)
        self._thread.start()

    def copy(self, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        BM = triton.next_power_of_2(self.M)
        _post[(1,)](self.row, self.seq, self.posted, src, dst, count, self.M, BM, num_warps=1)
        if self.wake == "doorbell":
            check(_driver().cuLaunchHostFunc(stream, self._ring, ctypes.addressof(self._bell)), "cuLaunchHostFunc")
        _wait[(1,)](self.seq, self.done, self.stalled, TIMEOUT_NS, num_warps=1)

    def close(self) -> None:
        """Stop the thread: ring the doorbell from the host with the stop mark set."""
        self._stop = True
        _libc().sem_post(self._bell)
        self._thread.join()

    def _serve(self) -> None:
        d, libc = _driver(), _libc()
        check(d.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        mode = ctypes.c_int(_CAPTURE_RELAXED)
        check(d.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
        copy, done = ctypes.c_void_p(self._copy.cuda_stream), self.done.data_ptr()
        host, slots, nbytes, M = self.host.data_ptr(), self.slots.data_ptr(), self._bytes, self.M
        seq = 0
        while True:
            if self.wake == "doorbell":
                while libc.sem_wait(self._bell) != 0:  # EINTR: a signal woke it, wait again
                    pass
            else:
                while self._posted[0] == seq and not self._stop:
                    os.sched_yield()  # releases the GIL
            if self._stop:
                return
            seq += 1
            n = int(self._row[0])
            for i in range(n):
                s, t = int(self._row[1 + i]), int(self._row[1 + M + i])
                check(d.cuMemcpyAsync(slots + t * nbytes, host + s * nbytes, nbytes, copy), "cuMemcpyAsync")
            check(d.cuStreamWriteValue32_v2(copy, done, seq, 0), "cuStreamWriteValue32")


def main():
    import argparse
    import json
    import statistics

    from copy_bandwidth import EXPERT_ELEMS, E, gemv_graph, host_experts

    import asyncmoe.kernels.gather_copy as gc

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=16, help="copies in a row, as a decode step's layers issue them")
    p.add_argument("--counts", type=int, nargs="+", default=[0, 1, 2, 3, 6])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    host, view = host_experts(dev)
    M = max(args.counts)
    slots = torch.empty(args.calls * M, EXPERT_ELEMS, dtype=torch.bfloat16, device=dev)
    expert_mb = EXPERT_ELEMS * 2 / 1e6
    proxies = {wake: CopyProxy(host, slots, M, wake) for wake in ("doorbell", "poll")}
    compute_stream = torch.cuda.Stream()

    def stalled():
        for wake, proxy in proxies.items():
            if proxy.stalled.item():
                raise RuntimeError(f"the copy proxy ({wake}) stalled: its thread did not answer")

    rows = []
    try:
        for n in args.counts:
            # call c copies n experts into its own slots; the experts change before every replay
            src = torch.zeros(args.calls, M, dtype=torch.int64, device=dev)
            dst = torch.arange(args.calls * M, device=dev).view(args.calls, M)
            count = torch.full((args.calls, 1), n, dtype=torch.int64, device=dev)
            compute = gemv_graph(args.calls * 0.3 * max(n, 1))  # outlasts the copies

            def kernel(c, src=src, dst=dst, count=count):
                gc.gather_copy_triton([view], [slots], src[c], dst[c], count[c])

            def by_proxy(wake, src=src, dst=dst, count=count):
                return lambda c: proxies[wake].copy(src[c], dst[c], count[c])

            def captured(one):
                for c in range(args.calls):
                    one(c)  # compile and warm up, eagerly
                torch.cuda.synchronize()
                stalled()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                    for c in range(args.calls):
                        one(c)
                return graph.replay

            known = []  # the experts as the host knows them, read before the timed copies

            def host_issued(known=known):
                for c, experts in enumerate(known):
                    for i, e in enumerate(experts):
                        slots[c * M + i].copy_(host[e], non_blocking=True)

            paths = {
                "kernel, graph": captured(kernel),
                "copy engine by proxy (doorbell), graph": captured(by_proxy("doorbell")),
                "copy engine by proxy (polling), graph": captured(by_proxy("poll")),
                "copy engine, host-issued": host_issued,
            }
            for name, run in paths.items():
                for where in ("alone", "beside compute"):
                    times = []
                    for _ in range(args.reps):
                        src.copy_(torch.stack([torch.randperm(E, device=dev)[:M] for _ in range(args.calls)]))
                        known[:] = src[:, :n].tolist()
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda.synchronize()
                        if where == "beside compute":
                            with torch.cuda.stream(compute_stream):
                                compute.replay()
                        a.record()
                        run()
                        b.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(b))
                    stalled()
                    used = dst[:, :n].reshape(-1)
                    ok = torch.equal(slots[used].cpu(), host.index_select(0, src[:, :n].reshape(-1).cpu()))
                    slots.zero_()
                    ms = statistics.median(times)
                    gbs = args.calls * n * expert_mb / 1e3 / (ms / 1e3)
                    rows.append(
                        {
                            "experts": n,
                            "calls": args.calls,
                            "path": name,
                            "where": where,
                            "ms": ms,
                            "GB_per_s": gbs,
                            "correct": ok,
                        }
                    )
                    print(
                        f"{n} experts x {args.calls} calls  {name:<40} {where:<15} {ms:8.3f} ms  {gbs:6.1f} GB/s"
                        f"  {'ok' if ok else 'WRONG BYTES'}",
                        flush=True,
                    )
    finally:
        for proxy in proxies.values():
            proxy.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "expert_MB": expert_mb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
