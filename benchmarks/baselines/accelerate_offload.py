"""Baseline (b): Hugging Face accelerate's offload, experts on the CPU, everything else on the GPU.

This is what users do today when a MoE model does not fit: a `device_map` that puts the experts on
"cpu" (by hand, or `device_map="auto"` with `max_memory`), after which accelerate's hooks copy each
offloaded module's weights to the GPU for every forward and drop them after.
"""

from __future__ import annotations

import torch

from asyncmoe.integrations.transformers import find_experts


def device_map(model: torch.nn.Module, device) -> dict[str, str | int | torch.device]:
    """Every experts module on "cpu", every other module (or direct parameter) on `device`, no overlaps."""
    experts = {name for name, _ in find_experts(model)}
    out: dict[str, str | int | torch.device] = {}

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, _ in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            out[prefix + name] = device
        for name, child in module.named_children():
            full = prefix + name
            if full in experts:
                out[full] = "cpu"
            elif any(e.startswith(full + ".") for e in experts):
                visit(full + ".", child)
            else:
                out[full] = device

    visit("", model)
    return out


def install(model: torch.nn.Module, device) -> torch.nn.Module:
    from accelerate import dispatch_model

    return dispatch_model(model.cpu(), device_map(model, device), main_device=device)


def weights(experts: torch.nn.Module) -> list[torch.Tensor]:
    """The experts module's host copies: accelerate keeps them in its hook's weights map, off the module."""
    hook = getattr(experts, "_hf_hook", None)
    if hook is None or getattr(hook, "weights_map", None) is None:
        return list(experts.parameters(recurse=False))
    return [hook.weights_map[name] for name, _ in experts.named_parameters(recurse=False)]
