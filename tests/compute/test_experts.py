"""The experts MLP computed from slot buffers (experts.py): `routed_outputs` on its dense paths (grouped_mm, the
gathered bmm and the decode GEMV) for every layout flag, against a plain per-pair computation from the module's own
weights; and `combine`."""

import inspect
import itertools
import types

import pytest
import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation

import asyncmoe.compute.experts
from asyncmoe.compute.experts import combine, routed_outputs
from asyncmoe.formats import parse_quantize, weight_names
from asyncmoe.integrations.transformers import find_experts

from models import tiny

E, H, F = (
    6,
    16,
    24,
)  # experts, hidden, intermediate (FFN): multiples of 8 (grouped_mm), and no square weight


def experts_module(
    has_gate: bool, has_bias: bool, is_transposed: bool, post_norm: bool = False, seed: int = 0
):
    """An experts module of the given layout, decorated as transformers decorates its families' experts."""

    flags = dict(has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed)
    if post_norm:
        if "has_post_expert_norm" not in inspect.signature(use_experts_implementation).parameters:
            pytest.skip("this transformers has no post-expert norm flag (added after 5.17)")
        flags["has_post_expert_norm"] = True

    @use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            up, out = ("gate_up_proj", 2 * F) if has_gate else ("up_proj", F)
            shapes = {
                up: (E, H, out) if is_transposed else (E, out, H),
                "down_proj": (E, F, H) if is_transposed else (E, H, F),
            }
            if has_bias:
                shapes.update({f"{up}_bias": (E, out), "down_proj_bias": (E, H)})
            for name, shape in shapes.items():
                setattr(
                    self, name, nn.Parameter(torch.randn(shape, generator=g) / shape[-1] ** 0.5)
                )
            self.act_fn = nn.SiLU()
            if post_norm:
                self.post_expert_norm = nn.LayerNorm(H)

    return Experts(types.SimpleNamespace(_experts_implementation=None))


