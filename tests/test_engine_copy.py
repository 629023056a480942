"""kernels/engine_copy: the copy thread's protocol on the CPU (the C library with stand-in driver calls), and on
CUDA the copies themselves against the gather-copy reference, eager and replayed in a graph."""

import ctypes
import shutil
import time

import pytest
import torch

from asyncmoe.kernels import engine_copy
from asyncmoe.kernels.gather_copy import gather_copy_reference

needs_cc = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("gcc", "clang", "cc")), reason="builds engine_copy.c: needs a C compiler"
)
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
_WRITE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_MODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class FakeDriver:
    """The four driver calls the thread makes, in host memory: a copy is a memmove, `done` an int32 store."""

    def __init__(self, fail_copies: int = 0):
        self.calls, self.fail = [], fail_copies
        self.fns = [_MEMCPY(self.memcpy), _WRITE(self.write), _SET(lambda ctx: 0), _MODE(lambda mode: 0)]

    def memcpy(self, dst, src, n, stream):
        if self.fail:
            return self.fail
        ctypes.memmove(dst, src, n)
        self.calls.append(("copy", n))
        return 0

    def write(self, stream, addr, value, flags):
        ctypes.c_int32.from_address(addr).value = value
        self.calls.append(("done", value))
        return 0

    def pointers(self):
        return (ctypes.c_void_p * 4)(*(ctypes.cast(f, ctypes.c_void_p) for f in self.fns))


class Host:
    """A proxy over stand-in calls, with one channel: tensors `host` [E, ...] and `slots` [C, ...] per expert tensor."""

    def __init__(self, driver, hosts, slots):
        self.lib = engine_copy._library()
        self.posted = torch.zeros(engine_copy.MAX_CHANNELS, dtype=torch.int32)
        self.handle = self.lib.engine_copy_start(self.posted.data_ptr(), None, driver.pointers(), 10**9, 10**5)
        self.C = slots[0].shape[0]
        self.row = torch.zeros(1 + 2 * self.C, dtype=torch.int32)
        self.done = torch.zeros(1, dtype=torch.int32)
        self.hosts, self.slots = hosts, slots
        self.channel = self.add()

    def add(self):
        array = ctypes.c_uint64 * len(self.slots)
        return self.lib.engine_copy_add(
            self.handle,
            self.row.data_ptr(),
            self.C,
            len(self.slots),
            array(*(h.data_ptr() for h in self.hosts)),
            array(*(s.data_ptr() for s in self.slots)),
            array(*(s[0].numel() * s.element_size() for s in self.slots)),
            None,
            self.done.data_ptr(),
        )

    def post(self, number, src, dst):
        self.row[0] = len(src)
        self.row[1 : 1 + len(src)] = torch.tensor(src, dtype=torch.int32)
        self.row[1 + self.C : 1 + self.C + len(dst)] = torch.tensor(dst, dtype=torch.int32)
        self.posted[self.channel] = number

    def wait(self, number, timeout=5.0):
        end = time.monotonic() + timeout
        while int(self.done[0]) != number:
            assert time.monotonic() < end, f"the thread did not answer request {number}"
            time.sleep(1e-4)

    def stop(self):
        return self.lib.engine_copy_stop(self.handle)


@needs_cc
def test_thread_copies_each_posted_request_into_its_slots():
    E, C = 6, 3
    hosts = [torch.arange(E * 10, dtype=torch.float32).view(E, 10), torch.randn(E, 2, 3).to(torch.bfloat16)]
    slots = [torch.zeros(C, 10), torch.zeros(C, 2, 3, dtype=torch.bfloat16)]
    driver = FakeDriver()
    h = Host(driver, hosts, slots)
    try:
        expected = [s.clone() for s in slots]
        for number, (src, dst) in enumerate([([4, 1], [2, 0]), ([5], [1]), ([0, 3, 2], [0, 1, 2])], start=1):
            h.post(number, src, dst)
            h.wait(number)
            n = torch.tensor([len(src)])
            for host, e in zip(hosts, expected):
                gather_copy_reference(host, e, torch.tensor(src), torch.tensor(dst), n)
            for s, e in zip(slots, expected):
                assert torch.equal(s, e)
        copies = [c for c in driver.calls if c[0] == "copy"]
        assert len(copies) == 2 * (2 + 1 + 3)  # a copy per tensor per expert, nothing more
        assert [c for c in driver.calls if c[0] == "done"] == [("done", 1), ("done", 2), ("done", 3)]
    finally:
        assert h.stop() == 0


