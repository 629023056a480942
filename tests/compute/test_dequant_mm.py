"""The prompt's grouped dequantizing matmul (fp8, mxfp4, int4) against its plain-torch reference, and its op."""

import pytest
import torch

from asyncmoe.compute.dequant_mm import BM, dequant_mm_reference, dequant_mm_triton, tiles
from asyncmoe.formats import Int4, Mxfp4

from devices import devices

# 4-bit from both module layouts (GPT-OSS stores [E, K, N]; its 4-bit tensors are [E, N, K/2] all the same)
FORMATS = [
    (Mxfp4(), False),
    (Mxfp4(), True),
    (Int4(32), False),
    (Int4(32), True),
    (Int4(128), False),
]
IDS = ["mxfp4", "mxfp4-transposed", "int4", "int4-transposed", "int4-g128"]


def case(fmt, transposed, counts=(5, 0, 70, 9), N=80, K=256, extra=3, seed=0):
    """Rows sorted by slot (`counts` each, a slot with none among them) and `extra` rows of another wave."""
    g = torch.Generator().manual_seed(seed)
    C = len(counts)
    w, scales = fmt.quantize(
        torch.randn(*((C, K, N) if transposed else (C, N, K)), generator=g), transposed
    )
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]) + extra, K, generator=g)
    return x, w, scales, offs


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt, transposed", FORMATS, ids=IDS)
def test_kernel_matches_reference(device, fmt, transposed):
    x, w, scales, offs = (t.to(device) for t in case(fmt, transposed))
    for dtype in [torch.float32] + (
        [torch.bfloat16] if device == "cuda" else []
    ):  # no bf16 in the interpreter
        want = dequant_mm_reference(x.to(dtype), w, scales, offs, fmt.name)
        got = dequant_mm_triton(x.to(dtype), w, scales, offs, fmt.name)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
        torch.testing.assert_close(got, want, **tol)
        assert not got[int(offs[-1]) :].any()  # another wave's rows are not computed


@pytest.mark.parametrize("fmt, transposed", FORMATS, ids=IDS)
def test_reference_is_each_rows_slot_dequantized(fmt, transposed):
    x, w, scales, offs = case(fmt, transposed)
    dense = fmt.dequantize([w, scales], torch.float32, transposed)  # the module's layout
    dense = dense if transposed else dense.transpose(-2, -1)  # [C, K, N]
    slot = torch.searchsorted(offs, torch.arange(int(offs[-1])), right=True)
    want = torch.stack([x[r] @ dense[s] for r, s in enumerate(slot.tolist())])
    got = dequant_mm_reference(x, w, scales, offs, fmt.name)
    torch.testing.assert_close(got[: int(offs[-1])], want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("counts", [(0, 0, 3), (BM, 1, BM + 1, 0), (2 * BM - 1, 2 * BM, 1)])
def test_tiles_cover_every_row_once(counts):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    slot, first = tiles(offs, int(offs[-1]), BM)
    starts = [0, *offs.tolist()[:-1]]
    covered = sorted(
        r
        for s, f in zip(slot.tolist(), first.tolist())
        if s < len(counts)
        for r in range(f, min(f + BM, offs[s]))
    )
    assert covered == list(range(int(offs[-1])))
    assert all(f >= starts[s] for s, f in zip(slot.tolist(), first.tolist()) if s < len(counts))


@pytest.mark.parametrize("fmt, transposed", FORMATS[::2], ids=IDS[::2])
def test_op_passes_opcheck(fmt, transposed):
    x, w, scales, offs = case(fmt, transposed)
    torch.library.opcheck(torch.ops.asyncmoe.dequant_mm.default, (x, w, scales, offs, fmt.name))


def test_fake_states_the_contract():
    x, w, scales, offs = case(Int4(32), False)
    mode = torch._subclasses.FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x[:, :100], w, scales, offs)]
    with mode, pytest.raises(Exception, match=r"x has 100 inputs"):
        torch.ops.asyncmoe.dequant_mm(*fakes, "int4")
    with mode, pytest.raises(Exception, match=r"kind must be one of \('mxfp4', 'int4'\)"):
        torch.ops.asyncmoe.dequant_mm(*[mode.from_tensor(t) for t in (x, w, scales, offs)], "fp8")


def test_strided_weights_are_refused():
    x, w, scales, offs = case(Mxfp4(), False)
    strided = w.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="pass contiguous tensors"):
        dequant_mm_triton(x, strided, scales, offs, "mxfp4")
