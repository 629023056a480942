"""asyncmoe.formats: the fp8 layout's quantize / dequantize definitions and the `quantize=` argument."""

import pytest
import torch

from asyncmoe.formats import (
    FP8,
    FP8_MAX,
    Fp8,
    Int4,
    Mxfp4,
    dequantize_fp8,
    dequantize_int4,
    dequantize_mxfp4,
    parse_quantize,
    quantize_fp8,
    quantize_int4,
    quantize_mxfp4,
    scale_shape,
)


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (32, 16), (1, 128)])
@pytest.mark.parametrize(
    "shape", [(3, 64, 96), (2, 40, 24), (1, 7, 300)]
)  # partial blocks at the edges too
def test_quantize_then_dequantize_is_within_fp8_rounding(shape, block):
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])  # columns of very different sizes
    q, s = quantize_fp8(w, block)
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == scale_shape(w.shape, block)
    back = dequantize_fp8(q, s, block, torch.float32)
    # e4m3 keeps 3 mantissa bits: within half a step (1/16) of the block's own magnitude, and exact for the block max
    rows = torch.arange(shape[1]) // block[0]
    cols = torch.arange(shape[2]) // block[1]
    bound = s[:, rows][:, :, cols] * FP8_MAX / 16
    assert ((back - w).abs() <= bound + 1e-30).all()


def test_each_block_has_its_own_scale_and_zeros_stay_zero():
    w = torch.zeros(1, 32, 32)
    w[0, :16, :16] = 1000.0  # one loud block
    w[0, 16:, 16:] = torch.full((16, 16), 0.001)
    q, s = quantize_fp8(w, (16, 16))
    assert s.shape == (1, 2, 2)
    assert s[0, 0, 0] == pytest.approx(1000.0 / FP8_MAX) and s[0, 1, 1] == pytest.approx(
        0.001 / FP8_MAX
    )
    assert (
        s[0, 0, 1] == 1.0 and (q[0, :16, 16:].float() == 0).all()
    )  # an all-zero block: scale 1, zeros
    torch.testing.assert_close(dequantize_fp8(q, s, (16, 16), torch.float32), w, rtol=0, atol=0)


def test_mxfp4_dequantizes_bit_for_bit_as_transformers():
    """transformers' own MXFP4 dequantization (`convert_moe_packed_tensors`) on random blocks and scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    E, N, K = 3, 8, 128
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(90, 160, (E, N, K // 32), dtype=torch.uint8, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        theirs = convert_moe_packed_tensors(
            blocks, scales, dtype=dtype
        )  # [E, K, N]: GPT-OSS's module layout
        ours = dequantize_mxfp4(blocks.flatten(2), scales, dtype)  # [E, N, K]
        assert torch.equal(ours.transpose(1, 2), theirs)


@pytest.mark.parametrize(
    "quantize, dequantize, bound",
    [
        (quantize_mxfp4, dequantize_mxfp4, 0.13),
        (lambda w: quantize_int4(w, 32), dequantize_int4, 0.11),
    ],
)
def test_4_bit_round_trip(quantize, dequantize, bound):
    w = torch.randn(4, 16, 256)
    packed, scales = quantize(w)
    assert (
        packed.dtype == torch.uint8 and packed.shape == (4, 16, 128) and scales.shape == (4, 16, 8)
    )
    back = dequantize(packed, scales, torch.float32)
    assert (back - w).norm() / w.norm() < bound  # 4 bits: about a tenth of the signal
    assert torch.equal(
        dequantize(*quantize(back), torch.float32), back
    )  # representable values stay as they are


def test_parse_quantize():
    assert parse_quantize(None) is None and parse_quantize("fp8") == Fp8((128, 128))
    assert parse_quantize("int4") == Int4(32) and parse_quantize("mxfp4") == Mxfp4()
    with pytest.raises(ValueError, match=r"quantize='int3': asyncmoe stores experts as 'fp8'"):
        parse_quantize("int3")
    with pytest.raises(ValueError, match="two positive ints"):
        Fp8((128,))


# --- quantize="fp8" on compile: experts quantized on the way to host memory ---

import copy  # noqa: E402

import asyncmoe  # noqa: E402
from asyncmoe.integrations.transformers import find_experts  # noqa: E402

from models import tiny  # noqa: E402


def quantized_reference(model, fmt):
    """The model with each expert weight replaced by its value in `fmt`, dequantized: what those experts compute."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, m in find_experts(ref):
            for name in ("gate_up_proj" if m.has_gate else "up_proj", "down_proj"):
                w = getattr(m, name)
                for e in range(w.shape[0]):
                    w[e].copy_(
                        fmt.dequantize(
                            fmt.quantize(w[e], m.is_transposed), w.dtype, m.is_transposed
                        )
                    )
    return ref


