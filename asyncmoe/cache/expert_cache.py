"""One MoE layer's expert cache: the host store, the slots and the `CacheState` buffers.

Dims: E experts, E' experts of the previous cached layer, C slots.
Every buffer is allocated once, so its address never changes: a captured CUDA graph replays on them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .policies import get_policy
from .state import COUNTERS, TIMER_SIZE, CacheState


class ExpertCache(nn.Module):
    """Buffers of one layer's cache.

    `hosts` maps each per-expert tensor name of the experts module (`gate_up_proj`, `down_proj`,
    biases, ...) to its host store `[E, ...]` as the device sees it: a UVA view of pinned memory for
    a CUDA cache, the host tensor itself for a CPU one. `pace` is the tensor the linked layers share
    (a new one if None).
    """

    def __init__(
        self,
        hosts: dict[str, torch.Tensor],
        num_slots: int,
        policy: str,
        time_stalls: bool = False,
        pace: torch.Tensor | None = None,
    ):
        super().__init__()
        learns = get_policy(policy).learns  # and fail on a bad name now, not at the first forward
        first = next(iter(hosts.values()))
        device, self.num_experts = first.device, first.shape[0]
        self.num_slots, self.policy = num_slots, policy
        self.names = list(hosts)
        # the pinned host memory behind `hosts`, kept alive as long as the cache
        self.pinned_block = None
        for name, host in hosts.items():
            self.register_buffer(f"host_{name}", host, persistent=False)
            slot = torch.zeros((num_slots,) + host.shape[1:], dtype=host.dtype, device=device)
            self.register_buffer(f"slot_{name}", slot, persistent=False)
        C, E = num_slots, self.num_experts
        i64 = dict(dtype=torch.int64, device=device)
        buffers = dict(
            expert_to_slot=torch.full((E + 1,), -1, **i64),
            slot_to_expert=torch.full((C,), -1, **i64),
            last_use=torch.zeros(C, **i64),
            born=torch.zeros(C, **i64),
            freq=torch.zeros(C, **i64),
            used=torch.zeros(C, dtype=torch.bool, device=device),
            clock=torch.zeros(1, **i64),
            source=torch.zeros(C, dtype=torch.int8, device=device),
            routed=torch.zeros(E, dtype=torch.bool, device=device),
            counters=torch.zeros(len(COUNTERS), **i64),
            evicted_at=torch.full((E + 1,), -1, **i64),
            wave_of=torch.full((E,), -1, **i64),
            scratch=torch.zeros(E, dtype=torch.int32, device=device),
            explored=torch.full((1,), -1, **i64),
            runners_up=torch.zeros(E, dtype=torch.bool, device=device),
            follows=torch.zeros((E, E) if learns else (0, 0), dtype=torch.int32, device=device),
            # empty when not timed: a custom op cannot take an optional tensor it mutates under
            # Inductor
            timer=torch.zeros(TIMER_SIZE if time_stalls else 0, **i64),
            pace=torch.zeros(3, **i64) if pace is None else pace,
        )
        assert tuple(buffers) == CacheState._fields
        for name, buf in buffers.items():
            self.register_buffer(name, buf, persistent=False)

    @property
    def state(self) -> CacheState:
        return CacheState(*(getattr(self, name) for name in CacheState._fields))

    @property
    def hosts(self) -> list[torch.Tensor]:
        return [getattr(self, f"host_{n}") for n in self.names]

    @property
    def slots(self) -> list[torch.Tensor]:
        return [getattr(self, f"slot_{n}") for n in self.names]

    def slot_weights(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"slot_{n}") for n in self.names}

    @property
    def expert_bytes(self) -> int:
        return expert_bytes(self.slots)

    def clear(self) -> None:
        """Back to the cache as built: no expert resident, no policy, predictor or counter history.
        In place, so a captured graph's addresses stay valid. Slot weights are left as they are: no
        table points at them. A benchmark that reuses one model for several cases clears it so each
        starts as a fresh build would."""
        for name in CacheState._fields:
            if name != "pace":  # the pace measures the GPU, not this history
                buf = getattr(self, name)
                buf.fill_(
                    -1
                    if name
                    in ("expert_to_slot", "slot_to_expert", "evicted_at", "wave_of", "explored")
                    else 0
                )

    def _apply(self, fn, recurse=True):
        # `model.to()`, `.half()`, `.cpu()` reach here. Moving or casting would reallocate the slots
        # and (for a UVA host view) copy the whole host store onto the GPU; refuse instead of doing
        # that.
        for buf in self._buffers.values():
            probe = torch.empty(0, dtype=buf.dtype, device=buf.device)
            out = fn(probe)
            if out.device != probe.device or out.dtype != probe.dtype:
                raise RuntimeError(
                    f"an asyncmoe expert cache lives on {probe.device} in {probe.dtype} and cannot "
                    "be moved or cast "
                    f"(asked for {out.device}, {out.dtype}). Move/cast the model before "
                    "asyncmoe.compile, "
                    "or pass device= to asyncmoe.compile."
                )
        return self


def num_waves(pairs: int, num_slots: int, num_experts: int) -> int:
    """Waves needed in the worst case for `pairs` (token, expert) pairs: decided by shapes alone."""
    if pairs <= num_slots:
        return 1
    return math.ceil(min(num_experts, pairs) / num_slots)


def expert_bytes(slots: list[torch.Tensor]) -> int:
    """Bytes one expert takes over all its tensors (one slot's row of each)."""
    return sum(s[0].numel() * s.element_size() for s in slots)
