"""transformers' experts interface: the `"asyncmoe"` implementation, and finding experts modules and
routers.

transformers >= 5 keeps a MoE layer's experts as 3-D parameters `[E, ...]` in one module whose class
is decorated with `@use_experts_implementation`; its forward dispatches on
`config._experts_implementation` to `fn(self, hidden_states [T,H], top_k_index [T,k], top_k_weights
[T,k]) -> [T,H]`. We register `"asyncmoe"` there, so routers, shared experts and everything else
stay the model's own, and `generate()`, static caches and torch.compile keep working. Under
transformers' expert parallelism each rank's module holds its experts as DTensor shards, and its
forward hands the implementation local expert ids, with id E (the local count) for pairs routed to
another rank's experts; transformers sums the ranks' outputs after it returns.
"""

from __future__ import annotations

import functools
import pathlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ExpertsInterface

TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
PROVIDER = "asyncmoe"  # attribute of each experts module that holds its provider


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return getattr(self, PROVIDER)(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register("asyncmoe", experts_forward)


def check_model(model, arg: str = "model") -> None:
    """A TypeError naming `arg` where something other than a torch module is given as the model."""
    if not isinstance(model, nn.Module):
        hint = (
            "; to load a checkpoint from a path use asyncmoe.from_pretrained(path, ...)"
            if isinstance(model, (str, pathlib.PurePath))
            else ""
        )
        raise TypeError(
            f"{arg} must be a torch.nn.Module (a transformers model), got "
            f"{type(model).__name__}{hint}"
        )


def is_experts_module(module: nn.Module) -> bool:
    """Modules built by a `@use_experts_implementation` class carry its layout flags."""
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    return all(isinstance(getattr(module, f, None), bool) for f in flags) and hasattr(
        module, "config"
    )


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


@functools.cache
def supported_families() -> tuple[str, ...]:
    """Model types in the installed transformers whose experts use the experts interface."""
    import transformers

    models = pathlib.Path(transformers.__file__).parent / "models"
    return tuple(
        sorted(
            d.name
            for d in models.iterdir()
            if any("@use_experts_implementation" in f.read_text() for f in d.glob("modeling_*.py"))
        )
    )


def families_hint() -> str:
    fams = supported_families()
    return f"supported: the {len(fams)} families on transformers' experts interface ({', '.join(fams)})"


def looks_like_moe(model: nn.Module) -> list[str]:
    """Class names of modules that look like MoE blocks (for an honest 'unsupported' message)."""
    names = {type(m).__name__ for m in model.modules()}
    return sorted(n for n in names if "expert" in n.lower() or "moe" in n.lower())


def top_k_of(config) -> int | None:
    for key in TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = max(value)
        if isinstance(value, int) and value > 0:
            return value
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor that transformers' tensor or expert parallelism made a DTensor;
    else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def expert_params(m: nn.Module) -> dict[str, torch.Tensor]:
    """The experts module's own tensors [E, ...], this rank's experts only under expert
    parallelism."""
    return {name: local(p) for name, p in m.named_parameters(recurse=False)}


def is_expert_parallel(m: nn.Module) -> bool:
    """Whether transformers split this experts module's experts over ranks (its parameters are
    DTensors)."""
    return any(isinstance(p, DTensor) for p in m.parameters(recurse=False))


def num_experts(m: nn.Module) -> int:
    """Experts of the module on this rank."""
    return local(m.gate_up_proj if m.has_gate else m.up_proj).shape[0]


def find_router(
    model: nn.Module, name: str, experts: nn.Module
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The router beside an experts module: the MoE block's parameter shaped [E, H] (and its [E]
    bias, if any)."""
    E, down = num_experts(experts), experts.down_proj
    if down.dtype == torch.uint8:  # 4-bit codes, stored [E, H, I/2] whatever the module's layout
        H = down.shape[-2]
    else:
        H = down.shape[-1] if experts.is_transposed else down.shape[-2]
    block = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    for module_name, module in block.named_modules():
        if module is experts or module_name.startswith(name.rpartition(".")[2] + "."):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and tuple(weight.shape) == (E, H):
            bias = module._parameters.get("bias")
            return weight, (bias if bias is not None and tuple(bias.shape) == (E,) else None)
    return None
