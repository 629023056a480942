"""Quantized slots to the compute dtype in one launch (fp8, mxfp4, int4) against the formats' plain-torch
definitions, and its op."""

import pytest
import torch

from asyncmoe.compute import ops
from asyncmoe.compute.dequantize import BB4, BN4, BQ8, BR8, dequantize_reference, dequantize_triton
from asyncmoe.formats import Fp8, Int4, Mxfp4

from devices import devices

# tiles that end inside a program's tile on both axes, a block not dividing the matrix (fp8), several groups a scale
FORMATS = [
    (Mxfp4(), (3, BN4 + 5, 2 * BB4 + 64)),
    (Int4(32), (2, BN4 - 3, 2 * BB4 + 96)),
    (Int4(128), (2, 7, 384)),
    (Fp8((128, 128)), (2, BR8 + 200, BQ8 + 40)),
    (Fp8((16, 32)), (3, 40, 72)),
]
IDS = ["mxfp4", "int4", "int4-g128", "fp8", "fp8-16x32"]


def quantized(fmt, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # scales apart by 10^4
    return fmt.quantize(w, transposed=False)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt, shape", FORMATS, ids=IDS)
def test_kernel_is_the_definition_bit_for_bit(device, fmt, shape):
    w, scales = (t.to(device) for t in quantized(fmt, shape))
    # the interpreter rounds float32 to bf16 toward zero, the GPU to nearest as torch does
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        want = fmt.dequantize([w, scales], dtype, transposed=False)
        got = dequantize_triton(fmt, w, scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("fmt, shape", FORMATS[::2], ids=IDS[::2])
def test_reference_goes_a_few_slots_at_a_time(fmt, shape, monkeypatch):
    import asyncmoe.compute.dequantize as module

    w, scales = quantized(fmt, shape)
    want = fmt.dequantize([w, scales], torch.bfloat16, transposed=False)
    monkeypatch.setattr(module, "REFERENCE_BYTES", 1)  # one slot a step
    torch.testing.assert_close(
        dequantize_reference(fmt, w, scales, torch.bfloat16), want, atol=0, rtol=0
    )


@pytest.mark.parametrize("fmt, shape", FORMATS[::2], ids=IDS[::2])
def test_op_passes_opcheck(fmt, shape):
    w, scales = quantized(fmt, shape)
    kind, (rows, cols) = fmt.name, (fmt.block if isinstance(fmt, Fp8) else (1, fmt.group))
    args = (w.view(torch.uint8), scales, kind, rows, cols, torch.bfloat16)
    torch.library.opcheck(torch.ops.asyncmoe.dequantize.default, args)
    torch.testing.assert_close(
        ops.dequantized(fmt, w, scales, torch.bfloat16),
        fmt.dequantize([w, scales], torch.bfloat16, transposed=False),
        atol=0,
        rtol=0,
    )


def test_fake_states_the_contract():
    mode = torch._subclasses.FakeTensorMode()
    w, scales = (mode.from_tensor(t) for t in quantized(Int4(32), (2, 8, 64)))
    with mode, pytest.raises(Exception, match=r"must be \[C, N, K/2\] and \[C, N, K/64\]"):
        torch.ops.asyncmoe.dequantize(w, scales, "int4", 1, 64, torch.bfloat16)
    with mode, pytest.raises(Exception, match=r"kind must be one of \('fp8', 'mxfp4', 'int4'\)"):
        torch.ops.asyncmoe.dequantize(w, scales, "nf4", 1, 32, torch.bfloat16)
    q, s = (mode.from_tensor(t) for t in quantized(Fp8((16, 32)), (2, 40, 72)))
    with (
        mode,
        pytest.raises(Exception, match=r"do not tile weights \(2, 40, 72\) in blocks of 32x32"),
    ):
        torch.ops.asyncmoe.dequantize(q.view(torch.uint8), s, "fp8", 32, 32, torch.bfloat16)


def test_strided_weights_are_refused():
    w, scales = quantized(Mxfp4(), (2, 8, 64))
    strided = w.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="pass contiguous tensors"):
        dequantize_triton(Mxfp4(), strided, scales, torch.bfloat16)