def fp8_reference(model):
    return quantized_reference(model, Fp8())


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4", "int4"])
@pytest.mark.parametrize(
    "family", ["olmoe", "gpt_oss", "qwen2_moe"]
)  # gpt_oss: transposed, biases, clamped SwiGLU
@pytest.mark.parametrize(
    "cache", [4, 16]
)  # cached, and every expert resident (kept quantized on the device)
def test_quantized_experts_compute_the_dequantized_model(quantize, family, cache):
    model = tiny(
        family, **({"moe_intermediate_size": 64} if family == "qwen2_moe" else {})
    )  # 4-bit: groups of 32
    ours = asyncmoe.compile(copy.deepcopy(model), cache=cache, quantize=quantize, device="cpu")
    decode, prompt = (
        torch.randint(3, 128, (3, 1)),
        torch.randint(3, 128, (2, 40)),
    )  # the GEMV path, the dense path
    ref = quantized_reference(model, parse_quantize(quantize))
    for ids in (decode, prompt):
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    stored = {"fp8": FP8, "mxfp4": torch.uint8, "int4": torch.uint8}[quantize]
    for _, m in find_experts(ours):
        assert m.down_proj.dtype == stored


def test_quantized_bf16_layer_output_within_one_percent_of_the_reference():
    """On bf16 activations: max-abs error over the layer output / its RMS, against the dequantized bf16 layer."""
    model = tiny("olmoe", dtype=torch.bfloat16)
    ours = asyncmoe.compile(copy.deepcopy(model), cache=4, quantize="fp8", device="cpu")
    ref = fp8_reference(model)
    (_, mine), (_, theirs) = find_experts(ours)[0], find_experts(ref)[0]
    g = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 60):
        x = torch.randn(tokens, 32, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g).to(torch.bfloat16)
        got, want = mine(x, idx, weights).float(), theirs(x, idx, weights).float()
        assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 1e-2