def per_pair(
    m, x: torch.Tensor, slots: torch.Tensor, weights: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Each pair's expert output, one pair at a time in float64, from the weights of the slot it names [T*k, H];
    rows of pairs in other waves (slot -1) are zero."""
    up = "gate_up_proj" if m.has_gate else "up_proj"
    w = {n: t.double() for n, t in weights.items()}

    def linear(v, name, s):
        out = v @ w[name][s] if m.is_transposed else w[name][s] @ v
        return out + w[f"{name}_bias"][s] if m.has_bias else out

    rows = []
    for t, s in itertools.product(range(slots.shape[0]), range(slots.shape[1])):
        slot = int(slots[t, s])
        if slot < 0:
            rows.append(torch.zeros(x.shape[1], dtype=torch.float64))
            continue
        h = linear(x[t].double(), up, slot)
        h = m._apply_gate(h[None])[0] if m.has_gate else m.act_fn(h)
        h = linear(h, "down_proj", slot)
        rows.append(
            m.post_expert_norm.double()(h) if getattr(m, "has_post_expert_norm", False) else h
        )
    return torch.stack(rows)


def case(dtype: torch.dtype, T: int = 7, k: int = 2, C: int = 4, hidden: int = H, seed: int = 0):
    """x [T, H], slot ids [T, k] with some pairs in another wave (-1), and slot weights [C, ...] that are a
    permutation of the module's experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    slots = torch.randint(0, C, (T, k), generator=g)
    slots[torch.rand(T, k, generator=g) < 0.25] = -1
    return x, slots, torch.randperm(E, generator=g)[:C]


def slot_weights(m, experts: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: p.detach()[experts].to(dtype) for n, p in m.named_parameters(recurse=False)}


LAYOUTS = [
    dict(has_gate=g, has_bias=b, is_transposed=t)
    for g, b, t in itertools.product([True, False], repeat=3)
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda d: "-".join(k for k, v in d.items() if v) or "plain"
)
@pytest.mark.parametrize("path", ["gathered", "grouped", "gemv"])
@torch.no_grad()
def test_routed_outputs_equal_a_per_pair_computation(layout, path, monkeypatch):
    dtype = torch.bfloat16 if path == "grouped" else torch.float32  # grouped_mm runs bf16
    m = experts_module(**layout)
    x, slots, held = case(dtype)
    weights = slot_weights(m, held, dtype)
    assert asyncmoe.compute.experts._use_grouped_mm(
        weights["gate_up_proj" if m.has_gate else "up_proj"]
    ) == (path == "grouped")
    taken = []
    if (
        path == "gemv"
    ):  # the CUDA decode path, for [out, in] experts; here its op runs the kernel's reference
        monkeypatch.setattr(asyncmoe.gpu, "available", lambda t: True)
        gemv = asyncmoe.compute.experts._gemv
        monkeypatch.setattr(
            asyncmoe.compute.experts, "_gemv", lambda *a: taken.append(a) or gemv(*a)
        )
    got = routed_outputs(m, x, slots, weights)
    assert bool(taken) == (
        path == "gemv" and not m.is_transposed
    )  # transposed experts keep the other paths
    want = per_pair(m, x, slots, weights)
    served = (slots >= 0).reshape(-1)
    assert got.shape == (slots.numel(), H) and got.dtype == dtype
    if path != "grouped":
        torch.testing.assert_close(got[served].double(), want[served], rtol=1e-5, atol=1e-5)
    else:  # bf16 intermediates: within bf16 rounding of the float64 computation from the same bf16 weights
        torch.testing.assert_close(got[served].double(), want[served], rtol=2e-2, atol=2e-2)
        monkeypatch.setattr(asyncmoe.compute.experts, "_use_grouped_mm", lambda w: False)
        gathered = routed_outputs(m, x, slots, weights)  # the other path on the same bf16 weights
        torch.testing.assert_close(got[served], gathered[served], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", ["gathered", "grouped"])
@torch.no_grad()
def test_the_post_expert_norm_is_applied(path):
    dtype = torch.float32 if path == "gathered" else torch.bfloat16
    m = experts_module(True, False, False, post_norm=True).to(dtype)
    x, slots, held = case(dtype)
    weights = slot_weights(m, held, dtype)
    got, want = routed_outputs(m, x, slots, weights), per_pair(m, x, slots, weights)
    served = (slots >= 0).reshape(-1)
    tol = 1e-5 if path == "gathered" else 5e-2
    torch.testing.assert_close(got[served].double(), want[served], rtol=tol, atol=tol)


@torch.no_grad()
def test_the_gathered_path_in_chunks_equals_one_chunk(monkeypatch):
    m = experts_module(True, True, False)
    x, slots, held = case(torch.float32, T=9)
    weights = slot_weights(m, held, torch.float32)
    whole = routed_outputs(m, x, slots, weights)
    monkeypatch.setattr(asyncmoe.compute.experts, "GATHER_BYTES", 1)  # one pair a chunk
    torch.testing.assert_close(
        routed_outputs(m, x, slots, weights), whole, rtol=1e-6, atol=1e-6
    )  # bmm's own rounding


@pytest.mark.parametrize(
    "family", ["olmoe", "gpt_oss"]
)  # concatenated gate|up, no bias; GPT-OSS's interleaved, biased, transposed
@torch.no_grad()
def test_a_real_familys_experts(family):
    model = tiny(family)
    _, m = find_experts(model)[0]
    x, slots, held = case(torch.float32, C=5, hidden=model.config.hidden_size)
    weights = slot_weights(m, held, torch.float32)
    served = (slots >= 0).reshape(-1)
    torch.testing.assert_close(
        routed_outputs(m, x, slots, weights)[served].double(),
        per_pair(m, x, slots, weights)[served],
        rtol=1e-5,
        atol=1e-5,
    )


def test_combine_weights_each_pair_and_sums_over_k():
    T, k = 3, 2
    pair_out = torch.arange(T * k * 4, dtype=torch.float32).view(T * k, 4)
    w = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.1, 0.9]])
    want = torch.stack(
        [w[t, 0] * pair_out[2 * t] + w[t, 1] * pair_out[2 * t + 1] for t in range(T)]
    )
    torch.testing.assert_close(combine(pair_out, w, torch.float32), want)
    out = combine(
        pair_out.bfloat16(), w, torch.bfloat16
    )  # fp32 router weights: the sum in fp32, then cast
    assert out.dtype == torch.bfloat16
    assert torch.equal(
        out, (pair_out.bfloat16().float() * w.reshape(-1, 1)).view(T, k, 4).sum(1).bfloat16()
    )


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4", "int4"])
@pytest.mark.parametrize(
    "family", ["olmoe", "gpt_oss"]
)  # GPT-OSS: transposed, biased, clamped SwiGLU
@torch.no_grad()
def test_quantized_paths_by_pairs_per_slot(quantize, family, monkeypatch):
    """Up to GEMV_PAIRS_PER_SLOT pairs a slot the GEMV, above it the slots dequantized and the dense path; each
    equals the per-pair computation from the dequantized slots."""
    model = tiny(family)
    _, m = find_experts(model)[0]
    fmt = parse_quantize(quantize)
    taken = []
    for path in ("_gemv", "_dequantized"):
        real = getattr(asyncmoe.compute.experts, path)
        monkeypatch.setattr(
            asyncmoe.compute.experts,
            path,
            lambda *a, real=real, path=path: taken.append(path) or real(*a),
        )
    paths = {1: "_gemv", 8: "_gemv", 9: "_dequantized", 700: "_dequantized"}
    for T, path in paths.items():  # T tokens, top-2: 2T pairs over 4 slots
        x, slots, held = case(torch.float32, T=T, hidden=model.config.hidden_size)
        weights = slot_weights(m, held, torch.float32)
        dense = dict(weights)
        for name in weight_names(m):
            weights[name], weights[name + fmt.suffix] = fmt.quantize(dense[name], m.is_transposed)
            dense[name] = fmt.dequantize(
                [weights[name], weights[name + fmt.suffix]], torch.float32, m.is_transposed
            )
        taken.clear()
        got = routed_outputs(m, x, slots, weights, fmt)
        assert taken[0] == path
        served = (slots >= 0).reshape(-1)
        want = per_pair(m, x, slots, dense)[served]
        torch.testing.assert_close(got[served].double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_decode_takes_the_gemv_on_cuda_and_equals_the_grouped_path(monkeypatch):
    """Up to DENSE_GEMV_PAIRS_PER_SLOT pairs a slot the GEMV (decode, small batches), above it the grouped GEMM;
    the same outputs."""
    m = experts_module(True, False, False).cuda().bfloat16()
    weights = {
        n: p.detach() for n, p in m.named_parameters(recurse=False)
    }  # every expert in a slot: C = E
    taken = []
    for path in ("_gemv", "_grouped"):
        real = getattr(asyncmoe.compute.experts, path)
        monkeypatch.setattr(
            asyncmoe.compute.experts,
            path,
            lambda *a, real=real, path=path: taken.append(path) or real(*a),
        )
    most = (
        asyncmoe.compute.experts.DENSE_GEMV_PAIRS_PER_SLOT * E // 2
    )  # tokens: top-2 over E = 6 slots
    for T, path in ((1, "_gemv"), (most, "_gemv"), (most + 1, "_grouped")):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).cuda().bfloat16()
        slots = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).cuda()
        taken.clear()
        got = routed_outputs(m, x, slots, weights)
        assert taken == [path]
        want = per_pair(m, x.cpu(), slots.cpu(), {n: t.cpu() for n, t in weights.items()})
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)
