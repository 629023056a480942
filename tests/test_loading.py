"""asyncmoe.from_pretrained on the CPU: sharded checkpoints in transformers' own layouts, and clear errors."""

import json
import shutil

import pytest
import torch

import asyncmoe
import asyncmoe.cache.host

from models import tiny

# per-expert w1/w2/w3 (Mixtral), per-expert gate/up/down (Qwen3-MoE, DeepSeek-V3, OLMoE), already fused (GPT-OSS)
LAYOUTS = ["mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in LAYOUTS:
        model = tiny(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, max_shard_size="100KB")
        assert len(list(path.glob("*.safetensors"))) > 2, "the test wants several shards"
        out[family] = (model, path)
    return out


@pytest.mark.parametrize("family", LAYOUTS)
@torch.no_grad()
def test_loaded_model_equals_the_saved_one(checkpoints, family, capsys):
    original, path = checkpoints[family]
    model = asyncmoe.from_pretrained(path, cache=4, dtype=torch.float32, device="cpu")
    assert "experts of 2 of 2 MoE layers in host memory" in capsys.readouterr().out
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 9), (1, 1), (3, 4)]:
        ids = torch.randint(3, 128, shape, generator=g)
        assert (model(ids).logits - original(ids).logits).abs().max().item() <= 1e-5
    assert asyncmoe.stats(model).totals["misses"] > 0


def test_missing_shard(checkpoints, tmp_path):
    _, path = checkpoints["qwen3_moe"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing 1 of the \d+ shards.*{shard.name}.*download the checkpoint again"):
        asyncmoe.from_pretrained(tmp_path, cache=4, device="cpu")


def test_shape_mismatch(checkpoints, tmp_path):
    _, path = checkpoints["qwen3_moe"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["moe_intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers' own check, with its report
        asyncmoe.from_pretrained(tmp_path, cache=4, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_dtype_we_cannot_run(checkpoints, dtype):
    with pytest.raises(TypeError, match=rf"dtype={dtype}: asyncmoe runs experts in torch.float32, torch.bfloat16"):
        asyncmoe.from_pretrained(checkpoints["olmoe"][1], cache=4, dtype=dtype, device="cpu")


def test_not_enough_host_memory(checkpoints, monkeypatch):
    monkeypatch.setattr(asyncmoe.cache.host, "available_host_bytes", lambda: 10_000)
    with pytest.raises(MemoryError, match=r"loading .* in torch.bfloat16: needs \d+\.\d+ KiB of host memory but only 9.77 KiB"):
        asyncmoe.from_pretrained(checkpoints["olmoe"][1], cache=4, device="cpu")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is not a transformers checkpoint: it has no config.json"):
        asyncmoe.from_pretrained(tmp_path, cache=4, device="cpu")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights"):
        asyncmoe.from_pretrained(tmp_path, cache=4, device="cpu")
