"""The embedded demo model: present, small, OLMoE's routing shape, and it still writes its committed example."""

import json

import torch
import transformers

import asyncmoe


def test_demo_model_is_a_small_olmoe_shaped_checkpoint():
    path = asyncmoe.demo_model_path()
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("olmoe", 64, 8)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 40 * 2**20


def test_demo_model_generates_its_committed_greedy_example():
    path = asyncmoe.demo_model_path()
    example = json.loads((path / "examples.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(out[0]) == example["greedy"]


def test_compiled_demo_model_generates_the_same_example():
    path = asyncmoe.demo_model_path()
    example = json.loads((path / "examples.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = asyncmoe.from_pretrained(path, cache=8, dtype=torch.float32, device="cpu")
    ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
    out = asyncmoe.Decoder(model, 1, ids.shape[1] + 64).generate(ids, 64)
    assert tokenizer.decode(out.tokens[0]) == example["greedy"]
