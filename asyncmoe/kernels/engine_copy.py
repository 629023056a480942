"""Copy whole experts host -> slots with the copy engine, though only the device knows which: the device posts the
copies, a host thread issues them. Same contract as `gather_copy`: `slots[dst[i]] = host[src[i]]` for i < count.

The copy engine moves host memory at the link's speed; the gather-copy kernel's own reads over PCIe reach ~90% of
it (docs/decisions.md#copies-at-the-links-speed). But the copy engine takes its addresses from the host, and in a
captured step the host never learns which experts move. So each call posts its pairs, and a thread in C
(`engine_copy.c`: no GIL, so a busy Python main thread cannot hold it up) polls for posts and issues them:

    the call's stream                          proxy thread                    its copy stream
    _post: pairs -> row, number -> posted      sees posted != served,
                                               cuMemcpyAsync per tensor  ->    copies; done = number
    _wait: spins until done == number
    ... the compute that reads the slots

One call with nothing to copy posts nothing and does not wait. A channel is one cache's requests of one kind
(its misses, or the prefetches into it), with its row in pinned memory and its `seq`, `done` in device memory;
a channel has at most one request outstanding, as its stream waits for `done` before it posts again. The thread
polls flat out for `SPIN_NS` after its last request (one CPU core, while a model runs), then naps `NAP_NS` at a
time. A wait that outlasts `TIMEOUT_NS` traps: the thread is gone or a copy failed (`error()` says which driver
error), and the slots would be wrong, so the next CUDA call raises rather than a forward returning garbage.

Dims: C slots, M planned copies (at most C).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import weakref
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux
    triton = None

SPIN_NS = 20_000_000
NAP_NS = 200_000
TIMEOUT_NS = 5_000_000_000
MAX_CHANNELS = 4096  # as in engine_copy.c
KINDS = ("miss", "prefetch")  # a cache's two channels; each kind has its own copy stream on a device

_SOURCE = Path(__file__).with_suffix(".c")
_P, _I32, _I64, _U64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_DRIVER = ("cuMemcpyAsync", "cuStreamWriteValue32_v2", "cuCtxSetCurrent", "cuThreadExchangeStreamCaptureMode")


@functools.cache
def _library() -> ctypes.CDLL:
    """engine_copy.c, built once per version of its source into the user's cache directory."""
    source = _SOURCE.read_bytes()
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncmoe"
    so = cache_dir / f"engine_copy-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not so.exists():
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
        if cc is None:
            raise RuntimeError(
                "asyncmoe's copy-engine path builds a small C library and found no C compiler (Triton needs one "
                "too): install gcc or clang, set CC, or pass copies='kernel' to asyncmoe.compile"
            )
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        built = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-pthread", str(_SOURCE), "-o", str(tmp)], capture_output=True, text=True
        )
        if built.returncode != 0:
            raise RuntimeError(f"building {_SOURCE.name} with {cc} failed:\n{built.stderr}")
        os.replace(tmp, so)  # atomic: a process that loads it meanwhile sees all of it or none
    lib = ctypes.CDLL(str(so))
    lib.engine_copy_start.argtypes, lib.engine_copy_start.restype = [_P, _P, ctypes.POINTER(_P), _I64, _I64], _P
    lib.engine_copy_add.argtypes = [_P, _P, _I32, _I32, ctypes.POINTER(_U64), ctypes.POINTER(_U64)]
    lib.engine_copy_add.argtypes += [ctypes.POINTER(_U64), _P, _U64]
    lib.engine_copy_add.restype = _I32
    lib.engine_copy_remove.argtypes, lib.engine_copy_remove.restype = [_P, _I32], None
    lib.engine_copy_error.argtypes, lib.engine_copy_error.restype = [_P], _I32
    lib.engine_copy_stop.argtypes, lib.engine_copy_stop.restype = [_P], _I32
    return lib


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")  # loaded by the process already; this returns its handle


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


_CU_POINTER_ATTRIBUTE_HOST_POINTER = 4  # CUpointer_attribute in cuda.h


def _copy_address(t: torch.Tensor) -> int:
    """The address the copy engine takes for `t`: the host address of a UVA view of pinned memory (whose device
    alias need not equal it), else `t`'s own (GPU memory)."""
    host = ctypes.c_uint64()
    rc = _driver().cuPointerGetAttribute(
        ctypes.byref(host), ctypes.c_int(_CU_POINTER_ATTRIBUTE_HOST_POINTER), ctypes.c_uint64(t.data_ptr())
    )
    return host.value if rc == 0 else t.data_ptr()


