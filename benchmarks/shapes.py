"""The model shapes the benchmarks run, as random-weight transformers models (no hub: config classes only).

random_model("olmoe-1b-7b", torch.bfloat16, "cuda")
"""

from __future__ import annotations

import functools

import torch
import transformers

from asyncmoe.integrations.transformers import find_experts, find_router

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
}


def config(shape: str) -> transformers.PretrainedConfig:
    config_cls, kw = SHAPES[shape]
    return getattr(transformers, config_cls)(
        **kw, pad_token_id=0, bos_token_id=None, eos_token_id=None
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


def random_model(shape: str, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The same weights every time (seeded init on `device`), built as a checkpoint load builds a model
    (`from_config(dtype=...)` keeps the rotary tables fp32; `.to(bf16)` would not). Random routers send
    every token to the same few experts, so they are widened (std 1) to spread tokens."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config(shape), dtype=dtype).eval()
    with torch.no_grad():
        for name, m in find_experts(model):
            find_router(model, name, m)[0].normal_(0, 1.0)
    return model
