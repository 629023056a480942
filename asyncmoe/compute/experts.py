"""The experts MLP computed from slot buffers, for any transformers `@use_experts_implementation`
module.

The module's layout flags say how its weights are stored and combined; we honour each of them:
`has_gate` (`gate_up_proj` + `_apply_gate`, else `up_proj` + `act_fn`), `is_transposed`
(`[in, out]` rather than `[out, in]` per expert), `has_bias` (`*_bias` per expert),
`has_post_expert_norm`; `is_concatenated` (gate/up halves vs GPT-OSS's interleaving) is the
module's own `_apply_gate`'s business. Routing weights are applied and summed over k in the same
order and precision as transformers' own backends, so outputs match the unmodified model.

Dense `[out, in]` slots on CUDA at decode sizes (at most DENSE_GEMV_PAIRS_PER_SLOT pairs a slot)
take one GEMV per projection over the routed slots (`asyncmoe::slot_gemv`), without the grouped
GEMM's sort; larger calls, transposed experts, and the CPU, the grouped GEMM (bf16) or the gathered
bmm. Quantized slots (formats: fp8, mxfp4, int4), by pairs per slot, each path the fastest measured
there (docs/decisions.md#quantized-matmul-by-pairs-per-slot): few pairs (decode), one fused
dequantizing GEMV per projection over the routed slots (`ops.fp8_matmul`, `ops.gemv4`); more, every
slot dequantized to the compute dtype in one launch (`asyncmoe::dequantize`) and the dense path.

Dims: T tokens, H hidden, k top-k, S = T*k (token, expert) pairs, C slots. Slot id -1 marks a pair
served by another wave: its output row is garbage, to be masked by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import gpu
from ..formats import Format, Fp8
from . import ops

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# the gather path copies each pair's expert weights; bound that per chunk
GATHER_BYTES = 256 * 2**20
# pairs per slot up to which a path is the fastest
# (docs/decisions.md#quantized-matmul-by-pairs-per-slot)
GEMV_PAIRS_PER_SLOT = 4  # quantized slots: dequantize + the dense path above
DENSE_GEMV_PAIRS_PER_SLOT = 4  # dense slots on CUDA (docs/decisions.md#dense-decode-gemv)


def layer_weight_names(experts) -> tuple[str, str | None, str, str | None]:
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    if experts.has_bias:
        return up, f"{up}_bias", "down_proj", "down_proj_bias"
    return up, None, "down_proj", None


def _use_grouped_mm(w: torch.Tensor) -> bool:
    """grouped_mm reads each expert once; it traces only for bf16, and on CUDA only sm90/sm100 avoid
    a host sync."""
    if _grouped_mm is None or w.dtype != torch.bfloat16 or w.shape[-1] % 8 or w.shape[-2] % 8:
        return False
    if w.is_cuda:
        return torch.cuda.get_device_capability(w.device)[0] in (9, 10)
    return w.device.type == "cpu"


def _use_slot_gemv(experts, w: torch.Tensor, slots: torch.Tensor) -> bool:
    """Dense slots at decode sizes on CUDA: the GEMV (compute/slot_gemv.py) where pairs are at most
    DENSE_GEMV_PAIRS_PER_SLOT a slot, for `[out, in]` experts; transposed ones (GPT-OSS) read slower
    through it than through the grouped GEMM. Decided by layout, shapes and device, so a capture
    always takes the same path."""
    return (
        not experts.is_transposed
        and gpu.available(w)
        and slots.numel() <= DENSE_GEMV_PAIRS_PER_SLOT * w.shape[0]
    )


def routed_outputs(
    experts,
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: dict[str, torch.Tensor],
    fmt: Format | None = None,
) -> torch.Tensor:
    """Each pair's expert output before routing weights: [S, H]. `fmt`: the weights' format (None:
    dense)."""
    up, up_bias, down, down_bias = layer_weight_names(experts)
    if fmt is not None and up + fmt.suffix in weights:
        return _quantized(experts, x, slots, weights, fmt)
    if _use_slot_gemv(experts, weights[up], slots):
        return _gemv(experts, x, slots, weights, None)
    args = (
        experts,
        x,
        slots,
        weights[up],
        weights.get(up_bias),
        weights[down],
        weights.get(down_bias),
    )
    return _grouped(*args) if _use_grouped_mm(weights[up]) else _gathered(*args)


def _quantized(experts, x, slots, weights, fmt: Format):
    up, up_bias, down, down_bias = layer_weight_names(experts)
    t = experts.is_transposed
    # shapes only: the path is fixed under capture and tracing
    pairs, C = slots.numel(), weights[up].shape[0]
    if pairs <= GEMV_PAIRS_PER_SLOT * C:
        return _gemv(experts, x, slots, weights, fmt)
    dense = {
        n: _dequantized(fmt, weights[n], weights[n + fmt.suffix], x.dtype, t) for n in (up, down)
    }
    return routed_outputs(experts, x, slots, {**weights, **dense})


def _gemv(experts, x, slots, weights, fmt: Format | None):
    """One GEMV per projection over the routed slots, dequantizing where `fmt` is a format (None:
    dense): each pair reads its expert's bytes once."""
    up, up_bias, down, down_bias = layer_weight_names(experts)
    t = experts.is_transposed
    idx = slots.reshape(-1)  # [S]

    def linear(inp, name, bias):
        if fmt is None:
            # [out, in] slots (_use_slot_gemv)
            out = torch.ops.asyncmoe.slot_gemv(inp, weights[name], idx)
        elif isinstance(fmt, Fp8):
            out = ops.fp8_matmul(inp, weights[name], weights[name + fmt.suffix], idx, fmt.block, t)
        else:  # 4-bit slots are stored [C, N, K/2] whatever the module's layout
            out = torch.ops.asyncmoe.gemv4(
                inp, weights[name], weights[name + fmt.suffix], idx, fmt.name
            )
        return out if bias is None else out + weights[bias][idx.clamp(min=0)]

    h = linear(x.repeat_interleave(slots.shape[1], dim=0), up, up_bias)
    h = linear(_activate(experts, h), down, down_bias)
    return _finish(experts, h)