@needs_cc
def test_failed_copy_is_recorded_and_never_marked_done():
    hosts, slots = [torch.ones(4, 8)], [torch.zeros(2, 8)]
    h = Host(FakeDriver(fail_copies=700), hosts, slots)
    h.post(1, [3], [1])
    end = time.monotonic() + 5
    while h.lib.engine_copy_error(h.handle) == 0:
        assert time.monotonic() < end, "the failed copy was not recorded"
        time.sleep(1e-4)
    assert h.lib.engine_copy_error(h.handle) == 700
    time.sleep(0.01)
    assert int(h.done[0]) == 0  # the device's wait times out and traps instead of reading unwritten slots
    assert h.stop() == 700


@needs_cc
def test_removed_channel_is_not_served_and_its_index_is_reused_fresh():
    hosts, slots = [torch.arange(8.0).view(4, 2)], [torch.zeros(2, 2)]
    h = Host(FakeDriver(), hosts, slots)
    try:
        h.post(1, [2], [0])
        h.wait(1)
        h.lib.engine_copy_remove(h.handle, h.channel)
        h.post(2, [3], [1])
        time.sleep(0.01)
        assert int(h.done[0]) == 1 and torch.equal(slots[0][1], torch.zeros(2))
        h.done.zero_()  # a new channel's `done`, as a new cache's would be
        assert h.add() == h.channel  # the index again, its posted word zeroed: request 1 of the new channel
        assert int(h.posted[h.channel]) == 0
        h.post(1, [3], [1])
        h.wait(1)
        assert torch.equal(slots[0][1], hosts[0][3])
    finally:
        assert h.stop() == 0


def test_unknown_copies_mode_is_refused():
    from asyncmoe.cache.expert_cache import ExpertCache

    with pytest.raises(ValueError, match="copies must be one of"):
        ExpertCache({"w": torch.zeros(4, 2)}, 2, "lru", copies="dma")


def _store(E, shapes, device):
    """Pinned host experts as the device sees them (UVA views) and zeroed slots, per expert tensor."""
    from asyncmoe.cache.host import PinnedBlock, block_bytes, carve, uva_view

    specs = [((E, *s), d) for s, d in shapes]
    block = PinnedBlock(block_bytes(specs))
    for t in carve(block.data, specs):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return block, carve(uva_view(block, device), specs)


@cuda
@needs_cuda
def test_engine_copies_equal_the_reference_eager_and_in_a_graph():
    dev = torch.device("cuda")
    E, C = 16, 6
    shapes = [((64, 96), torch.bfloat16), ((33,), torch.float32), ((5, 7), torch.float8_e4m3fn)]
    block, hosts = _store(E, shapes, dev)
    slots = [torch.zeros(C, *s, dtype=d, device=dev) for s, d in shapes]
    miss, prefetch = (engine_copy.Channel(hosts, slots, kind) for kind in engine_copy.KINDS)
    expected = [s.cpu() for s in slots]
    host_cpu = [h.cpu() for h in hosts]
    g = torch.Generator().manual_seed(0)
    src = torch.zeros(C, dtype=torch.int64, device=dev)
    dst = torch.zeros(C, dtype=torch.int64, device=dev)
    count = torch.zeros(1, dtype=torch.int64, device=dev)

    def step(channel, eager_count):
        s, d = torch.randperm(E, generator=g)[:C], torch.randperm(C, generator=g)
        n = torch.tensor([eager_count])
        src.copy_(s), dst.copy_(d), count.copy_(n)
        for host, e in zip(host_cpu, expected):
            gather_copy_reference(host, e, s, d, n)
        return channel

    for i, n in enumerate([3, 0, C, 1]):  # eager, both channels, nothing to copy included
        step(miss if i % 2 else prefetch, n).copy(src, dst, count)
        torch.cuda.synchronize()
        assert all(torch.equal(s.cpu().view(torch.uint8), e.view(torch.uint8)) for s, e in zip(slots, expected))

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        miss.copy(src, dst, count)
    for n in [2, 5, 0, C]:  # new routing every replay: the host never learns it
        step(miss, n)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(s.cpu().view(torch.uint8), e.view(torch.uint8)) for s, e in zip(slots, expected))
    assert engine_copy.error(dev) == 0
    del block
