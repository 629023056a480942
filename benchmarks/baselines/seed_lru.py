"""Baseline (c): the seed pull request's expert cache, re-implemented on transformers' experts interface.

The seed (vLLM PR #37190, ../shared/seed) keeps C GPU slots per MoE layer and decides on the host:

    unique_ids = topk_ids.unique().tolist()                 # a host sync per layer
    for each unique expert:
        hit  -> OrderedDict.move_to_end()
        miss -> evict the least recently used (or take a free slot), synchronous copy_ from pinned
                host memory into its slot, update the GPU mapping tensor
    remap topk_ids -> slots through the mapping tensor, compute from the slot buffers

and runs eager only (it needs --enforce-eager); more distinct experts than slots in one call is an
error there, and here. The expert compute is asyncmoe's own (`routed_outputs`, `combine`), so a
comparison with asyncmoe measures the cache management, not the matmuls.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from asyncmoe.compute.experts import combine, routed_outputs
from asyncmoe.integrations.transformers import PROVIDER, find_experts
from asyncmoe.providers import ExpertWeightProvider


class SeedLRU(ExpertWeightProvider):
    def __init__(self, experts: torch.nn.Module, num_slots: int, device: torch.device):
        super().__init__()
        params = dict(experts.named_parameters(recurse=False))
        E = next(iter(params.values())).shape[0]
        pin = device.type == "cuda"
        # pinned memory allocated first and copied into, as the PR allocates its weights pinned ("CPU-pinned weight
        # allocation"): one device -> host copy, not one to pageable memory and a second to pinned
        self.host = {
            n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p.detach())
            for n, p in params.items()
        }
        self.slots = {
            n: torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, device=device)
            for n, p in params.items()
        }
        self.slot_of = torch.full(
            (E,), -1, dtype=torch.int64, device=device
        )  # the persistent GPU mapping
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.num_slots = num_slots
        self.free = list(range(num_slots))
        self.hits = self.misses = 0
        for name in params:  # the module keeps its host copy, as asyncmoe's store does
            del experts._parameters[name]
            setattr(experts, name, self.host[name])

    def forward(self, experts, hidden_states, top_k_index, top_k_weights):
        unique = top_k_index.unique().tolist()
        if (
            len(unique) > self.num_slots
        ):  # the seed raises too; feed such a prompt one token at a time
            raise ValueError(
                f"{len(unique)} distinct experts in one call exceed the {self.num_slots} slots"
            )
        for e in unique:
            if e in self.lru:
                self.lru.move_to_end(e)
                self.hits += 1
                continue
            slot = self.free.pop() if self.free else self.lru.popitem(last=False)[1]
            for name, slots in self.slots.items():
                slots[slot].copy_(self.host[name][e])  # synchronous: the host waits for each copy
            self.slot_of[e] = slot
            self.lru[e] = slot
            self.misses += 1
        slots = self.slot_of[top_k_index]
        return combine(
            routed_outputs(experts, hidden_states, slots, self.slots),
            top_k_weights,
            hidden_states.dtype,
        )


def install(model: torch.nn.Module, cache: int, device: torch.device | str) -> torch.nn.Module:
    """Give every experts module of `model` a seed-style cache of `cache` slots; the rest goes to `device`."""
    device = torch.device(device)
    experts = find_experts(model)
    for _, m in experts:
        setattr(m, PROVIDER, SeedLRU(m, cache, device))
    model.to(device)
    model.set_experts_implementation(
        "asyncmoe"
    )  # transformers hands each experts call to the provider
    return model


def provider(experts: torch.nn.Module) -> SeedLRU:
    return getattr(experts, PROVIDER)


def reset(model: torch.nn.Module) -> None:
    for _, m in find_experts(model):
        provider(m).hits = provider(m).misses = 0


def clear(model: torch.nn.Module) -> None:
    """Every layer's cache as installed, nothing resident: a reused model starts a case as a fresh build would."""
    for _, m in find_experts(model):
        p = provider(m)
        p.lru.clear()
        p.free = list(range(p.num_slots))
        p.slot_of.fill_(-1)
        p.hits = p.misses = 0


def hit_rate(model: torch.nn.Module) -> float:
    providers = [provider(m) for _, m in find_experts(model)]
    hits, misses = sum(p.hits for p in providers), sum(p.misses for p in providers)
    return hits / (hits + misses) if hits + misses else float("nan")
