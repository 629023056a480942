"""The fp8 decode GEMV kernel against its plain-torch reference, and its custom op."""

import os

import pytest
import torch

from asyncmoe.compute import ops
from asyncmoe.compute.fp8_gemv import fp8_gemv_reference, fp8_gemv_triton
from asyncmoe.formats import quantize_fp8


def devices():
    out = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out


def case(transposed: bool, block, C=5, N=72, K=100, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn((C, K, N) if transposed else (C, N, K), generator=g)
    q, s = quantize_fp8(dense, block)
    x = torch.randn(S, K, generator=g)
    slots = torch.tensor([0, 3, 4, -1, 2, 1, 3][:S])
    return x, q, s, slots


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transposed", [False, True])
# a scale block dividing a step, one holding whole steps, and one neither (a scale a weight)
@pytest.mark.parametrize("block", [(128, 128), (16, 32), (32, 16), (512, 512), (24, 24)])
def test_kernel_matches_reference(device, transposed, block):
    x, q, s, slots = (t.to(device) for t in case(transposed, block))
    dtypes = [torch.float32] + (
        [torch.bfloat16] if device == "cuda" else []
    )  # the interpreter has no bf16 math
    for dtype in dtypes:
        want = fp8_gemv_reference(x.to(dtype), q, s, slots, block, transposed)
        got = fp8_gemv_triton(x.to(dtype), q, s, slots, block, transposed)
        assert got.dtype == dtype and got.shape == (7, 72)
        # only the order of the float32 sums differs; bf16 output rounds once more
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got, want, **tol)


def test_reference_is_the_dequantized_matmul():
    x, q, s, slots = case(False, (16, 32))
    from asyncmoe.formats import dequantize_fp8

    w = dequantize_fp8(q, s, (16, 32), torch.float32)  # [C, N, K]
    want = torch.stack([w[max(int(i), 0)] @ x[j] for j, i in enumerate(slots)])
    torch.testing.assert_close(fp8_gemv_reference(x, q, s, slots, (16, 32), False), want)


def test_op_passes_opcheck():
    x, q, s, slots = case(False, (16, 32))
    torch.library.opcheck(
        torch.ops.asyncmoe.fp8_gemv.default, (x, q.view(torch.uint8), s, slots, 16, 32, False)
    )
    x, q, s, slots = case(True, (32, 16))
    torch.library.opcheck(
        torch.ops.asyncmoe.fp8_gemv.default, (x, q.view(torch.uint8), s, slots, 32, 16, True)
    )


def test_fake_states_the_contract():
    x, q, s, slots = case(False, (16, 32))
    mode = torch._subclasses.FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x, q, s[:, :1].contiguous(), slots)]
    with mode, pytest.raises(Exception, match="do not tile weights"):
        ops.fp8_matmul(*fakes, (16, 32), False)
