"""Routing replayed from a trace: each experts module routed by a trace layer instead of its router.

The router's work still runs (realistic cost); a forward pre-hook rewrites the routed ids, so hooks
registered later (a trace recorder) see the ids actually used. A trace recorded with the gate
predictor's nominations also feeds them to the provider of the layer (`feed_replayed_gate`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..providers import CachedProvider
from ..trace.format import Trace
from .transformers import PROVIDER, find_experts, num_experts, top_k_of


class Replay(nn.Module):
    """Routes one experts module by a trace layer instead of its router, whose work still runs
    (realistic cost).

    A device-side cursor walks the trace's tokens (wrapping at its end), so a captured graph replays
    it too. With the trace's gate arrays (`gate_ids`, `gate_probs` [N, g]) it also says what the
    gate predictor predicted for this layer when the trace was recorded (`predict`). The host counts
    the tokens routed (`count`, no sync) and warns once the trace wraps.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        gate_ids: torch.Tensor | None = None,
        gate_probs: torch.Tensor | None = None,
    ):
        super().__init__()
        if ids.dim() != 2 or 0 in ids.shape:
            raise ValueError(
                "a replayed layer needs ids [tokens, k] of at least one token and expert, got "
                f"{tuple(ids.shape)}"
            )
        self.register_buffer("ids", ids, persistent=False)  # [N, k]
        self.register_buffer(
            "cursor", torch.zeros(1, dtype=torch.int64, device=ids.device), persistent=False
        )
        self.register_buffer("gate_ids", gate_ids, persistent=False)
        self.register_buffer("gate_probs", gate_probs, persistent=False)
        self.routed = 0  # tokens routed since the last rewind, counted on the host

    def count(self, tokens: int) -> None:
        """Count `tokens` more routed tokens; warn where they wrap the trace."""
        N = self.ids.shape[0]
        if self.routed <= N < self.routed + tokens:
            warnings.warn(
                f"replay: the trace's {N} tokens are used up, and the replay wraps to its first "
                "token: routing repeats from there (docs/traces.md#replay); record a longer trace "
                "for runs this long",
                stacklevel=2,
            )
        self.routed += tokens

    def rows(self, tokens: int) -> torch.Tensor:
        return (self.cursor + torch.arange(tokens, device=self.ids.device)) % self.ids.shape[0]

    def forward(self, top_k_index: torch.Tensor) -> torch.Tensor:
        rows = self.rows(top_k_index.shape[0])
        self.cursor.add_(top_k_index.shape[0])
        return self.ids[rows].to(top_k_index.dtype)

    def recorded_gate(self) -> list[torch.Tensor]:
        """What the gate op needs to score this layer as the recorded gate did
        (`predictors.recorded_gate_scores`)."""
        return [self.gate_ids, self.gate_probs, self.cursor]


def _replay_hook(module, args, kwargs):
    """A forward pre-hook, so that hooks registered later (a trace recorder) see the ids actually
    used. It counts the tokens where it runs eagerly; the Decoder counts its graph and compiled
    steps, which do not run it."""
    ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
    if not (
        torch.compiler.is_compiling() or ids.is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        module.asyncmoe_replay.count(ids.shape[0])
    if len(args) > 1:
        return (args[0], module.asyncmoe_replay(args[1]), *args[2:]), kwargs
    return args, {**kwargs, "top_k_index": module.asyncmoe_replay(kwargs["top_k_index"])}


def install_replay(
    experts: list[tuple[str, nn.Module]], trace: Trace, device: torch.device
) -> None:
    """Model MoE layer i replays trace layer i % trace.layers; expert count and top-k must match. A
    layer whose trace layer is 0 gets no recorded gate scores (nothing predicted trace layer 0 from
    the one before). The trace is validated again first: its arrays may have changed since it was
    built."""
    trace.validate()
    for i, (name, m) in enumerate(experts):
        E, k = num_experts(m), top_k_of(m.config)
        if trace.num_experts != E or (k is not None and trace.top_k != k):
            raise ValueError(
                f"{name} routes {k} of {E} experts but the trace has {trace.top_k} of "
                f"{trace.num_experts}: "
                "replay needs the same number of experts and top-k"
            )
        layer = i % trace.layers
        gate = (
            []
            if trace.gate_ids is None
            else [
                torch.as_tensor(trace.gate_ids[:, layer]).to(device=device, dtype=torch.int64),
                torch.as_tensor(trace.gate_probs[:, layer]).to(device=device, dtype=torch.float32),
            ]
        )
        m.asyncmoe_replay = Replay(
            torch.as_tensor(trace.ids[:, layer]).to(device=device, dtype=torch.int64), *gate
        )
        m.register_forward_pre_hook(_replay_hook, with_kwargs=True)
        feed_replayed_gate(m)


def feed_replayed_gate(m: nn.Module) -> None:
    """Let the gate predictor of the layer before score a replayed layer by the trace's recorded
    gate."""
    provider, replay = getattr(m, PROVIDER, None), getattr(m, "asyncmoe_replay", None)
    if isinstance(provider, CachedProvider) and replay is not None and replay.gate_ids is not None:
        provider.replayed_gate = replay.recorded_gate()


def replay_routing(model: nn.Module, trace: Trace, device: torch.device | str) -> None:
    """Route every MoE layer of `model` (asyncmoe-compiled or not) by `trace` instead of its router;
    see `Replay`."""
    install_replay(find_experts(model), trace, torch.device(device))


def replays(model: nn.Module) -> list[Replay]:
    """The `Replay` of every replayed MoE layer of `model`."""
    return [m.asyncmoe_replay for _, m in find_experts(model) if hasattr(m, "asyncmoe_replay")]


def rewind_replay(model: nn.Module) -> None:
    """Start every replayed layer at the trace's first token again (eager; a captured graph keeps
    the cursors)."""
    for replay in replays(model):
        replay.cursor.zero_()
        replay.routed = 0
