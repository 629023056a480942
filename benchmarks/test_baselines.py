"""The baselines themselves, on the CPU: the seed cache's bookkeeping, accelerate's device map."""

import pytest
import torch

import asyncmoe

from baselines import accelerate_offload
from harness import build, decoder_for, seed_chunk
from shapes import routing_shape


def test_seed_lru_evicts_the_least_recently_used_and_raises_on_overflow():
    model = build("seed", "tiny", 2)
    provider = model.model.layers[0].mlp.experts.asyncmoe
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(1, 64)
    w = torch.ones(1, 2) / 2
    # As in the seed, a call walks its experts in id order: at [1, 0] expert 0 comes first and evicts the
    # least recently used, 1, which this very call needs next, so 1 is copied again (a miss, not a hit).
    for ids, hits in [([0, 1], 0), ([1, 2], 1), ([1, 0], 0)]:
        before = provider.hits
        provider(experts, x, torch.tensor([ids]), w)
        assert provider.hits - before == hits
    assert list(provider.lru) == [0, 1] and provider.misses == 5
    with pytest.raises(ValueError, match="exceed the 2 slots"):
        provider(experts, x.expand(2, 64), torch.tensor([[3, 4], [5, 6]]), w.expand(2, 2))


@pytest.mark.parametrize("shape", ["tiny", "tiny-deepseek"])
@pytest.mark.parametrize("slots_per_k", [1, 3])
def test_chunked_prefill_lets_the_seed_take_any_prompt(shape, slots_per_k):
    """fp32: the seed's tokens, its prompt fed `seed_chunk` tokens per call (1 at cache = top-k, where it evicts on
    nearly every token; 3 at 3 x top-k), equal the unmodified model's, and no call overflows its slots (it would
    raise). In bf16 on the GPU its tokens part early on DeepSeek-V2-Lite (bf16 rounding)."""
    cache = slots_per_k * routing_shape(shape)[1]
    assert seed_chunk(shape, 1, cache) == slots_per_k and seed_chunk(shape, 2, cache) == max(
        1, slots_per_k // 2
    )
    assert (
        seed_chunk(shape, 1, routing_shape(shape)[0]) is None
    )  # every expert in a slot: the prompt at once
    model = build("seed", shape, cache)
    ref = build("unmodified", shape, 16)
    ids = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    got = decoder_for("seed", shape, 1, cache)(model, 1, 20, graph=False).generate(ids, 5).tokens
    want = asyncmoe.Decoder(ref, 1, 20, graph=False).generate(ids, 5).tokens
    assert torch.equal(got, want)


def test_accelerate_device_map_puts_exactly_the_experts_on_the_cpu():
    model = build("unmodified", "tiny", 16)
    dm = accelerate_offload.device_map(model, "cuda:0")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for n in names:  # every tensor covered by exactly one key
        assert sum(n == k or n.startswith(k + ".") or k == "" for k in dm) == 1, n
    assert {k for k, v in dm.items() if v == "cpu"} == {
        f"model.layers.{i}.mlp.experts" for i in range(2)
    }
