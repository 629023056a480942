"""Build a tiny model of any transformers MoE causal LM from its config class, by generic shrinking."""

from __future__ import annotations

import inspect
import sys

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "first_dense_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "num_local_experts": 8,
    "num_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FILL_IF_NONE = (
    "head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts",
    "num_experts_per_tok",
    "n_shared_experts",
)
# Switches a generic shrink cannot guess: which layers are MoE / attention in hybrid families.
EXTRA = {
    "gemma4": dict(enable_moe_block=True, moe_intermediate_size=32),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        use_mamba_kernels=False,
    ),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),  # the family only supports top-1
    "mimo_v2_flash": dict(head_dim=32, v_head_dim=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "flint": dict(mlp_only_layers=[]),
    "kolibri1_1": dict(  # one sliding and one indexed layer, each keeping its own K/V; one indexer head per K/V head
        layer_types=["sliding_attention", "indexed_attention"],
        index_layers=[1],
        kv_source_layers=[0, 1],
        index_num_heads=1,
        index_topk=16,
        index_pool_size=64,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
        mlp_only_layers=[],
    ),
}


PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type")


def moe_causal_lms() -> dict[str, list[type]]:
    """family (package under transformers.models) -> its causal-LM classes whose experts use the interface."""
    out: dict[str, list[type]] = {}
    for class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        cls = getattr(transformers, class_name, None)
        if cls is None:
            continue
        if "@use_experts_implementation" in inspect.getsource(sys.modules[cls.__module__]):
            family = cls.__module__.split(".")[-2]
            if cls not in out.setdefault(family, []):
                out[family].append(cls)
    return out


def small_config(cls: type):
    """The class's config built with small sizes, so derived per-layer lists come out the right length."""
    family = cls.__module__.split(".")[-2]
    default = cls.config_class()
    kwargs = {}
    for key, value in SMALL.items():
        try:
            current = getattr(default, key)
        except Exception:  # absent, or a per-layer attribute that refuses a global read
            continue
        if (
            isinstance(current, int)
            and not isinstance(current, bool)
            or (current is None and key in FILL_IF_NONE)
        ):
            kwargs[key] = value
    if isinstance(kwargs.get("qk_rope_head_dim"), int):
        kwargs["head_dim"] = kwargs[
            "qk_rope_head_dim"
        ]  # MLA: rotary embeddings are sized by the rope part
    for key in PER_LAYER_LISTS:
        value = getattr(default, key, None)
        if (
            isinstance(value, list)
            and value
            and not isinstance(getattr(type(default), key, None), property)
        ):
            kinds = list(
                dict.fromkeys(value)
            )  # keep one layer of each kind (attention, linear, mamba, moe...)
            kwargs["num_hidden_layers"] = max(SMALL["num_hidden_layers"], len(kinds))
            kwargs[key] = kinds + kinds[: kwargs["num_hidden_layers"] - len(kinds)]
    kwargs.update(EXTRA.get(family, {}))
    kwargs["tie_word_embeddings"] = False
    return cls.config_class(**kwargs)


MAX_PARAMS = 3_000_000


class NotShrunk(Exception):
    pass


def build(cls: type, seed: int = 0, dtype=torch.float32):
    config = small_config(cls)
    with torch.device("meta"):  # size it before paying for it
        n = sum(p.numel() for p in cls(config).parameters())
    if n > MAX_PARAMS:
        raise NotShrunk(f"the generic shrink left {n / 1e6:.0f}M parameters (a composite config?)")
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                name.endswith(("gate.weight", "router.weight"))
                and p.dim() == 2
                and "proj" not in name
            ):
                p.normal_(0, 1.0)  # random init routes almost every token alike; spread the routing
    return model.to(dtype).eval()
