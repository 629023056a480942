"""The host store (cache/host.py): the memory check, the aligned layout, and on a GPU the pinned block, its
UVA view, and a model collected while a CUDA graph is captured."""

import gc

import pytest
import torch

import asyncmoe
from asyncmoe.cache import host
from asyncmoe.cache.host import (
    ALIGN,
    PinnedBlock,
    aligned,
    block_bytes,
    carve,
    check_host_memory,
    human_bytes,
    uva_view,
)

from models import TOP_K, tiny

SPECS = [
    (torch.Size([5, 3, 8]), torch.bfloat16),
    (torch.Size([5, 7]), torch.float32),
    (torch.Size([3]), torch.int8),
]


def test_check_host_memory_says_what_is_needed_and_what_is_there(monkeypatch):
    monkeypatch.setattr(host, "available_host_bytes", lambda: 1000)
    check_host_memory(1000, "fits")
    with pytest.raises(
        MemoryError,
        match=r"pinning the experts: needs 1.95 KiB of host memory but only 1000 B is "
        r"available \(MemAvailable in /proc/meminfo\).*offload fewer layers",
    ):
        check_host_memory(2000, "pinning the experts")


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 3 * 2**20, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "3.00 MiB",
        "5120.00 GiB",
    ]
    assert host.available_host_bytes() > 0


def test_carve_lays_tensors_out_aligned_back_to_back():
    sizes = [5 * 3 * 8 * 2, 5 * 7 * 4, 3]  # 240, 140, 3 bytes
    assert (
        [aligned(n) for n in sizes] == [256, 256, 256]
        and aligned(0) == 0
        and aligned(ALIGN + 1) == 2 * ALIGN
    )
    assert block_bytes(SPECS) == 3 * ALIGN
    flat = torch.zeros(block_bytes(SPECS), dtype=torch.uint8)
    views = carve(flat, SPECS)
    assert [(v.shape, v.dtype) for v in views] == SPECS
    assert [v.data_ptr() - flat.data_ptr() for v in views] == [
        0,
        ALIGN,
        2 * ALIGN,
    ]  # each aligned, none overlapping
    views[1].fill_(1.0)
    assert flat[ALIGN : ALIGN + 140].view(torch.float32).eq(1).all() and flat[:ALIGN].eq(0).all()


@pytest.mark.cuda
def test_pinned_block_and_uva_view():
    specs = [(torch.Size([5, 3, 8]), torch.bfloat16), (torch.Size([5, 7]), torch.float32)]
    block = PinnedBlock(4096)
    hosts = carve(block.data, specs)
    for h in hosts:
        h.copy_(torch.randn(h.shape))
    assert block.data.is_pinned()
    view = uva_view(block, torch.device("cuda"))
    assert view.is_cuda and view.numel() == 4096
    print(f"\nhost pointer {block.data.data_ptr():#x}, device pointer {view.data_ptr():#x}")
    for h, v in zip(hosts, carve(view, specs), strict=True):
        assert torch.equal(v.cpu(), h)  # torch ops read host memory through the view
        assert torch.equal(v.index_select(0, torch.tensor([4, 0], device="cuda")).cpu(), h[[4, 0]])
    del hosts, block
    assert view.sum().isfinite()  # the view keeps the registration alive


@pytest.mark.cuda
def test_a_model_collected_during_graph_capture_does_not_break_it():
    """Python's GC may free a dead asyncmoe model mid-capture; unpinning then would invalidate the capture."""
    model = asyncmoe.compile(tiny("olmoe", device="cuda"), cache=TOP_K)
    cycle = [model]
    cycle.append(cycle)  # only the cyclic GC can free it, whenever it happens to run
    del model, cycle
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        gc.collect()  # frees the model's pinned blocks inside the capture
        assert host._deferred  # their unpinning waits
    graph.replay()
    assert torch.equal(y, torch.full_like(x, 2))
    block = PinnedBlock(4096)  # the first pinning after the capture unpins the dead blocks
    assert not host._deferred and block.registered
