"""Installing asyncmoe into a model (integrations/install.py): compile's checks give clear errors that say what
to do; the experts move to the host store; on a GPU its memory drops by the offloaded bytes."""

import pytest
import torch
import transformers

import asyncmoe
import asyncmoe.cache.host
from asyncmoe.integrations.install import activation_bytes, install, kv_cache_bytes
from asyncmoe.integrations.transformers import find_experts
from asyncmoe.providers import CachedProvider, ResidentProvider
from asyncmoe.settings import Settings

from models import tiny


@pytest.fixture
def model():
    return tiny("mixtral")


def test_cache_negative(model):
    with pytest.raises(ValueError, match="cache=-3: give slots per MoE layer"):
        asyncmoe.compile(model, cache=-3)


@pytest.mark.parametrize("cache", [2.0, True, None])
def test_cache_not_an_int(model, cache):
    with pytest.raises(TypeError, match="cache must be an int"):
        asyncmoe.compile(model, cache=cache)


@pytest.mark.parametrize("cache", ["16", "6 parsecs"])
def test_cache_a_string_that_is_no_budget(model, cache):
    with pytest.raises(
        ValueError,
        match=rf"cache='{cache}': give slots per MoE layer as an int \(cache=16, or 0: every routed "
        r"expert on the CPU\), a GPU-memory budget",
    ):
        asyncmoe.compile(model, cache=cache)


def test_cache_below_top_k(model):
    with pytest.raises(
        ValueError,
        match=r"cache=1 is below top_k=2: every token needs its 2 experts resident at once; use cache>=2",
    ):
        asyncmoe.compile(model, cache=1)


def test_model_without_moe_layer():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM has no MoE layer.*supported: the \d+ families.*mixtral"
    ):
        asyncmoe.compile(transformers.LlamaForCausalLM(config), cache=4)


def test_family_not_on_the_experts_interface():
    config = transformers.Llama4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        intermediate_size_mlp=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
    )
    model = transformers.Llama4ForCausalLM(config)
    with pytest.raises(
        ValueError,
        match=r"MoE layers \(.*Llama4TextExperts.*\) that do not use transformers' experts interface.*olmoe",
    ):
        asyncmoe.compile(model, cache=2)


def test_unsupported_dtype(model):
    with pytest.raises(
        TypeError,
        match=r"gate_up_proj is torch.float64; asyncmoe caches experts in torch.float32, torch.bfloat16, torch.float16",
    ):
        asyncmoe.compile(model.double(), cache=4)


def test_quantized_model(model):
    model.config.quantization_config = {"quant_method": "gptq"}
    with pytest.raises(
        ValueError,
        match=r"this model is quantized \(gptq\); asyncmoe keeps experts in .*Load it dequantized",
    ):
        asyncmoe.compile(model, cache=4)


def test_compiled_twice(model):
    asyncmoe.compile(model, cache=4)
    with pytest.raises(
        RuntimeError, match="already asyncmoe-compiled: call asyncmoe.compile once per model"
    ):
        asyncmoe.compile(model, cache=4)


def test_not_enough_host_memory(model, monkeypatch):
    monkeypatch.setattr(asyncmoe.cache.host, "available_host_bytes", lambda: 1000)
    with pytest.raises(
        MemoryError,
        match=r"the CPU expert slots: needs \d+\.\d+ KiB of host memory but only 1000 B is available",
    ):
        asyncmoe.compile(model, cache=4)


def test_unknown_policy(model):
    with pytest.raises(ValueError, match="unknown cache policy 'belady'"):
        asyncmoe.compile(model, cache=4, policy="belady")


@pytest.mark.parametrize("prefetch", ["gate", 1, ("gate",)])
def test_prefetch_of_the_wrong_type(model, prefetch):
    with pytest.raises(
        TypeError,
        match=r"prefetch must be True, False, None .* or an asyncmoe.Prefetch, got .*"
        r"asyncmoe.Prefetch\(sources=",
    ):
        asyncmoe.compile(model, cache=4, prefetch=prefetch)