class _Proxy:
    """A device's thread, its `posted` words [MAX_CHANNELS] in pinned memory and a copy stream per kind."""

    def __init__(self, device: torch.device):
        lib, driver = _library(), _driver()
        self.posted = torch.zeros(MAX_CHANNELS, dtype=torch.int32, pin_memory=True)
        self.streams = {kind: torch.cuda.Stream(device) for kind in KINDS}
        context = ctypes.c_void_p()
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # the primary context exists and is current
            _check(driver.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        fns = (_P * len(_DRIVER))(*(ctypes.cast(getattr(driver, name), _P) for name in _DRIVER))
        self.handle = lib.engine_copy_start(self.posted.data_ptr(), context, fns, SPIN_NS, NAP_NS)
        if not self.handle:
            raise RuntimeError("could not start asyncmoe's copy-engine thread")

    def remove(self, index: int) -> None:
        if self.handle:  # else stopped already, at exit
            _library().engine_copy_remove(self.handle, index)

    def stop(self) -> int:
        handle, self.handle = self.handle, None
        return _library().engine_copy_stop(handle) if handle else 0


_PROXIES: dict[int, _Proxy] = {}


def _proxy(device: torch.device) -> _Proxy:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROXIES:
        _PROXIES[index] = _Proxy(torch.device("cuda", index))
    return _PROXIES[index]


@atexit.register
def _stop_all() -> None:
    # before CUDA tears down the memory the thread reads
    for proxy in _PROXIES.values():
        proxy.stop()


def error(device: torch.device) -> int:
    """The first driver error the device's copy thread met (a CUresult), 0 if none."""
    proxy = _PROXIES.get(device.index if device.index is not None else torch.cuda.current_device())
    return _library().engine_copy_error(proxy.handle) if proxy and proxy.handle else 0


CHANNELS: weakref.WeakValueDictionary[tuple[int, str], Channel] = weakref.WeakValueDictionary()


def channel(slots: list[torch.Tensor], kind: str) -> Channel | None:
    """The channel of `kind` of the cache whose first slot tensor is `slots[0]`, if it copies by the engine."""
    return CHANNELS.get((slots[0].data_ptr(), kind)) if slots and slots[0].is_cuda else None


class Channel:
    """One cache's copies of one kind, through its device's thread; removed from the thread when collected."""

    def __init__(self, hosts: list[torch.Tensor], slots: list[torch.Tensor], kind: str):
        if not 1 <= len(slots) <= 8:
            raise ValueError(f"a channel copies 1 to 8 tensors an expert, got {len(slots)}")
        device = slots[0].device
        proxy = _proxy(device)
        self.planned = slots[0].shape[0]  # M <= C: no call copies more experts than there are slots
        self.row = torch.zeros(1 + 2 * self.planned, dtype=torch.int32, pin_memory=True)
        self.seq_done = torch.zeros(2, dtype=torch.int32, device=device)
        array = _U64 * len(slots)
        index = _library().engine_copy_add(
            proxy.handle,
            self.row.data_ptr(),
            self.planned,
            len(slots),
            array(*(_copy_address(h) for h in hosts)),
            array(*(s.data_ptr() for s in slots)),
            array(*(s[0].numel() * s.element_size() for s in slots)),
            proxy.streams[kind].cuda_stream,
            self.seq_done.data_ptr() + 4,
        )
        if index < 0:
            raise RuntimeError(f"asyncmoe's copy thread serves at most {MAX_CHANNELS} channels (two a cache)")
        self.posted = proxy.posted[index:]
        CHANNELS[(slots[0].data_ptr(), kind)] = self
        weakref.finalize(self, proxy.remove, index)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor) -> None:
        """`slots[dst[i]] = hosts[src[i]]` for i < count, ordered on the current stream like a kernel."""
        M = src.numel()
        _post[(1,)](self.row, self.posted, self.seq_done, src, dst, count, M, self.planned, triton.next_power_of_2(M))
        _wait[(1,)](self.seq_done, TIMEOUT_NS, num_warps=1)


if triton is not None:
    from .clock import now

    @triton.jit
    def _post(row_ptr, posted_ptr, seq_done_ptr, src_ptr, dst_ptr, count_ptr, M, PLANNED, BM: tl.constexpr):
        """row = [count, src[0:PLANNED], dst[0:PLANNED]]; then, fenced at system scope after every thread's stores,
        seq += 1 and posted = seq. Nothing when count is 0: `done` already equals `seq`."""
        count = tl.load(count_ptr).to(tl.int32)
        if count > 0:
            i = tl.arange(0, BM)
            tl.store(row_ptr + 1 + i, tl.load(src_ptr + i, mask=i < M).to(tl.int32), mask=i < M)
            tl.store(row_ptr + 1 + PLANNED + i, tl.load(dst_ptr + i, mask=i < M).to(tl.int32), mask=i < M)
            tl.store(row_ptr, count)
            s = tl.load(seq_done_ptr) + 1
            tl.store(seq_done_ptr, s)
            fenced = tl.inline_asm_elementwise("fence.sc.sys;\n mov.b32 $0, $1;", "=r,r", [i], tl.int32, False, 1)
            tl.debug_barrier()
            tl.store(posted_ptr + tl.min(fenced, 0) * 0, s)

    @triton.jit
    def _wait(seq_done_ptr, timeout_ns):
        """Spin until done == seq; trap after `timeout_ns` (the thread did not answer)."""
        s = tl.load(seq_done_ptr)
        start = now()
        waiting = tl.load(seq_done_ptr + 1, volatile=True) != s
        while waiting:
            waiting = tl.load(seq_done_ptr + 1, volatile=True) != s
            if waiting & (now() - start > timeout_ns):
                tl.inline_asm_elementwise("trap;\n mov.b32 $0, 0;", "=r", [], tl.int32, False, 1)
