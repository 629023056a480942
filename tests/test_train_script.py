"""scripts/train_demo_model.py end to end at toy size: it trains, saves a loadable model, reports."""

import json
import runpy
import sys

import pytest
import torch
import transformers


@pytest.mark.slow
def test_training_script_smoke(tmp_path, monkeypatch):
    argv = [
        "train_demo_model.py",
        "--out",
        str(tmp_path),
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "32",
        "--device",
        "cpu",
        "--max-files",
        "8",
        "--vocab",
        "512",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path("scripts/train_demo_model.py", run_name="__main__")
    report = json.loads((tmp_path / "training.json").read_text())
    assert (
        report["steps"] == 3
        and report["validation_perplexity"] > 1
        and report["unigram_perplexity"] > 1
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.num_experts == 64 and model.config.num_experts_per_tok == 8
    assert model.dtype == torch.bfloat16
    assert "greedy" in json.loads((tmp_path / "examples.json").read_text())
