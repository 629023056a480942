"""The dense decode GEMV kernel against its plain-torch reference, and its custom op."""

import pytest
import torch

from asyncmoe.compute.slot_gemv import slot_gemv_reference, slot_gemv_triton

from devices import devices


def case(C=5, N=72, K=300, S=7, seed=0):
    """N and K not multiples of the kernel's blocks; one pair of another wave (-1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C, N, K, generator=g)
    x = torch.randn(S, K, generator=g)
    slots = torch.tensor([0, 3, 4, -1, 2, 1, 3][:S])
    return x, w, slots


@pytest.mark.parametrize("device", devices())
def test_kernel_matches_reference(device):
    x, w, slots = (t.to(device) for t in case())
    dtypes = [torch.float32] + (
        [torch.bfloat16] if device == "cuda" else []
    )  # the interpreter has no bf16 math
    for dtype in dtypes:
        want = slot_gemv_reference(x.to(dtype), w.to(dtype), slots)
        got = slot_gemv_triton(x.to(dtype), w.to(dtype), slots)
        assert got.dtype == dtype and got.shape == (7, 72)
        # only the order of the float32 sums differs; bf16 output rounds once more
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(
            got[3], torch.zeros_like(got[3])
        )  # another wave's pair: zeros, nothing read


def test_reference_is_each_pairs_matmul():
    x, w, slots = case()
    x64, w64 = x.double(), w.double()
    rows = [w64[s] @ x64[j] if s >= 0 else x64.new_zeros(72) for j, s in enumerate(slots)]
    got = slot_gemv_reference(x, w, slots).double()
    torch.testing.assert_close(
        got, torch.stack(rows), atol=1e-4, rtol=1e-4
    )  # float32 sums against float64


def test_op_passes_opcheck():
    x, w, slots = case()
    torch.library.opcheck(torch.ops.asyncmoe.slot_gemv.default, (x, w, slots))


def test_fake_states_the_contract():
    x, w, slots = case()
    mode = torch._subclasses.FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x[:, :10].contiguous(), w, slots)]
    with mode, pytest.raises(Exception, match="take another number"):
        torch.ops.asyncmoe.slot_gemv(*fakes)


@pytest.mark.cuda
def test_bf16_outputs_are_the_exact_sums_rounded():
    """float32 sums over 2048 inputs, rounded to nearest once: the bf16 outputs are the float64 products rounded
    to bf16, as torch's own bf16 matmul's are (a truncating cast or bf16 partial sums would miss most of them)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(8, 512, 2048, device="cuda", generator=g).bfloat16()
    x = torch.randn(32, 2048, device="cuda", generator=g).bfloat16()
    slots = torch.randint(0, 8, (32,), device="cuda", generator=g)
    exact = torch.bmm(w[slots].double(), x.double().unsqueeze(-1)).squeeze(-1).bfloat16()
    got = slot_gemv_triton(x, w, slots)
    assert (got != exact).float().mean() < 0.005
