"""The 4-bit decode GEMV kernel (mxfp4, int4) against its plain-torch reference, and its custom op."""

import pytest
import torch

from asyncmoe.compute.gemv4 import gemv4_reference, gemv4_triton
from asyncmoe.formats import Int4, Mxfp4

from devices import devices

FORMATS = [Mxfp4(), Int4(32), Int4(128)]


def case(fmt, C=5, N=40, K=384, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed, scales = fmt.quantize(torch.randn(C, N, K, generator=g), transposed=False)
    return torch.randn(S, K, generator=g), packed, scales, torch.tensor([0, 3, 4, -1, 2, 1, 3][:S])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{f.group}")
def test_kernel_matches_reference(device, fmt):
    x, packed, scales, slots = (t.to(device) for t in case(fmt))
    for dtype in [torch.float32] + (
        [torch.bfloat16] if device == "cuda" else []
    ):  # no bf16 in the interpreter
        want = gemv4_reference(x.to(dtype), packed, scales, slots, fmt.name)
        got = gemv4_triton(x.to(dtype), packed, scales, slots, fmt.name)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{f.group}")
def test_reference_is_the_dequantized_matmul(fmt):
    x, packed, scales, slots = case(fmt)
    w = fmt.dequantize([packed, scales], torch.float32, transposed=False)  # [C, N, K]
    want = torch.stack([w[max(int(i), 0)] @ x[j] for j, i in enumerate(slots)])
    torch.testing.assert_close(
        gemv4_reference(x, packed, scales, slots, fmt.name), want, atol=1e-4, rtol=1e-5
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{f.group}")
def test_op_passes_opcheck(fmt):
    torch.library.opcheck(torch.ops.asyncmoe.gemv4.default, (*case(fmt), fmt.name))


def test_fake_states_the_contract():
    x, packed, scales, slots = case(Int4(32))
    mode = torch._subclasses.FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x[:, :100], packed, scales, slots)]
    with mode, pytest.raises(Exception, match=r"x has 100 inputs"):
        torch.ops.asyncmoe.gemv4(*fakes, "int4")


@pytest.mark.parametrize("fmt", [Mxfp4(), Int4(32)], ids=lambda f: f.name)
def test_a_transposed_modules_weights_quantize_contiguous(fmt):
    """GPT-OSS stores [E, K, N]: its 4-bit tensors are [E, N, K/2] and [E, N, K/G] in that order, which the kernel
    reads; a strided pair is refused rather than read as if it were contiguous."""
    packed, scales = fmt.quantize(torch.randn(2, 96, 8), transposed=True)
    assert packed.is_contiguous() and scales.is_contiguous()
    x, slots = torch.randn(3, 96), torch.tensor([0, 1, 1])
    want = x[:, None, :] @ fmt.dequantize([packed, scales], torch.float32, transposed=True)[slots]
    torch.testing.assert_close(
        gemv4_triton(x, packed, scales, slots, fmt.name), want[:, 0], atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="pass contiguous tensors"):
        gemv4_triton(
            x, packed.transpose(0, 1).contiguous().transpose(0, 1), scales, slots, fmt.name
        )
