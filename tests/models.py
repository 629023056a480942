"""Tiny random-weight models of real transformers MoE families, built from their config classes."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# family -> (config class, model class, overrides); every family: 16 experts, top-2 (cache top_k, E/4, E = 2, 4, 16)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=16, num_experts_per_tok=2),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=48),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=48,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=16,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(num_local_experts=16, num_experts_per_tok=2),
    ),
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(num_local_experts=16, num_experts_per_tok=2),
    ),
}
TOP_K, NUM_EXPERTS = 2, 16


def tiny(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 0, device="cpu", **config_overrides
):
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Random init routes nearly every token to the same few experts; widen the routers so calls
    # touch many experts and the cache really evicts.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 1.0)
    return model.to(device=device, dtype=dtype).eval()
