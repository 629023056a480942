"""Quantized checkpoints of tiny models, written as the releases are: fine-grained FP8 (DeepSeek-V3, Qwen3 FP8,
Mixtral FP8) and MXFP4 (GPT-OSS).

Every linear weight but the routers, embeddings and lm_head is stored as float8_e4m3fn with float32
`weight_scale_inv` per block; the config carries transformers' fine-grained FP8 quantization_config.
`dequantized` is the reference: the same model with every such weight replaced by its dequantized value.
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncmoe.formats import SCALE, dequantize_fp8, quantize_fp8

KEEP = (
    "embed_tokens",
    "lm_head",
    "norm",
    "mlp.gate.",
    "block_sparse_moe.gate.",
)  # as the releases keep them


def quantized_key(key: str, tensor: torch.Tensor) -> bool:
    return key.endswith(".weight") and tensor.dim() == 2 and not any(k in key for k in KEEP)


def write_fp8_checkpoint(
    model, path: pathlib.Path, block=(128, 128), shards: int = 3
) -> pathlib.Path:
    """Save `model` as a sharded fp8 checkpoint at `path`, in its release layout (per-expert tensors)."""
    tensors = _saved(model, path)
    out = {}
    for key, t in tensors.items():
        if quantized_key(key, t):
            q, s = quantize_fp8(t, block)
            out[key], out[key[: -len(".weight")] + ".weight" + SCALE] = q, s
        else:
            out[key] = t
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return _write(path, out, shards, quant)


def _saved(model, path: pathlib.Path) -> dict[str, torch.Tensor]:
    """`model` saved at `path` by transformers (its release layout), its tensors read back and the file removed."""
    model.save_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (path / "model.safetensors").unlink()
    return tensors


def _write(
    path: pathlib.Path, tensors: dict[str, torch.Tensor], shards: int, quant: dict
) -> pathlib.Path:
    """`tensors` as `shards` safetensors files with their index, and `quant` as the config's quantization_config."""
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def dequantized(model, block=(128, 128)):
    """A copy of `model` whose weights are what the fp8 checkpoint stores, dequantized: the reference."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if (
                p.dim() == 3 and ".experts." in name + "."
            ):  # fused experts [E, N, K]: quantized per expert
                q, s = quantize_fp8(p, block)
                p.copy_(dequantize_fp8(q, s, block, p.dtype))
            elif quantized_key(name, p):
                q, s = quantize_fp8(p, block)
                p.copy_(dequantize_fp8(q, s, block, p.dtype))
    return ref


def write_mxfp4_checkpoint(model, path: pathlib.Path, shards: int = 2) -> pathlib.Path:
    """Save a GPT-OSS `model` as its releases ship it: each experts module's `gate_up_proj` and `down_proj` as
    `<name>_blocks` [E, N, K/32, 16] uint8 (e2m1 pairs, the even input in the low nibble) and `<name>_scales`
    [E, N, K/32] uint8 (e8m0), N the outputs and K the inputs; everything else as saved."""
    from asyncmoe.formats import quantize_mxfp4

    tensors = _saved(model, path)
    out = {}
    for key, t in tensors.items():
        if key.endswith(
            (".experts.gate_up_proj", ".experts.down_proj")
        ):  # [E, K, N], the module's layout
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # [E, N, K/2], [E, N, K/32]
            out[key + "_blocks"] = blocks.unflatten(-1, (-1, 16))
            out[key + "_scales"] = scales
        else:
            out[key] = t
    quant = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return _write(path, out, shards, quant)


def mxfp4_dequantized(model):
    """A copy of the GPT-OSS `model` whose experts are what its mxfp4 checkpoint stores, dequantized."""
    from asyncmoe.formats import dequantize_mxfp4, quantize_mxfp4

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))
                p.copy_(dequantize_mxfp4(blocks, scales, p.dtype).transpose(1, 2))
    return ref
