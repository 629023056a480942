"""asyncmoe.Decoder on the CPU (eager steps): same tokens as transformers' generate, sampling, validation."""

import copy

import pytest
import torch

import asyncmoe

from models import tiny


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_greedy_equals_transformers_generate(family, batch):
    ref = tiny(family)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=batch, max_length=48)
    ids = torch.randint(3, 128, (batch, 7), generator=torch.Generator().manual_seed(batch))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    out = dec.generate(ids, 24)
    assert torch.equal(out.tokens, ref.generate(ids, **kw))
    assert out.new_tokens == 24 and out.decode_ms_per_token > 0
    assert torch.equal(dec.generate(ids, 24).tokens, out.tokens)  # a second call reuses everything


@torch.no_grad()
def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = asyncmoe.compile(tiny("mixtral"), cache=4)
    dec = asyncmoe.Decoder(model, batch_size=2, max_length=40)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(do_sample=True, temperature=0.9, top_p=0.8, seed=3)
    a, b = dec.generate(ids, 20, **kw), dec.generate(ids, 20, **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, dec.generate(ids, 20, do_sample=True, temperature=5.0, seed=4).tokens)
    greedy = dec.generate(ids, 20)
    assert torch.equal(dec.generate(ids, 20, do_sample=True, top_k=1, seed=1).tokens, greedy.tokens)
    streamed = []
    dec.generate(ids, 6, callback=streamed.append)
    assert streamed == [greedy.tokens[:, 5 + i].tolist() for i in range(6)]


def test_capture_needs_slots_for_the_whole_batch():
    model = asyncmoe.compile(tiny("olmoe"), cache=4)  # top-2: batch 4 may touch 8 experts per layer
    with pytest.raises(ValueError, match=r"batch 4 needs cache >= min\(num_experts=16, batch\*top_k=8\) = 8 .*Use cache>=8, or batch_size<=2, or Decoder\(..., waves=True\)"):
        asyncmoe.Decoder(model, batch_size=4, graph=True)
    asyncmoe.Decoder(model, batch_size=4, graph=True, waves=True)  # asked for: the graph runs 2 waves per layer


def test_prompt_too_long():
    dec = asyncmoe.Decoder(asyncmoe.compile(tiny("olmoe"), cache=4), max_length=10)
    with pytest.raises(ValueError, match="exceeds max_length=10"):
        dec.generate(torch.ones(1, 6, dtype=torch.long), 8)
