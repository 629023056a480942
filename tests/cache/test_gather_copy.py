"""The Triton gather-copy kernel (kernels/gather_copy.py) against its plain-torch reference: on the CPU under
TRITON_INTERPRET=1, on the GPU for real."""

import pytest
import torch

from asyncmoe.cache.gather_copy import gather_copy_reference, gather_copy_triton

from devices import devices

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def case(dtype, device, E=7, C=5, M=4, row=(3, 33), seed=0):
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(E, *row, generator=g).to(dtype)
    slots = torch.randn(C, *row, generator=g).to(dtype)
    src = torch.randperm(E, generator=g)[:M]
    dst = torch.randperm(C, generator=g)[:M]
    return host.to(device), slots.to(device), src.to(device), dst.to(device)


def bits(t):
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [0, 1, 4])  # none, some, the static maximum M
def test_kernel_matches_reference(device, dtype, count):
    host, slots, src, dst = case(dtype, device)
    ours, ref = slots.clone(), slots.clone()
    n = torch.tensor(count, device=device)
    gather_copy_triton([host], [ours], src, dst, n)
    gather_copy_reference(host, ref, src, dst, n)
    assert torch.equal(bits(ours), bits(ref))
    assert torch.equal(bits(ref[dst[:count]]), bits(host[src[:count]]))
    untouched = torch.ones(slots.shape[0], dtype=torch.bool, device=device)
    untouched[dst[:count]] = False
    assert torch.equal(bits(ref[untouched]), bits(slots[untouched]))


@pytest.mark.parametrize("device", devices())
def test_odd_row_sizes_use_narrow_words(device):
    for row in [(1,), (3,), (5, 3)]:  # 1, 3, 15 bytes per fp8 row: no 2/4/8-byte word tiles them
        host, slots, src, dst = case(torch.float8_e4m3fn, device, row=row, seed=len(row))
        ours, ref = slots.clone(), slots.clone()
        n = torch.tensor(3, device=device)
        gather_copy_triton([host], [ours], src, dst, n)
        gather_copy_reference(host, ref, src, dst, n)
        assert torch.equal(bits(ours), bits(ref))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "programs", [1, 3, None]
)  # one program does all, a few stride, one per block
def test_capped_grid_copies_every_block(device, programs):
    """Rows of 80 KB span three 32 KB blocks (the last partial); a capped grid hands them out grid-stride."""
    host, slots, src, dst = case(torch.float32, device, row=(5, 4000), seed=3)
    ours, ref = slots.clone(), slots.clone()
    n = torch.tensor(3, device=device)
    gather_copy_triton([host], [ours], src, dst, n, programs)
    gather_copy_reference(host, ref, src, dst, n)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("programs", [2, None])
def test_one_launch_copies_every_tensor_of_the_experts(device, programs):
    """Five tensors of the same experts, of other dtypes and row sizes (one of 80 KB rows: three blocks): the
    first four in one launch, the fifth in a second; each equals the reference's copy."""
    shapes = [(torch.bfloat16, (3, 33)), (torch.float8_e4m3fn, (5, 3)), (torch.float32, (5, 4000)),
              (torch.uint8, (7,)), (torch.float16, (2, 2))]  # fmt: skip
    tensors = [case(dtype, device, row=row, seed=i) for i, (dtype, row) in enumerate(shapes)]
    src, dst = tensors[0][2], tensors[0][3]  # the same pairs for every tensor
    hosts = [t[0] for t in tensors]
    ours = [t[1].clone() for t in tensors]
    n = torch.tensor(3, device=device)
    gather_copy_triton(hosts, ours, src, dst, n, programs)
    for host, slots, got in zip(hosts, [t[1] for t in tensors], ours):
        want = slots.clone()
        gather_copy_reference(host, want, src, dst, n)
        assert torch.equal(bits(got), bits(want))
