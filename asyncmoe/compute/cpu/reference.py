"""Plain-torch definitions of what the CPU expert kernels compute, from the same stored tensors: the weights
dequantized by asyncmoe.formats, then float32 matmuls and the gate (the activation rounded to bf16 when the inputs
are bf16). Tests compare experts.c against these.

Dims: E experts, T tokens, P pairs, H hidden, I intermediate; a projection has N outputs and K inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...formats import Fp8, dequantize_fp8
from .kernels import CpuExperts, Projection

ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda v: F.relu(v).square(),
}


def dense(p: Projection) -> torch.Tensor:
    """Every expert's weight in float32, [E, N, K] (output, input) whatever the stored layout."""
    if p.fmt is None:
        w = p.weight.float()
    elif isinstance(p.fmt, Fp8):
        w = dequantize_fp8(p.weight, p.scales, p.fmt.block, torch.float32)
    else:  # 4-bit formats are stored [E, N, K/2]: never transposed
        return p.fmt.dequantize([p.weight, p.scales], torch.float32, transposed=False)
    return w.transpose(-2, -1) if p.transposed else w


def linear(p: Projection, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [P, K] float32 through each pair's expert: [P, N]."""
    w = dense(p)[expert_ids]  # [P, N, K]
    y = torch.einsum("pnk,pk->pn", w, x)
    return y if p.bias is None else y + p.bias.float()[expert_ids]


def activate(layer: CpuExperts, h: torch.Tensor) -> torch.Tensor:
    """The up-projection [P, N_up] -> [P, I]."""
    if layer.gate == "halves":
        gate, up = h.chunk(2, dim=-1)
        return ACTS[layer.act](gate) * up
    if layer.gate == "gpt_oss":  # transformers' GptOssExperts._apply_gate
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(max=layer.limit)
        up = up.clamp(min=-layer.limit, max=layer.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * layer.alpha))
    return ACTS[layer.act](h)


def experts_mlp(
    layer: CpuExperts, x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """What kernels.experts_mlp returns: float32 [P, H], pair p = (token_ids[p], expert_ids[p]) of x [T, H]."""
    token_ids, expert_ids = token_ids.long(), expert_ids.long()
    h = linear(layer.up, x.float()[token_ids], expert_ids)
    a = activate(layer, h)
    if (
        x.dtype == torch.bfloat16
    ):  # the model's precision between projections, as the kernels keep it
        a = a.bfloat16().float()
    return linear(layer.down, a, expert_ids)
