"""Quantized checkpoints (integrations/quantized_checkpoint.py): experts kept quantized from the files to the slots,
outputs equal to the dequantize-then-compute reference and to transformers' own dequantizing load."""

import json

import pytest
import torch
import transformers

import asyncmoe
from asyncmoe.formats import FP8
from asyncmoe.integrations.transformers import find_experts

from checkpoints import dequantized, write_fp8_checkpoint
from models import tiny

BLOCK = (16, 16)
FAMILIES = {  # the families whose releases ship fp8 experts, with every dimension a whole number of blocks
    "deepseek_v3": dict(
        moe_intermediate_size=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=16,
    ),
    "qwen3_moe": dict(moe_intermediate_size=32),
    "mixtral": dict(intermediate_size=64),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    model = tiny(request.param, **FAMILIES[request.param])
    path = write_fp8_checkpoint(model, tmp_path_factory.mktemp(request.param), BLOCK, shards=3)
    return request.param, model, path


def test_experts_stay_fp8_and_outputs_equal_the_reference(checkpoint, capsys):
    family, model, path = checkpoint
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    assert "experts (fp8) of 2 of 2 MoE layers" in capsys.readouterr().out
    for _, m in find_experts(ours):
        up = "gate_up_proj" if m.has_gate else "up_proj"
        assert getattr(m, up).dtype == FP8 and getattr(m, up + "_scale_inv").dtype == torch.float32
        assert m.asyncmoe.cache.slot_weights()[up].dtype == FP8
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    reference = dequantized(model, BLOCK)
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    s = asyncmoe.stats(ours)
    dense_bytes = sum(
        p[0].numel() * 2 for _, m in find_experts(model)[:1] for p in m.parameters(recurse=False)
    )
    assert (
        s.layers[0].expert_bytes < 0.6 * dense_bytes
    )  # about half of bf16's: fp8 bytes plus their scales
    assert (
        s.totals["bytes_h2d"] == s.totals["misses"] * s.layers[0].expert_bytes
    )  # misses copy the fp8 bytes


def test_equals_transformers_own_dequantizing_load(checkpoint):
    pytest.importorskip("accelerate")  # transformers loads fine-grained FP8 through it
    family, _, path = checkpoint
    config = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    )
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_the_reference_in_generate_and_the_decoder(checkpoint):
    family, model, path = checkpoint
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    reference = dequantized(model, BLOCK)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **kw)
    assert torch.equal(ours.generate(ids, **kw), want)
    assert torch.equal(asyncmoe.Decoder(ours, 1, 80).generate(ids, 64).tokens, want)


@pytest.mark.cuda
@torch.no_grad()
def test_greedy_tokens_equal_the_reference_on_the_gpu(checkpoint):
    """fp32 activations through the fp8 GEMV kernel: eager, the Decoder's graph and generate give the reference's
    64 greedy tokens (dequantized weights, transformers' own compute; TF32 off, as by default)."""
    family, model, path = checkpoint
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cuda", hybrid=False)
    reference = dequantized(model, BLOCK).cuda()
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **kw)
    assert torch.equal(ours.generate(ids, **kw), want)
    assert torch.equal(asyncmoe.Decoder(ours, 1, 80, graph=False).generate(ids, 64).tokens, want)
    assert torch.equal(asyncmoe.Decoder(ours, 1, 80, graph=True).generate(ids, 64).tokens, want)


def test_dequantize_loads_the_experts_in_the_compute_dtype(checkpoint):
    family, model, path = checkpoint
    ours = asyncmoe.from_pretrained(
        path, cache=4, dtype=torch.float32, device="cpu", quantize="dequantize"
    )
    for _, m in find_experts(ours):
        assert all(t.dtype == torch.float32 for t in m.asyncmoe.cache.slots)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        ours(ids).logits, dequantized(model, BLOCK)(ids).logits, atol=1e-5, rtol=1e-5
    )


def test_partial_blocks_at_the_edges(tmp_path):
    """DeepSeek-V3's own kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128: the last block is partial."""
    model = tiny(
        "deepseek_v3", moe_intermediate_size=32
    )  # kv_a_proj_with_mqa: 24 rows, 1.5 blocks of 16
    path = write_fp8_checkpoint(model, tmp_path, BLOCK, shards=2)
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, 128, (1, 9))
    torch.testing.assert_close(
        ours(ids).logits, dequantized(model, BLOCK)(ids).logits, atol=1e-5, rtol=1e-5
    )


def test_a_missing_scale_is_named(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = write_fp8_checkpoint(
        tiny("qwen3_moe", moe_intermediate_size=32), tmp_path, BLOCK, shards=1
    )
    shard = next(path.glob("model-*.safetensors"))
    with safe_open(shard, "pt") as f:
        tensors = {
            k: f.get_tensor(k)
            for k in f.keys()
            if k != "model.layers.1.self_attn.q_proj.weight_scale_inv"
        }
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.q_proj.weight_scale_inv"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"fp8 tensor model.layers.1.self_attn.q_proj.weight has no .*_scale_inv"
    ):
        asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")


def test_dequantize_needs_an_fp8_checkpoint(tmp_path):
    tiny("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantize=.dequantize. reads quantized checkpoints"):
        asyncmoe.from_pretrained(
            tmp_path, cache=4, dtype=torch.float32, device="cpu", quantize="dequantize"
        )


def test_gpt_oss_mxfp4_checkpoint_stays_4_bit(tmp_path, capsys):
    """GPT-OSS's released layout (`*_blocks`, `*_scales`), its biases, clamped SwiGLU and router on the 4-bit path."""
    from checkpoints import mxfp4_dequantized, write_mxfp4_checkpoint

    model = tiny("gpt_oss")
    path = write_mxfp4_checkpoint(model, tmp_path, shards=2)
    ours = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    assert "experts (mxfp4) of 2 of 2 MoE layers" in capsys.readouterr().out
    for _, m in find_experts(ours):
        assert m.gate_up_proj.dtype == torch.uint8 and m.gate_up_proj_scales.dtype == torch.uint8
        assert m.asyncmoe.cache.slot_weights()["down_proj"].dtype == torch.uint8
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = mxfp4_dequantized(model)
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:1], **kw), reference.generate(ids[:1], **kw))
    pytest.importorskip("accelerate")
    config = transformers.Mxfp4Config(dequantize=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    )
    # transformers' dequantization of the same files is the reference's, tensor for tensor ...
    want = reference.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in theirs.state_dict().items())
    # ... and its model's output ours (5.17's dequantized GPT-OSS sums its experts in another order: within 1e-2)
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-2, rtol=1e-2)


def test_a_quantized_checkpoint_is_not_requantized(tmp_path):
    from checkpoints import write_mxfp4_checkpoint

    path = write_mxfp4_checkpoint(tiny("gpt_oss"), tmp_path)
    with pytest.raises(
        ValueError, match="stores its experts in mxfp4: quantize='fp8' would re-quantize them"
    ):
        asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu", quantize="fp8")


@torch.no_grad()
def test_cache_0_computes_the_checkpoint_as_stored(checkpoint, capsys):
    """fp8 experts read from the checkpoint as stored, computed by the CPU: the slot path's logits."""
    family, _, path = checkpoint
    ours = asyncmoe.from_pretrained(path, cache=0, dtype=torch.float32, device="cpu", cpu_threads=2)
    assert "computed on the CPU" in capsys.readouterr().out
    slots = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(ids).logits, slots(ids).logits, atol=1e-4, rtol=1e-4)
