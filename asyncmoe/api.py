"""The public entry points: `compile`, `from_pretrained`, `stats`, `record`, `demo_model_path`."""

from __future__ import annotations

import pathlib

import torch
from torch import nn

from .cache.stats import Stats, read_stats
from .integrations import transformers as hf
from .predict import Prefetch
from .providers import CachedProvider, ResidentProvider
from .trace import Trace


def compile(
    model: nn.Module,
    cache: int = 16,
    policy: str = "lfru",
    device: torch.device | str | None = None,
    prefetch: bool | Prefetch = True,
    replay: Trace | str | None = None,
    time_stalls: bool = False,
) -> nn.Module:
    """Prepare a transformers MoE model in place: experts to (pinned) host memory, `cache` GPU slots per MoE layer.

    `cache >= num_experts` keeps every expert resident and runs the model's own implementation.
    `device` is where the model runs (default: where its experts are now); a model loaded on the CPU
    can be compiled straight onto the GPU without its experts ever going there.
    `policy`: eviction policy, one of "lru", "lfu", "lfru", "fifo".
    `prefetch`: predict the next layers' experts and copy them on a side stream while a layer
    computes (True: `Prefetch()`, the gate predictor for the next layer; a `Prefetch` to choose).
    `replay`: a routing trace (or its .npz path) to route by instead of the routers, whose work still
    runs: realistic routing for random-weight models of real shapes (docs/traces.md).
    `time_stalls`: time, on the GPU clock, how long each layer waits for its prefetch and for its own
    decision and copies (`stats` reports them); three one-thread kernels per layer call, so off by default.
    Returns the same model.
    """
    trace = Trace.load(replay) if isinstance(replay, str) else replay
    return hf.install(model, cache, policy, device, _plan(prefetch), trace, time_stalls)


def _plan(prefetch: bool | Prefetch) -> Prefetch | None:
    return Prefetch() if prefetch is True else (prefetch or None)


def record(model: nn.Module, gate: bool = False) -> hf.TraceRecorder:
    """`with asyncmoe.record(model) as r: model.generate(...)`, then `r.trace.save("out.npz")` (eager forwards only).
    `gate=True` also records the gate predictor's nominations, which a replay of the trace feeds to it."""
    return hf.TraceRecorder(model, gate)


def from_pretrained(
    path,
    cache: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    policy: str = "lfru",
    prefetch: bool | Prefetch = True,
    time_stalls: bool = False,
    **kwargs,
) -> nn.Module:
    """Load a MoE checkpoint (local directory or hub id) straight into an asyncmoe model.

    Non-expert weights go to `device` (default: cuda when available), every expert to pinned host
    memory; the full set of experts is never on the GPU. Checkpoint layouts are transformers' own
    (per-expert tensors fused on load by its conversion rules, or already fused, sharded or not);
    `kwargs` go to `AutoModelForCausalLM.from_pretrained`; the rest is as in `compile`.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return hf.load(path, cache, dtype, device, policy, _plan(prefetch), time_stalls, **kwargs)


def stats(model: nn.Module, reset: bool = False) -> Stats:
    """Per-layer hits, misses, evictions and bytes moved, read from the device now (one sync)."""
    providers = [(name, getattr(m, hf.PROVIDER)) for name, m in hf.find_experts(model) if hasattr(m, hf.PROVIDER)]
    if not providers:
        raise ValueError("this model is not asyncmoe-compiled: call asyncmoe.compile(model, cache=...) first")
    caches = [(name, p.cache) for name, p in providers if isinstance(p, CachedProvider)]
    resident = sum(isinstance(p, ResidentProvider) for _, p in providers)
    return read_stats(caches, resident, reset)


def demo_model_path() -> pathlib.Path:
    """The small MoE model asyncmoe ships (OLMoE routing shape: 64 experts, top-8; trained on Python's stdlib).

    A transformers checkpoint directory: `AutoModelForCausalLM.from_pretrained(asyncmoe.demo_model_path())`.
    How it was made: scripts/train_demo_model.py and the `training.json` beside it.
    """
    path = pathlib.Path(__file__).parent / "data" / "demo_model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded demo model is missing from {path}: reinstall asyncmoe from a full checkout, "
            "or remake it with `python scripts/train_demo_model.py --out asyncmoe/data/demo_model`"
        )
    return path