def _dequantized(
    fmt: Format, w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, transposed: bool
):
    """Every slot of w in `dtype` (`asyncmoe::dequantize`: one launch on CUDA), in the module's
    layout: 4-bit slots are stored [C, N, K/2] whatever it is."""
    dense = ops.dequantized(fmt, w, scales, dtype)
    return dense.transpose(-2, -1) if transposed and not isinstance(fmt, Fp8) else dense


def _activate(experts, h: torch.Tensor) -> torch.Tensor:
    return experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)


def _finish(experts, h: torch.Tensor) -> torch.Tensor:
    return experts.post_expert_norm(h) if getattr(experts, "has_post_expert_norm", False) else h


def _by_slot(slots: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs [T, k] sorted by slot: (perm [S], offs [C] int32 the end of each slot's rows, row_slot
    [S]); pairs of other waves (-1) sort last, past offs[-1]."""
    key = torch.where(slots.reshape(-1) >= 0, slots.reshape(-1), C)  # [S]; C = not in this wave
    key_sorted, perm = torch.sort(key, stable=True)
    counts = torch.zeros(C + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return perm, counts[:C].cumsum(0, dtype=torch.int32), key_sorted.clamp(max=C - 1)


def _grouped(experts, x, slots, w_up, b_up, w_down, b_down):
    """Sort pairs by slot, one grouped GEMM per projection; pairs of other waves sort last and are
    skipped."""
    k = slots.shape[1]
    perm, offs, row_slot = _by_slot(slots, w_up.shape[0])

    def linear(inp, w, b):
        out = _grouped_mm(
            inp.to(w.dtype), w if experts.is_transposed else w.transpose(-2, -1), offs=offs
        )
        return out if b is None else out + b[row_slot]

    h = linear(x[perm // k], w_up, b_up)
    h = linear(_activate(experts, h), w_down, b_down)
    h = _finish(experts, h)
    return torch.empty_like(h).index_copy_(0, perm, h)


def _gathered(experts, x, slots, w_up, b_up, w_down, b_down):
    """Gather each pair's expert weights and bmm: any dtype, no host sync; chunked to bound the
    copies."""
    k = slots.shape[1]
    idx = slots.reshape(-1).clamp(min=0)  # [S]; other waves' pairs compute on slot 0, masked later
    xs = x.repeat_interleave(k, dim=0)  # [S, H]
    pair_bytes = (w_up[0].numel() + w_down[0].numel()) * w_up.element_size()
    chunk = max(1, GATHER_BYTES // pair_bytes)

    def linear(inp, w, b):
        inp = inp.to(w.dtype)
        if experts.is_transposed:  # w [n, in, out]
            out = torch.bmm(inp.unsqueeze(1), w).squeeze(1)
        else:  # w [n, out, in]
            out = torch.bmm(w, inp.unsqueeze(-1)).squeeze(-1)
        return out if b is None else out + b

    outs = []
    for lo in range(0, idx.numel(), chunk):
        i = idx[lo : lo + chunk]
        h = linear(xs[lo : lo + chunk], w_up[i], None if b_up is None else b_up[i])
        h = linear(_activate(experts, h), w_down[i], None if b_down is None else b_down[i])
        outs.append(_finish(experts, h))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def absent_zeroed(pair_out: torch.Tensor, top_k_index: torch.Tensor, E: int) -> torch.Tensor:
    """Rows of pairs routed to another rank's experts (id E under expert parallelism, weight 0) set
    to zero: no expert computed them here, and their garbage times a zero weight could still be
    NaN."""
    return torch.where((top_k_index < E).reshape(-1, 1), pair_out, 0)


def combine(
    pair_out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Weight each pair and sum over k, as transformers does (fp32 router weights promote the
    sum)."""
    T, k = top_k_weights.shape
    weighted = pair_out * top_k_weights.reshape(-1, 1)
    return weighted.view(T, k, -1).sum(dim=1).to(dtype)
