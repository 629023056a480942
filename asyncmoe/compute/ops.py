"""The expert compute's custom ops with their fakes: each pair's matmul from the slots, dense
(`slot_gemv`), fp8 (`fp8_gemv`) or 4-bit (`gemv4`), and quantized slots to the compute dtype
(`dequantize`, for larger calls). Ops so that torch.compile need not trace the Triton kernels, and a
CUDA graph captures one launch each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import FP8, Format, Fp8, Int4, Mxfp4, scale_shape
from . import dequantize, fp8_gemv, gemv4, slot_gemv


@torch.library.custom_op("asyncmoe::slot_gemv", mutates_args=())
def _slot_gemv(x: Tensor, w: Tensor, slots: Tensor) -> Tensor:
    """Each pair's expert matmul from dense slots: out [S, N] = w[slots[s]] @ x[s]
    (compute/slot_gemv.py); a pair of another wave (slot -1) gets zeros. An op so that torch.compile
    need not trace the Triton kernel."""
    return slot_gemv.slot_gemv(x, w, slots)


@_slot_gemv.register_fake
def _(x, w, slots):
    S, K = x.shape
    torch._check(
        slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}"
    )
    torch._check(
        w.dim() == 3 and K == w.shape[2],
        lambda: (
            f"x has {K} inputs, the weights {tuple(w.shape)} ([slots, out, in]) take another number"
        ),
    )
    return x.new_empty(S, w.shape[1], dtype=w.dtype)


@torch.library.custom_op("asyncmoe::fp8_gemv", mutates_args=())
def _fp8_gemv(
    x: Tensor,
    w: Tensor,
    scale: Tensor,
    slots: Tensor,
    block_rows: int,
    block_cols: int,
    transposed: bool,
) -> Tensor:
    """Each pair's expert matmul from fp8 slots: out [S, N] = dequantize(w[slots[s]]) @ x[s]
    (compute/fp8_gemv.py).

    An op so that torch.compile need not trace the Triton kernel, and a CUDA graph captures one
    launch. `w` is the fp8 weights' bytes (uint8), viewed as float8_e4m3fn inside: torch has few fp8
    kernels on the CPU."""
    return fp8_gemv.fp8_gemv(x, w.view(FP8), scale, slots, (block_rows, block_cols), transposed)


@_fp8_gemv.register_fake
def _(x, w, scale, slots, block_rows, block_cols, transposed):
    S, K = x.shape
    N = w.shape[2] if transposed else w.shape[1]
    torch._check(
        w.dtype == torch.uint8,
        lambda: f"fp8_gemv takes the fp8 weights' bytes (uint8), got {w.dtype}",
    )
    torch._check(
        slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}"
    )
    torch._check(
        K == (w.shape[1] if transposed else w.shape[2]),
        lambda: (
            f"x has {K} inputs, the weights {tuple(w.shape)} (transposed={transposed}) take "
            "another number"
        ),
    )
    torch._check(
        scale.shape == (w.shape[0], *scale_shape(w.shape[1:], (block_rows, block_cols))),
        lambda: (
            f"scales {tuple(scale.shape)} do not tile weights {tuple(w.shape)} in blocks of "
            f"{block_rows}x{block_cols}"
        ),
    )
    return x.new_empty(S, N)


def fp8_matmul(
    x: Tensor, w: Tensor, scale: Tensor, slots: Tensor, block: tuple[int, int], transposed: bool
) -> Tensor:
    """`asyncmoe::fp8_gemv`: x [S, K], the slots' fp8 weights w [C, R, Q] and scales -> [S, N]."""
    return torch.ops.asyncmoe.fp8_gemv(
        x, w.view(torch.uint8), scale, slots, block[0], block[1], transposed
    )


