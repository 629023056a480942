"""random_mxfp4_model: a model whose experts exist only in MXFP4, in the layout asyncmoe's host store keeps an MXFP4
checkpoint's experts (checked against transformers' own experts run on the dequantized weights)."""

import copy

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import asyncmoe
from asyncmoe.formats import Mxfp4, weight_names
from asyncmoe.integrations.quantized_checkpoint import put_fused_experts
from asyncmoe.integrations.transformers import find_experts

from shapes import config, random_mxfp4_model
from synthetic import synthetic

SHAPE = "tiny-gpt-oss"  # 2 layers, hidden 64, 8 experts, top-2
IDS = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(0))


class Allocations(TorchDispatchMode):
    """The element counts of every tensor an op makes off the meta device, by dtype kind."""

    def __init__(self):
        super().__init__()
        self.floating: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.is_floating_point():
                self.floating.append(t.numel())
        return out


def model(**compile_kw):
    m = random_mxfp4_model(SHAPE, torch.float32, "cpu")
    return asyncmoe.compile(m, quantize="mxfp4", device="cpu", **compile_kw) if compile_kw else m


def dequantized(m):
    """A copy of `m` whose experts are its MXFP4 weights dequantized by asyncmoe.formats, in the module's layout,
    computed by transformers' eager experts: the plain-torch reference."""
    ref = copy.deepcopy(m)
    for _, e in find_experts(ref):
        for w in weight_names(e):
            blocks, scales = e._parameters.pop(w), e._parameters.pop(w + Mxfp4.suffix)
            dense = Mxfp4().dequantize([blocks, scales], torch.float32, e.is_transposed)
            e._parameters[w] = torch.nn.Parameter(dense, requires_grad=False)
    return ref


def test_experts_are_never_made_dense():
    with Allocations() as made:
        m = model()
    experts = find_experts(m)
    E, I, H = 8, 64, 64
    assert max(made.floating) < E * I * H  # no float tensor the size of one experts weight, ever
    for _, e in experts:
        params = dict(e.named_parameters())
        assert {n for n, p in params.items() if p.dtype == torch.uint8} == {
            "gate_up_proj",
            "gate_up_proj_scales",
            "down_proj",
            "down_proj_scales",
        }
        assert all(p.dim() == 2 for p in params.values() if p.is_floating_point())  # biases [E, N]
        assert params["gate_up_proj"].shape == (E, 2 * I, H // 2)  # [E, N, K/2], N outputs
        assert params["down_proj_scales"].shape == (E, H, I // 32)


@torch.no_grad()
def test_cache_0_computes_the_dequantized_experts():
    reference = dequantized(model())(IDS).logits
    got = model(cache=0, cpu_threads=2)(IDS).logits
    assert reference.isfinite().all() and reference.abs().max() > 0.1
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_cache_0_and_a_gpu_budget_decode_the_same_replayed_tokens(capsys):
    trace = synthetic(8, 2, layers=2, tokens=64)
    tokens = []
    for cache in (0, "60KiB"):  # 4 slots of 7296 bytes in each of 2 layers
        m = model(cache=cache, replay=trace)
        dec = asyncmoe.Decoder(m, batch_size=2, max_length=20, graph=False)
        tokens.append(dec.generate(IDS, max_new_tokens=8).tokens)
    assert "cache='60KiB' gives 4 slots per MoE layer" in capsys.readouterr().out
    assert torch.equal(tokens[0], tokens[1])


def test_put_fused_experts_refuses_a_layout_other_than_the_modules():
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(config(SHAPE))
    _, e = find_experts(m)[0]
    E, I, H = 8, 64, 64
    transposed = {  # [E, K, N/32, 16]: the module's own [E, K, N] order, not the checkpoint's
        "gate_up_proj_blocks": torch.zeros(E, H, 2 * I // 32, 16, dtype=torch.uint8),
        "gate_up_proj_scales": torch.zeros(E, H, 2 * I // 32, dtype=torch.uint8),
    }
    with pytest.raises(ValueError, match="mxfp4 stores this module's"):
        put_fused_experts(e, Mxfp4(), transposed, source="layer 0")
