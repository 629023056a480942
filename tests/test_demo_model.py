"""The embedded demo model (api.demo_model_path): present, small, OLMoE's routing shape; transformers still writes
its committed example, and asyncmoe's decoder writes what transformers writes from the same weights."""

import json

import torch
import transformers

import asyncmoe

NEW_TOKENS = 64


def load_example():
    path = asyncmoe.demo_model_path()
    example = json.loads((path / "examples.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
    return path, example, tokenizer, ids


def test_demo_model_is_a_small_olmoe_shaped_checkpoint():
    path = asyncmoe.demo_model_path()
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("olmoe", 64, 8)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 40 * 2**20


@torch.no_grad()
def test_demo_model_generates_its_committed_greedy_example():
    """examples.json was written by scripts/train_demo_model.py from the saved weights, in fp32 on the CPU, as
    here. The model directory records the transformers version that saved it (config.json), not torch's: a
    different greedy string may come from another torch's CPU kernels, so the message names both."""
    path, example, tokenizer, ids = load_example()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    saved_by = json.loads((path / "config.json").read_text()).get(
        "transformers_version", "an unrecorded version"
    )
    assert tokenizer.decode(out[0]) == example["greedy"], (
        f"the committed example was made in fp32 on the CPU by transformers {saved_by} (torch's version is not "
        f"recorded); this is transformers {transformers.__version__}, torch {torch.__version__}"
    )


@torch.no_grad()
def test_compiled_demo_model_generates_what_transformers_generates():
    """asyncmoe's decoder (8 of 64 slots, fp32 on the CPU) against transformers' own greedy generate on the same
    loaded weights: the same tokens, or parting only where transformers' own two best logits tie to the 1e-5
    the logits agree to."""
    path, example, tokenizer, ids = load_example()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = ref.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    model = asyncmoe.from_pretrained(
        path, cache=8, dtype=torch.float32, device="cpu", prefetch=True
    )
    got = asyncmoe.Decoder(model, 1, ids.shape[1] + NEW_TOKENS).generate(ids, NEW_TOKENS).tokens[0]
    w, o = want.sequences[0, ids.shape[1] :], got[ids.shape[1] :]
    assert o.shape == w.shape == (NEW_TOKENS,)
    parted = (w != o.to(w.device)).nonzero()
    if len(parted):
        t = parted[0].item()
        logits = want.logits[t][0]
        gap = (logits[w[t]] - logits[o[t]]).item()
        assert gap <= 1e-5, (
            f"parts from transformers at new token {t} of {NEW_TOKENS}, {gap:.2e} below its best"
        )
    assert asyncmoe.stats(model).totals["misses"] > 0  # the cache was in play