@torch.library.custom_op("asyncmoe::gemv4", mutates_args=())
def _gemv4(x: Tensor, packed: Tensor, scales: Tensor, slots: Tensor, kind: str) -> Tensor:
    """Each pair's expert matmul from 4-bit slots (`kind` "mxfp4" or "int4"; compute/gemv4.py):
    out [S, N] = dequantize(packed[slots[s]], scales[slots[s]]) @ x[s]."""
    return gemv4.gemv4(x, packed, scales, slots, kind)


@_gemv4.register_fake
def _(x, packed, scales, slots, kind):
    S, K = x.shape
    torch._check(
        kind in gemv4.KINDS, lambda: f"gemv4 kind must be one of {gemv4.KINDS}, got {kind!r}"
    )
    torch._check(
        packed.dtype == torch.uint8, lambda: f"gemv4 takes packed uint8 weights, got {packed.dtype}"
    )
    torch._check(
        slots.shape == (S,), lambda: f"slots must be [{S}] (one per pair), got {tuple(slots.shape)}"
    )
    torch._check(
        packed.shape[2] * 2 == K
        and scales.shape[:2] == packed.shape[:2]
        and K % scales.shape[2] == 0,
        lambda: (
            f"x has {K} inputs; packed weights {tuple(packed.shape)} and scales "
            f"{tuple(scales.shape)} must be "
            f"[C, N, {K // 2}] and [C, N, {K}/group]"
        ),
    )
    return x.new_empty(S, packed.shape[1])


@torch.library.custom_op("asyncmoe::dequantize", mutates_args=())
def _dequantize(
    w: Tensor, scales: Tensor, kind: str, block_rows: int, block_cols: int, dtype: torch.dtype
) -> Tensor:
    """Every slot of quantized weights in `dtype`, in stored order (compute/dequantize.py): 4-bit
    (`kind` "mxfp4" or "int4") [C, N, K/2] -> [C, N, K]; fp8 (its bytes, uint8, in blocks of
    block_rows x block_cols) [C, R, Q] -> [C, R, Q]."""
    fmt = _format(kind, block_rows, block_cols)
    return dequantize.dequantize(fmt, w.view(FP8) if kind == "fp8" else w, scales, dtype)


@_dequantize.register_fake
def _(w, scales, kind, block_rows, block_cols, dtype):
    torch._check(
        kind in dequantize.KINDS,
        lambda: f"dequantize kind must be one of {dequantize.KINDS}, got {kind!r}",
    )
    torch._check(
        w.dtype == torch.uint8,
        lambda: f"dequantize takes packed 4-bit weights or fp8's bytes (uint8), got {w.dtype}",
    )
    C, rows, cols = w.shape
    if kind == "fp8":
        torch._check(
            scales.shape == (C, *scale_shape(w.shape[1:], (block_rows, block_cols))),
            lambda: (
                f"scales {tuple(scales.shape)} do not tile weights {tuple(w.shape)} in blocks of "
                f"{block_rows}x{block_cols}"
            ),
        )
        return w.new_empty(C, rows, cols, dtype=dtype)
    torch._check(
        scales.shape[:2] == (C, rows) and (2 * cols) == scales.shape[2] * block_cols,
        lambda: (
            f"packed weights {tuple(w.shape)} and scales {tuple(scales.shape)} must be "
            f"[C, N, K/2] and [C, N, K/{block_cols}]"
        ),
    )
    return w.new_empty(C, rows, 2 * cols, dtype=dtype)


def _format(kind: str, block_rows: int, block_cols: int) -> Format:
    if kind == "fp8":
        return Fp8((block_rows, block_cols))
    return Mxfp4() if kind == "mxfp4" else Int4(block_cols)


def dequantized(fmt: Format, w: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """`asyncmoe::dequantize` of a format's slots: the stored order's dense weights in `dtype`."""
    if isinstance(fmt, Fp8):
        return torch.ops.asyncmoe.dequantize(
            w.view(torch.uint8), scales, "fp8", fmt.block[0], fmt.block[1], dtype
        )
    return torch.ops.asyncmoe.dequantize(w, scales, fmt.name, 1, fmt.group, dtype)
