"""The public entry points: `compile`, `from_pretrained`, `stats`, `record`, `demo_model_path`."""

from __future__ import annotations

import dataclasses
import pathlib

import torch
import torch.distributed as dist
from torch import nn

from .integrations.install import install
from .integrations.loading import load
from .integrations.record import TraceRecorder
from .integrations.transformers import PROVIDER, check_model, find_experts
from .layer_stats import Stats, cpu_layer_stats, read_stats
from .providers import CachedProvider, CpuProvider, ResidentProvider
from .settings import OPTIONS, Settings, check_bool, settings_from, takes_settings


@takes_settings
def compile(model: nn.Module, settings: Settings | None = None, **options) -> nn.Module:
    """Prepare a transformers MoE model in place: every expert to (pinned) host memory, `cache` GPU
    slots per MoE layer, whose cache decisions run on the device. Returns the same model.

    `settings`: an `asyncmoe.Settings`. The keyword options are its fields, a short form:
    `compile(model, cache=16)` is `compile(model, Settings(cache=16))`; given beside `settings`,
    they replace its fields (`dataclasses.replace`: `compile(model, settings, cache=8)`).
    """
    check_model(model)
    return install(model, settings_from(settings, options, "compile"))


def record(model: nn.Module, gate: bool = False) -> TraceRecorder:
    """`with asyncmoe.record(model) as r: model.generate(...)`, then `r.trace.save("out.npz")`
    (eager forwards only). `gate=True` also records the gate predictor's nominations, which a replay
    of the trace feeds to it."""
    check_model(model)
    return TraceRecorder(model, gate)


@takes_settings
def from_pretrained(
    path, settings: Settings | None = None, *, dtype: torch.dtype | str = torch.bfloat16, **kwargs
) -> nn.Module:
    """Load a MoE checkpoint (local directory or hub id) straight into an asyncmoe model.

    Non-expert weights go to `device` (default: cuda when available), every expert to pinned host
    memory; the full set of experts is never on the GPU. `settings` and the keywords that name its
    fields are as in `compile`; the other `kwargs` go to `AutoModelForCausalLM.from_pretrained`.
    Checkpoint layouts are transformers' own (per-expert tensors fused on load by its conversion
    rules, or already fused, sharded or not). `dtype`, as transformers takes it: torch.float32,
    torch.bfloat16 or torch.float16, their names ("bfloat16"), or "auto" (the checkpoint's own). A
    checkpoint with fine-grained fp8 experts
    (`quantization_config.quant_method == "fp8"`, as DeepSeek-V3/R1 and the Qwen3 FP8 releases
    ship) keeps them fp8 from the safetensors files to the slots; its other weights are dequantized
    to `dtype`. `quantize="fp8"` quantizes a bf16/fp16 checkpoint's experts on the way in;
    `quantize="dequantize"` loads an fp8 checkpoint's experts in `dtype` instead. Under `torchrun`,
    `distributed_config=asyncmoe.expert_parallel()` has transformers split every MoE layer's experts
    over the ranks: each rank loads only its own experts, and caches them (`cache` slots of its
    own).
    """
    options = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
    settings = settings_from(settings, options, "from_pretrained")
    if settings.device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        settings = dataclasses.replace(settings, device=device)
    return load(path, settings, dtype, **kwargs)


def stats(model: nn.Module, reset: bool = False, group=None) -> Stats:
    """Per-layer hits, misses, evictions and bytes moved, read from the device now (one sync). Under
    expert parallelism each rank counts its own experts; `group` (a torch.distributed process group,
    such as `torch.distributed.group.WORLD`) sums them over its ranks, every one of which must
    call."""
    check_model(model)
    check_bool("reset", reset)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be a torch.distributed process group, such as "
            "torch.distributed.group.WORLD once init_process_group has run, or None (this rank's "
            f"counters); got {type(group).__name__} {group!r}"
        )
    providers = [
        (name, getattr(m, PROVIDER)) for name, m in find_experts(model) if hasattr(m, PROVIDER)
    ]
    if not providers:
        raise ValueError(
            "this model is not asyncmoe-compiled: call asyncmoe.compile(model, cache=...) first"
        )
    caches = [(name, p.cache) for name, p in providers if isinstance(p, CachedProvider)]
    resident = sum(isinstance(p, ResidentProvider) for _, p in providers)
    cpu = [(name, p) for name, p in providers if isinstance(p, CpuProvider)]
    if cpu and group is not None:
        raise ValueError(
            "group sums the counters of expert-parallel ranks, and cache=0 (every routed expert on "
            "the CPU) runs no expert parallelism: leave group out"
        )
    if cpu:  # cache=0: every MoE layer on the CPU
        return Stats(cpu_layer_stats(cpu, reset), resident)
    hybrids = [p.hybrid for _, p in providers if isinstance(p, CachedProvider)]
    return read_stats(caches, resident, reset, group, hybrids)


def demo_model_path() -> pathlib.Path:
    """The small MoE model asyncmoe ships (OLMoE routing shape: 64 experts, top-8; trained on
    Python's stdlib).

    A transformers checkpoint directory:
    `AutoModelForCausalLM.from_pretrained(asyncmoe.demo_model_path())`. How it was made:
    scripts/train_demo_model.py and the `training.json` beside it.
    """
    path = pathlib.Path(__file__).parent / "data" / "demo_model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded demo model is missing from {path}: reinstall asyncmoe from a full "
            "checkout, "
            "or remake it with `python scripts/train_demo_model.py --out asyncmoe/data/demo_model`"
        )
    return path