def test_cuda_without_a_gpu(model):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: device='cuda' is valid here")
    with pytest.raises(
        ValueError, match=r"device='cuda', but torch sees no CUDA GPU here.*use device='cpu'"
    ):
        asyncmoe.compile(model, cache=4, device="cuda")
    assert not hasattr(find_experts(model)[0][1], "asyncmoe")  # refused before anything moved


@pytest.mark.parametrize(
    "device, message",
    [
        ("meta", "device='meta': asyncmoe runs on 'cuda' or 'cpu'"),
        ("tpu", "device='tpu' is not a torch device .*; use 'cuda', 'cuda:0' or 'cpu'"),
    ],
)
def test_a_device_asyncmoe_does_not_run_on(model, device, message):
    with pytest.raises(ValueError, match=message):
        asyncmoe.compile(model, cache=4, device=device)


def test_time_stalls_needs_cuda(model):
    with pytest.raises(
        ValueError,
        match="time_stalls reads the GPU's clock, so it needs a CUDA device; this model runs on cpu",
    ):
        asyncmoe.compile(model, cache=4, time_stalls=True, device="cpu")


@torch.no_grad()
def test_offloaded_experts_are_plain_attributes_kept_in_the_state_dict(model):
    """An offloaded tensor is no longer a parameter (so `model.to()` leaves it), `state_dict` still returns it,
    and a CPU cache reads the parameters where they were: no copy."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    experts = find_experts(model)[0][1]
    data_ptr = experts.gate_up_proj.data_ptr()
    install(model, Settings(cache=4, policy="lru", prefetch=False))
    assert (
        "gate_up_proj" not in dict(experts.named_parameters())
        and experts.gate_up_proj.data_ptr() == data_ptr
    )
    assert experts.asyncmoe.cache.host_gate_up_proj.data_ptr() == data_ptr
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_every_cached_layer_is_built_as_asked(model):
    asyncmoe.compile(
        model, cache=4, policy="fifo", prefetch=asyncmoe.Prefetch(sources=("transition",), depth=1)
    )
    providers = [m.asyncmoe for _, m in find_experts(model)]
    assert all(isinstance(p, CachedProvider) for p in providers)
    assert [(p.cache.num_slots, p.cache.policy) for p in providers] == [(4, "fifo")] * 2
    assert providers[0].prefetch is None and providers[1].prefetch.transitions.shape == (
        16,
        16,
    )  # the layer before
    assert providers[0].cache.pace is providers[1].cache.pace
    assert model.config._experts_implementation == "asyncmoe"


@pytest.mark.cuda
@torch.no_grad()
def test_gpu_memory_drops_by_the_offloaded_bytes():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=64,
        num_experts_per_tok=8,
    )
    model = OlmoeForCausalLM(config).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    experts = [m for _, m in find_experts(model)]
    offloaded = sum(
        p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False)
    )
    asyncmoe.compile(model, cache=16)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    caches = [m.asyncmoe.cache for m in experts]
    added = sum(
        b.numel() * b.element_size()
        for c in caches
        for n, b in c.named_buffers()
        if not n.startswith("host_")
    )
    assert before - after >= offloaded - added - 2**20, (before, after, offloaded, added)
    assert added < offloaded / 3  # 16 of 64 slots plus small tables
    print(
        f"\nGPU memory: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; experts {offloaded / 2**20:.1f} MiB, "
        f"slots+tables {added / 2**20:.1f} MiB"
    )
    model(torch.randint(0, 1024, (1, 8), device="cuda"))  # and it still runs


def test_two_models_from_one_config():
    """`from_config(cfg)` twice: compiling one (cached, then the other resident) leaves each its own
    implementation, and the shared config as it was."""
    first = tiny("mixtral")
    config = first.config
    torch.manual_seed(1)
    second = type(first)(config).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        want_first, want_second = first(ids).logits, second(ids).logits
    asyncmoe.compile(first, cache=4)
    assert config._experts_implementation != "asyncmoe"
    asyncmoe.compile(second, cache=16)  # every expert resident: the model's own implementation
    with torch.no_grad():
        torch.testing.assert_close(first(ids).logits, want_first)
        torch.testing.assert_close(second(ids).logits, want_second)
    assert first.config is not config and second.config is not config
    assert all(m.config is first.config for _, m in find_experts(first))


def test_config_that_names_asyncmoe_but_was_never_compiled(model):
    model.config._experts_implementation = "asyncmoe"
    with pytest.raises(
        ValueError, match="names the 'asyncmoe' experts implementation, but the module was never"
    ):
        asyncmoe.compile(model, cache=16)


def test_auto_needs_a_gpu(model):
    with pytest.raises(
        ValueError, match=r"cache='auto' sizes the slots from the GPU memory free.*runs on cpu"
    ):
        asyncmoe.compile(model, cache="auto", device="cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_length=0), r"AutoCache\(max_length=0\)"),
        (dict(batch_size=0), r"AutoCache\(batch_size=0\)"),
        (dict(share=1.5), r"AutoCache\(share=1.5\)"),
    ],
)
def test_auto_cache_checks_its_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asyncmoe.AutoCache(**kwargs)


def test_room_left_for_the_kv_cache_grows_with_length_and_batch():
    config = tiny("mixtral").config  # 2 layers, 2 KV heads of 8 dims
    assert kv_cache_bytes(config, 100, 3, 2) == 2 * 3 * 100 * 2 * (8 + 8) * 2
    assert activation_bytes(config, 200, 1, 2) > activation_bytes(config, 100, 1, 2)


@pytest.mark.cuda
def test_auto_fits_free_gpu_memory(capsys):
    """cache=AutoCache(...) takes the slots that fit in free GPU memory less the Decoder's room (here every
    expert, resident), says so in slots and GiB, and the model runs as before."""
    model = tiny("mixtral", dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        want = model.to("cuda")(ids.cuda()).logits
    asyncmoe.compile(model, cache=asyncmoe.AutoCache(max_length=64), device="cuda")
    said = capsys.readouterr().out
    assert (
        "gives 16 slots per MoE layer" in said
        and "GiB free on cuda" in said
        and "max_length=64" in said
    )
    assert all(isinstance(m.asyncmoe, ResidentProvider) for _, m in find_experts(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.cuda()).logits, want)


def test_auto_leaves_room_to_dequantize_one_layers_slots(monkeypatch, capsys):
    """AutoCache(max_length=...) with quantized experts keeps, beside the slots, one layer's slots in the compute
    dtype: a prompt dequantizes them at once (compute/experts.py). The budget auto_budget finds is given: no GPU."""
    import asyncmoe.integrations.install as install_module
    from asyncmoe.formats import Int4
    from asyncmoe.integrations.offload import expert_size

    model = tiny("mixtral", dtype=torch.bfloat16)
    experts = find_experts(model)
    L, E = len(experts), 16
    packed, dense = expert_size(experts[0][1], Int4()), expert_size(experts[0][1], None)
    budget = 6 * (L * packed + dense)  # 6 slots a layer and one layer's 6 dequantized
    monkeypatch.setattr(install_module, "auto_budget", lambda *a: (budget, ""))
    auto, cuda = asyncmoe.AutoCache(max_length=8), torch.device("cuda")
    assert install_module._slots(Settings(cache=auto), model, experts, Int4(), cuda) == 6
    assert "to dequantize one layer's slots" in capsys.readouterr().out
    # without the room the same budget holds more slots; dense slots need none
    no_room = asyncmoe.AutoCache(share=0.5)
    assert install_module._slots(Settings(cache=no_room), model, experts, Int4(), cuda) == min(
        E, budget // (L * packed)
    )
    assert install_module._slots(Settings(cache=auto), model, experts, None, cuda) == min(
        E, budget // (L * dense)
    )
