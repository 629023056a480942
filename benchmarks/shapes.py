"""The model shapes the benchmarks run, as random-weight transformers models (no hub: config classes only).

random_model("olmoe-1b-7b", torch.bfloat16, "cuda")
random_mxfp4_model("gpt-oss-120b", torch.bfloat16, "cuda")  # experts only ever in MXFP4, on the host
"""

from __future__ import annotations

import functools

import torch
import transformers

from asyncmoe.cache.host import check_host_memory
from asyncmoe.formats import Mxfp4, weight_names
from asyncmoe.integrations.offload import expert_size
from asyncmoe.integrations.quantized_checkpoint import put_fused_experts
from asyncmoe.integrations.transformers import find_experts, find_router, num_experts

SHAPES = {  # (config class, config); random weights, real shapes
    "tiny": (
        "OlmoeConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=16,
            num_experts_per_tok=2,
        ),
    ),
    "tiny-deepseek": (
        "DeepseekV2Config",
        dict(  # the DeepSeek-V2 layout (MLA, shared experts, a first dense layer)
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    "olmoe-1b-7b": (
        "OlmoeConfig",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
        ),
    ),
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        dict(  # 31.4 GB bf16, 26 MoE layers
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            first_k_dense_replace=1,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(  # 61.1 GB bf16, 48 MoE layers
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    # 24 of Mixtral-8x7B's 32 layers: 68 GB of experts, what the 128 GB GPU host can pin beside the rest
    "mixtral-8x7b-24l": (
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=24,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
    "gpt-oss-20b": (  # 38.2 GB of bf16 experts, 24 MoE layers; released with MXFP4 experts
        "GptOssConfig",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
        ),
    ),
    # 229 GB of bf16 experts, 61.0 GB in MXFP4, 36 MoE layers: its experts exist only in MXFP4 (random_mxfp4_model).
    # The rest (YaRN rope, attention biases, clamped SwiGLU, an untied lm_head) are GptOssConfig's defaults: 120B's
    "gpt-oss-120b": (
        "GptOssConfig",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=36,
            num_local_experts=128,
            num_experts_per_tok=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
        ),
    ),
    "tiny-gpt-oss": (  # GPT-OSS's layout at the tiny shape's size, for random_mxfp4_model on the CPU
        "GptOssConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
        ),
    ),
}


def config(shape: str, **overrides) -> transformers.PretrainedConfig:
    """`shape`'s config; `overrides` replace its fields (a test's fewer layers of the same shape)."""
    config_cls, kw = SHAPES[shape]
    return getattr(transformers, config_cls)(
        **(kw | overrides), pad_token_id=0, bos_token_id=None, eos_token_id=None
    )


@functools.cache
def dense_experts(shape: str) -> tuple[int, int]:
    """(MoE layers, bytes of one expert in bf16), read off the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(shape), dtype=torch.bfloat16)
    experts = find_experts(model)
    _, m = experts[0]
    return len(experts), sum(p[0].numel() * p.element_size() for p in m.parameters(recurse=False))


def routing_shape(shape: str) -> tuple[int, int]:
    kw = SHAPES[shape][1]
    experts = kw.get("num_experts") or kw.get("n_routed_experts") or kw["num_local_experts"]
    return experts, kw["num_experts_per_tok"]


def expert_dims(shape: str) -> tuple[int, int]:
    """(hidden size D, one expert's intermediate size I): its gate_up is [2I, D] and its down [D, I]."""
    kw = SHAPES[shape][1]
    return kw["hidden_size"], kw.get("moe_intermediate_size", kw["intermediate_size"])


def random_model(
    shape: str, dtype: torch.dtype, device: torch.device | str, **overrides
) -> torch.nn.Module:
    """The same weights every time (seeded init on `device`), built as a checkpoint load builds a model
    (`from_config(dtype=...)` keeps the rotary tables fp32; `.to(bf16)` would not). Random routers send
    every token to the same few experts, so they are widened (std 1) to spread tokens. `overrides`: the
    config's fields to replace."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config(shape, **overrides), dtype=dtype
        ).eval()
    with torch.no_grad():
        for name, m in find_experts(model):
            find_router(model, name, m)[0].normal_(0, 1.0)
    return model


# e8m0 exponents of random_mxfp4_model's scales, drawn uniformly: uniform e2m1 codes have an rms of 2.93, so
# weights of rms 0.018, about the 0.02 random_model's init gives experts
MXFP4_EXPONENTS = (-8, -7)


def random_mxfp4_model(
    shape: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> torch.nn.Module:
    """A model of `shape` whose experts exist only in MXFP4, for shapes whose experts do not fit in `dtype`
    (GPT-OSS-120B's are 229 GB in bf16). Built on the meta device; every other weight is made on `device` and
    initialized as transformers initializes a model (routers widened as in `random_model`); then each experts
    module gets random codes and scales in an MXFP4 checkpoint's layout through asyncmoe's checkpoint reader
    (`put_fused_experts`), one layer at a time, in host memory. Compile it with `quantize="mxfp4"` and
    `device=device`: the host store then takes each layer's tensors and frees them, so host memory peaks at the
    store plus one layer."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(shape), dtype=dtype).eval()
    experts = find_experts(model)
    # before any of it is made: a previous model's store not yet freed would otherwise meet the OOM killer
    store = sum(expert_size(m, Mxfp4()) * num_experts(m) for _, m in experts)
    check_host_memory(store, f"the random MXFP4 experts of {shape}")
    skip = {id(m) for _, m in experts}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in skip:
                continue
            for name, p in module.named_parameters(recurse=False):
                t = torch.empty_like(p, device=device)
                module._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            for name, b in module.named_buffers(recurse=False):
                module._buffers[name] = torch.empty_like(b, device=device)
            model._init_weights(module)  # what from_pretrained does with weights a checkpoint lacks
        model.tie_weights()
        for name, m in experts:
            find_router(model, name, m)[0].normal_(0, 1.0)
            put_fused_experts(m, Mxfp4(), random_mxfp4_tensors(m, device), source=name)
    return model


def random_mxfp4_tensors(m: torch.nn.Module, device: torch.device | str) -> dict[str, torch.Tensor]:
    """An experts module's tensors as GPT-OSS's checkpoints store them, random and on the CPU: each weight [E, N, K]
    (N outputs, K inputs) as `<name>_blocks` [E, N, K/32, 16] (uniform e2m1 codes, two a byte) and `<name>_scales`
    [E, N, K/32] (e8m0, 2 ** MXFP4_EXPONENTS); biases normal(0, 0.02). Drawn on `device` one tensor at a time: on a
    GPU, GPT-OSS-120B's 61 GB come from its generator rather than the CPU's."""
    lo, hi = MXFP4_EXPONENTS
    out = {}
    for name, p in m.named_parameters(recurse=False):
        if name not in weight_names(m):
            out[name] = (torch.randn(p.shape, dtype=p.dtype, device=device) * 0.02).cpu()
            continue
        (_, (E, N, half), _), (_, scales, _) = Mxfp4().stored(name, p.shape, m.is_transposed)
        codes = torch.randint(0, 256, (E, N, half // 16, 16), dtype=torch.uint8, device=device)
        out[name + "_blocks"] = codes.cpu()
        del codes
        exponents = torch.randint(127 + lo, 127 + hi + 1, scales, dtype=torch.uint8, device=device)
        out[name + "_scales"] = exponents.cpu()
    return out
