"""Recording the routing of every MoE layer into a trace (eager forwards only)."""

from __future__ import annotations

import torch
from torch import nn

from ..prefetch import predictors
from ..providers import CachedProvider, QuantizedResidentProvider
from ..settings import check_bool
from ..trace.format import Trace
from .transformers import PROVIDER, families_hint, find_experts, find_router, num_experts


def expert_bytes(m: nn.Module) -> int:
    """Bytes of one expert of the experts module `m` as its provider stores it (fp8 with its scales,
    or dense)."""
    provider = getattr(m, PROVIDER, None)
    if isinstance(provider, CachedProvider):
        return provider.cache.expert_bytes
    if isinstance(provider, QuantizedResidentProvider):
        tensors = [getattr(provider, n) for n in provider.names]
    else:
        tensors = list(m.parameters(recurse=False))
    return sum(t[0].numel() * t.element_size() for t in tensors)


class TraceRecorder:
    """Records the routing of every MoE layer while active: `with record(model) as r: ...;
    r.trace.save(path)`.

    Hooks run in eager forwards only (a CUDA graph replays kernels, not Python): record with
    `Decoder(graph=False)` or `model.generate`. Tokens of a call are recorded in row-major order
    (batch, then position). Call `new_sequence()` before each sequence to mark `starts`.
    `gate=True` also records the gate predictor's nominations (each token's top-k experts of layer
    l+1's router on layer l's MoE input), so that a replay of the trace can feed the gate predictor.
    """

    def __init__(self, model: nn.Module, gate: bool = False):
        check_bool("gate", gate)
        named = find_experts(model)
        if not named:
            raise ValueError(
                f"{type(model).__name__} has no MoE layer to record; {families_hint()}"
            )
        self.experts = [m for _, m in named]
        self.routers = [find_router(model, name, m) for name, m in named] if gate else None
        if gate and any(r is None for r in self.routers[1:]):
            raise ValueError(
                f"{type(model).__name__}: no router weight [E, H] found beside every experts "
                "module; "
                "record without gate=True"
            )
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.experts]
        self.weights: list[list[torch.Tensor]] = [[] for _ in self.experts]
        # (ids, probs) per call
        self.gate: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.experts]
        self.starts: list[int] = []
        self.handles = []

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            # a host sync: recording is an eager tool
            self.ids[layer].append(ids.detach().to("cpu", torch.int64))
            self.weights[layer].append(weights.detach().to("cpu", torch.float32))
            if self.routers is None:
                return
            k = ids.shape[-1]
            if layer == 0:  # nothing before the first MoE layer predicts it
                self.gate[0].append((torch.full(ids.shape, -1), torch.zeros(ids.shape)))
            if layer + 1 < len(self.experts):
                x = args[0] if args else kwargs["hidden_states"]
                with torch.no_grad():
                    top = predictors.gate_top(x, *self.routers[layer + 1], k)
                # host copies, as above: recording is an eager tool, never in a captured step
                self.gate[layer + 1].append(
                    (top.indices.to("cpu", torch.int64), top.values.to("cpu", torch.float32))
                )

        return hook

    def new_sequence(self) -> None:
        """The next recorded token starts a sequence."""
        self.starts.append(sum(t.shape[0] for t in self.ids[0]))

    def __enter__(self):
        self.handles = [
            m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, m in enumerate(self.experts)
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @property
    def trace(self) -> Trace:
        if not self.ids[0]:
            raise ValueError("nothing was recorded: run the model inside `with record(model)`")
        ids = torch.stack([torch.cat(calls) for calls in self.ids], dim=1)  # [N, L, k]
        weights = torch.stack([torch.cat(calls) for calls in self.weights], dim=1)
        gate = {}
        if self.routers is not None:
            gate = {
                name: torch.stack(
                    [torch.cat([call[i] for call in calls]) for calls in self.gate], dim=1
                ).numpy()
                for i, name in enumerate(("gate_ids", "gate_probs"))
            }
        return Trace(
            ids.numpy(),
            num_experts(self.experts[0]),
            starts=self.starts or None,
            weights=weights.numpy(),
            expert_bytes=expert_bytes(self.experts[0]),
            **gate,
        )