def test_a_gpu_memory_budget_chooses_the_slots(capsys):
    model = tiny("olmoe")
    one = asyncmoe.compile(copy.deepcopy(model), cache=4, quantize="fp8", device="cpu")
    expert = asyncmoe.stats(one).layers[0].expert_bytes
    budget = f"{2 * 12 * expert}B"  # 2 layers x 12 slots
    ours = asyncmoe.compile(copy.deepcopy(model), cache=budget, quantize="fp8", device="cpu")
    assert all(layer.slots == 12 for layer in asyncmoe.stats(ours).layers)
    assert f"cache='{budget}' gives 12 slots per MoE layer" in capsys.readouterr().out
    dense = asyncmoe.compile(
        copy.deepcopy(model), cache=budget, device="cpu"
    )  # the same budget: fewer fp32 experts
    assert all(2 <= layer.slots <= 12 // 3 for layer in asyncmoe.stats(dense).layers)
    with pytest.raises(
        ValueError, match=r"below top_k=2: .* the smallest budget that works is cache='.*KiB'"
    ):
        asyncmoe.compile(copy.deepcopy(model), cache=f"{expert}B", quantize="fp8", device="cpu")
    with pytest.raises(ValueError, match=r"cache='6 gigs': give slots per MoE layer as an int"):
        asyncmoe.compile(copy.deepcopy(model), cache="6 gigs", device="cpu")


def test_4_bit_needs_whole_groups_of_inputs():
    with pytest.raises(
        ValueError,
        match="mxfp4 packs the inputs in groups of 32; down_proj has 48 inputs per output",
    ):
        asyncmoe.compile(tiny("qwen2_moe"), cache=4, quantize="mxfp4", device="cpu")


def test_quantize_none_keeps_the_models_dtype():
    ours = asyncmoe.compile(tiny("olmoe"), cache=4, device="cpu")
    assert all(
        t.dtype == torch.float32 for _, m in find_experts(ours) for t in m.asyncmoe.cache.slots
    )


@pytest.mark.parametrize("quantize", ["fp8", "int4"])
@torch.no_grad()
def test_fullgraph_compile_of_a_quantized_model(quantize):
    model = tiny("olmoe")
    ours = asyncmoe.compile(copy.deepcopy(model), cache=4, quantize=quantize, device="cpu")
    ids = torch.randint(3, 128, (2, 1))
    want = ours(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits, want, atol=1e-5, rtol=1e-5)


# --- on the GPU: fp8 slots in the Decoder's CUDA graph, torch.compile and generate ---


@pytest.mark.cuda
@pytest.mark.parametrize("quantize", ["fp8", "mxfp4", "int4"])
@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
@pytest.mark.parametrize("cache", [4, 16])
@torch.no_grad()
def test_quantized_on_the_gpu_graph_eager_and_generate_agree(quantize, family, cache):
    model = tiny(family, dtype=torch.bfloat16)
    ref = quantized_reference(model, parse_quantize(quantize)).cuda()
    ours = asyncmoe.compile(
        copy.deepcopy(model), cache=cache, quantize=quantize, device="cuda", hybrid=False
    )
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
    # the layer output against the dequantized reference, on bf16 activations
    (_, mine), (_, theirs) = find_experts(ours)[0], find_experts(ref)[0]
    x = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([[0, 5], [7, 1], [15, 0]], device="cuda")
    w = torch.rand(3, 2, device="cuda", dtype=torch.bfloat16)
    got, want = mine(x, idx, w).float(), theirs(x, idx, w).float()
    assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 1e-2
    # a prompt's many pairs a slot: the slots dequantized, the dense path
    x, idx = (
        torch.randn(96, 32, device="cuda", dtype=torch.bfloat16),
        torch.randint(0, 16, (96, 2), device="cuda"),
    )
    w = torch.rand(96, 2, device="cuda", dtype=torch.bfloat16)
    got, want = mine(x, idx, w).float(), theirs(x, idx, w).float()
    assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 1e-2
    eager = asyncmoe.Decoder(ours, 1, 40, graph=False).generate(ids, 32).tokens
    graphed = asyncmoe.Decoder(ours, 1, 40, graph=True).generate(ids, 32).tokens
    assert torch.equal(graphed, eager)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), eager)
    torch._dynamo.reset()  # each case compiles a new model's forward: its recompiles would add up to dynamo's limit
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits, ours(ids).logits, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_fp8_checkpoint_on_the_gpu(tmp_path):
    from checkpoints import dequantized, write_fp8_checkpoint

    model = tiny("qwen3_moe", moe_intermediate_size=32)
    path = write_fp8_checkpoint(model, tmp_path, (16, 16), shards=2)
    ours = asyncmoe.from_pretrained(
        path, cache=4, dtype=torch.bfloat16, device="cuda", hybrid=False
    )
    ref = dequantized(model, (16, 16)).to("cuda", torch.bfloat16)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        got, want = ours(ids).logits.float(), ref(ids).logits.float()
    assert (got - want).abs().max() / want.pow(
        2
    ).mean().sqrt() < 5e-2  # bf16 through the whole model
    dec = asyncmoe.Decoder(ours, 1, 72)
    assert torch.equal(
        dec.generate(ids, 64).tokens,
        asyncmoe.Decoder(ours, 1, 72, graph=False).generate(ids, 64).tokens,
    )
    s = asyncmoe.stats(ours)
    assert (
        s.totals["bytes_h2d"]
        == (s.totals["misses"] + s.totals["prefetched"]) * s.layers[0].expert_bytes
    )
