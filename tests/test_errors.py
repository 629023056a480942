"""Bad input gets a clear error that says what to do."""

import pytest
import transformers

import asyncmoe
import asyncmoe.cache.host

from models import tiny


@pytest.fixture
def model():
    return tiny("mixtral")


@pytest.mark.parametrize("cache", [0, -3])
def test_cache_not_positive(model, cache):
    with pytest.raises(ValueError, match=f"cache={cache}: must be at least"):
        asyncmoe.compile(model, cache=cache)


@pytest.mark.parametrize("cache", [2.0, "16", True, None])
def test_cache_not_an_int(model, cache):
    with pytest.raises(TypeError, match="cache must be an int"):
        asyncmoe.compile(model, cache=cache)


def test_cache_below_top_k(model):
    with pytest.raises(ValueError, match=r"cache=1 is below top_k=2: every token needs its 2 experts resident at once; use cache>=2"):
        asyncmoe.compile(model, cache=1)


def test_model_without_moe_layer():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no MoE layer.*supported: the \d+ families.*mixtral"):
        asyncmoe.compile(transformers.LlamaForCausalLM(config), cache=4)


def test_family_not_on_the_experts_interface():
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    )
    model = transformers.Llama4ForCausalLM(config)
    with pytest.raises(ValueError, match=r"MoE layers \(.*Llama4TextExperts.*\) that do not use transformers' experts interface.*olmoe"):
        asyncmoe.compile(model, cache=2)


def test_unsupported_dtype(model):
    with pytest.raises(TypeError, match=r"gate_up_proj is torch.float64; asyncmoe caches experts in torch.float32, torch.bfloat16, torch.float16"):
        asyncmoe.compile(model.double(), cache=4)


def test_quantized_model(model):
    model.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match=r"this model is quantized \(fp8\).*Load it without quantization"):
        asyncmoe.compile(model, cache=4)


def test_compiled_twice(model):
    asyncmoe.compile(model, cache=4)
    with pytest.raises(RuntimeError, match="already asyncmoe-compiled: call asyncmoe.compile once per model"):
        asyncmoe.compile(model, cache=4)


def test_not_enough_host_memory(model, monkeypatch):
    monkeypatch.setattr(asyncmoe.cache.host, "available_host_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match=r"the CPU expert slots: needs \d+\.\d+ KiB of host memory but only 1000 B is available"):
        asyncmoe.compile(model, cache=4)


def test_cast_after_compile_is_refused(model):
    asyncmoe.compile(model, cache=4)
    with pytest.raises(RuntimeError, match="cannot be moved or cast.*before asyncmoe.compile"):
        model.half()
    model.to("cpu")  # a no-op move is fine


def test_stats_of_uncompiled_model(model):
    with pytest.raises(ValueError, match="not asyncmoe-compiled"):
        asyncmoe.stats(model)


def test_unknown_policy(model):
    with pytest.raises(ValueError, match="unknown cache policy 'belady'"):
        asyncmoe.compile(model, cache=4, policy="belady")
