"""Expert formats: how a layer's expert weights are stored in the host store, the slots and every
copy.

The native format keeps the model's own dtype. A quantized format stores each of an experts module's
two weight matrices (`gate_up_proj` or `up_proj`, and `down_proj`) as its own tensors; biases stay
in the compute dtype. A miss copies those bytes, and the expert math dequantizes on the fly
(compute/).

- `Fp8`: transformers' fine-grained FP8 layout, the one DeepSeek-V3/R1, Kimi-K2 and the Qwen3 FP8
  releases
  ship: `float8_e4m3fn` [E, R, Q] in the module's own layout beside float32 `<name>_scale_inv`
  [E, ceil(R/br), ceil(Q/bq)], one scale per (br, bq) block (128 x 128 by default). About half of
  bf16's bytes.
- `Mxfp4` and `Int4`: 4-bit values, two a byte along the input dimension (below). About a quarter.
Their quality on the embedded model: docs/decisions.md#quantized-formats-and-their-quality.

Each format's `quantize` / `dequantize` (and the functions below) are the plain-torch definitions
every kernel is tested against. Dims: E experts, R x Q a matrix as the module stores it, N outputs,
K inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE = "_scale_inv"  # suffix of a weight's scales, as in transformers' fine-grained FP8 layout


@dataclass(frozen=True)
class Fp8:
    """Block-wise fp8 experts; `block` = (rows, columns) of the stored [R, Q] matrix per scale."""

    block: tuple[int, int] = (128, 128)
    name = "fp8"
    suffix = SCALE  # the scales' tensor: `<weight name><suffix>`

    def __post_init__(self):
        ok = isinstance(self.block, tuple) and len(self.block) == 2
        if not (ok and all(isinstance(b, int) and b > 0 for b in self.block)):
            raise ValueError(
                "an fp8 block must be a tuple of two positive ints (rows, columns), "
                f"got {self.block!r}"
            )

    def stored(
        self, name: str, shape: torch.Size, transposed: bool
    ) -> list[tuple[str, torch.Size, torch.dtype]]:
        """The tensors [E, ...] that hold the weight `name` of `shape` [E, R, Q]."""
        return [
            (name, shape, FP8),
            (name + SCALE, torch.Size(scale_shape(shape, self.block)), torch.float32),
        ]

    def quantize(self, w: torch.Tensor, transposed: bool) -> list[torch.Tensor]:
        return list(quantize_fp8(w, self.block))

    def dequantize(
        self, tensors: list[torch.Tensor], dtype: torch.dtype, transposed: bool
    ) -> torch.Tensor:
        return dequantize_fp8(*tensors, self.block, dtype)


@dataclass(frozen=True)
class FourBit:
    """4-bit experts stored [E, N, K/2] (two values a byte, the even input in the low nibble) with
    one scale per `group` inputs, [E, N, K/group], whatever the module's own layout: a GEMV reads
    each output's bytes in order."""

    group: int = 32
    suffix = "_scales"

    def stored(
        self, name: str, shape: torch.Size, transposed: bool
    ) -> list[tuple[str, torch.Size, torch.dtype]]:
        E, rows, cols = shape
        N, K = (cols, rows) if transposed else (rows, cols)
        if K % self.group:
            raise ValueError(
                f"{self.name} packs the inputs in groups of {self.group}; {name} has {K} inputs "
                "per output: "
                f"use quantize='fp8' for this model"
            )
        return [
            (name, torch.Size((E, N, K // 2)), torch.uint8),
            (name + self.suffix, torch.Size((E, N, K // self.group)), self.scale_dtype),
        ]

    def quantize(self, w: torch.Tensor, transposed: bool) -> list[torch.Tensor]:
        """[packed, scales], contiguous: the kernels read them in the stored order (a transposed
        module's weight would otherwise leave them strided)."""
        return [t.contiguous() for t in self._quantize(w.transpose(-2, -1) if transposed else w)]

    def dequantize(
        self, tensors: list[torch.Tensor], dtype: torch.dtype, transposed: bool
    ) -> torch.Tensor:
        dense = self._dequantize(*tensors, dtype)  # [..., N, K]
        return dense.transpose(-2, -1) if transposed else dense


@dataclass(frozen=True)
class Mxfp4(FourBit):
    """OCP microscaling fp4, as GPT-OSS ships its experts: e2m1 values in groups of 32 under one
    e8m0 scale."""

    group: int = 32
    name = "mxfp4"
    scale_dtype = torch.uint8

    def __post_init__(self):
        if self.group != MXFP4_GROUP:
            raise ValueError(f"mxfp4 groups are {MXFP4_GROUP} values, got {self.group}")

    def _quantize(self, w):
        return quantize_mxfp4(w)

    def _dequantize(self, blocks, scales, dtype):
        return dequantize_mxfp4(blocks, scales, dtype)


@dataclass(frozen=True)
class Int4(FourBit):
    """Signed 4-bit integers, symmetric, one bf16 scale per `group` inputs (groups of 32 by
    default)."""

    group: int = 32
    name = "int4"
    scale_dtype = torch.bfloat16

    def __post_init__(self):
        if self.group not in (16, 32, 64, 128):
            raise ValueError(f"int4 groups are 16, 32, 64 or 128 inputs, got {self.group}")

    def _quantize(self, w):
        return quantize_int4(w, self.group)

    def _dequantize(self, packed, scales, dtype):
        return dequantize_int4(packed, scales, dtype)


Format = Fp8 | Mxfp4 | Int4
QUANTIZE_METHODS = ("fp8", "mxfp4", "int4")


def parse_quantize(quantize) -> Format | None:
    """`quantize=` of `compile` / `from_pretrained`: None keeps the model's dtype; "fp8", "mxfp4" or
    "int4" quantize the experts on the way to host memory (or a format object, for other block or
    group sizes)."""
    if quantize is None or isinstance(quantize, (Fp8, Mxfp4, Int4)):
        return quantize
    if quantize in QUANTIZE_METHODS:
        return {"fp8": Fp8, "mxfp4": Mxfp4, "int4": Int4}[quantize]()
    raise ValueError(
        f"quantize={quantize!r}: asyncmoe stores experts as "
        f"{', '.join(map(repr, QUANTIZE_METHODS))}, "
        "or leave quantize=None to keep the model's dtype"
    )


def weight_names(experts) -> tuple[str, str]:
    """The experts module's two weight matrices, the tensors a quantized format stores quantized."""
    return ("gate_up_proj" if experts.has_gate else "up_proj"), "down_proj"


def scale_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """[..., R, Q] -> [..., ceil(R/br), ceil(Q/bq)]."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, Q] -> (fp8 [..., R, Q], scale_inv float32 [..., ceil(R/br), ceil(Q/bq)]): per
    block, the largest magnitude maps to FP8_MAX (an all-zero block keeps scale 1, so zeros stay
    zeros)."""
    br, bq = block
    *lead, rows, cols = w.shape
    pad_r, pad_q = -rows % br, -cols % bq
    tiles = torch.nn.functional.pad(w.float(), (0, pad_q, 0, pad_r))
    tiles = tiles.reshape(*lead, (rows + pad_r) // br, br, (cols + pad_q) // bq, bq)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., Rb, Qb]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*lead, rows + pad_r, cols + pad_q)[..., :rows, :cols]
    return q.contiguous(), scale_inv


def dequantize_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
):
    """fp8 [..., R, Q] and scale_inv [..., Rb, Qb] -> [..., R, Q] in `dtype` (the product taken in
    float32)."""
    br, bq = block
    *lead, rows, cols = q.shape
    pad_r, pad_q = -rows % br, -cols % bq
    x = q.float()
    if pad_r or pad_q:
        x = torch.nn.functional.pad(x, (0, pad_q, 0, pad_r))
    x = (
        x.reshape(*lead, (rows + pad_r) // br, br, (cols + pad_q) // bq, bq)
        * scale_inv.float()[..., :, None, :, None]
    )
    return x.view(*lead, rows + pad_r, cols + pad_q)[..., :rows, :cols].to(dtype)


# --- 4-bit formats: two values a byte along the input dimension, one scale per group of inputs ---
#
# Both are stored [E, N, K] in (output, input) order whatever the module's own layout, packed along K (the low
# nibble holds the even input), so that a GEMV reads each row's bytes in order: weights [E, N, K/2] uint8 and
# scales [E, N, K/G]. MXFP4 (OCP microscaling, as GPT-OSS ships): e2m1 values in groups of 32 under one e8m0
# scale (uint8, 2**(s - 127)). int4: signed values -8..7 in groups of G under one bf16 scale, symmetric.

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] int64 codes 0..15, the low nibble first."""
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 (K even) -> [..., K/2] uint8, the even code in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """blocks [..., N, K/2] uint8 and e8m0 scales [..., N, K/32] uint8 -> [..., N, K] in `dtype`."""
    values = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)[unpack_nibbles(blocks)]
    exponent = scales.to(torch.int32) - 127
    values = values.unflatten(-1, (scales.shape[-1], MXFP4_GROUP))
    return torch.ldexp(values, exponent[..., None].float()).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks [..., N, K/2] uint8, e8m0 scales [..., N, K/32]
    uint8).

    Per group, the scale is the power of two that brings the largest magnitude to at most 6 (e2m1's
    largest), and each value rounds to the nearest e2m1 value (ties to the even code)."""
    groups = w.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., N, K/32, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    grid = torch.tensor(E2M1[:8], device=w.device)  # magnitudes 0..6
    # the nearest magnitude; ties to the lower code
    code = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    code = torch.where(scaled < 0, code + 8, code)
    return pack_nibbles(code.flatten(-2)), (exponent[..., 0] + 127).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of `group`) -> (packed [..., N, K/2] uint8, bf16 scales [..., N,
    K/group]): symmetric, q = round(w / scale) in -8..7 with scale = amax / 7 per group; stored as q
    + 8."""
    groups = w.float().unflatten(-1, (-1, group))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 7).to(torch.bfloat16).float()
    q = torch.where(scale > 0, groups / scale, 0.0).round().clamp(-8, 7)
    return pack_nibbles((q + 8).flatten(-2)), scale[..., 0].to(torch.bfloat16)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., N, K/2] uint8 and bf16 scales [..., N, K/G] -> [..., N, K] in `dtype` (product
    in float32)."""
    q = (unpack_nibbles(packed) - 8).float().unflatten(-1, (scales.shape[-1], -1))
    return (q * scales.float()[..., None]).flatten(-2).to(dtype)
