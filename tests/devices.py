"""Where a Triton kernel can be tested against its reference, a cache holding given experts, and the comparison of
two caches after a kernel ran."""

from __future__ import annotations

import os

import pytest
import torch

from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.state import GATE, PACE_WINDOW, CacheState

# a Triton launch's keywords that are compile options, not the kernel's arguments
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def devices() -> list:
    """The CPU where TRITON_INTERPRET=1 (set by conftest.py without a GPU), and cuda (marked) where there is one."""
    out = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cpu")
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out or [
        pytest.param("cpu", marks=pytest.mark.skip(reason="neither TRITON_INTERPRET=1 nor a GPU"))
    ]


def examples(n: int) -> int:
    """A kernel-against-reference property test's examples: `n` interpreted; on a GPU a third (at
    least 4), as each new shape compiles the kernels there (about a second each) and the interpreted
    run covers the breadth of the same code."""
    return n if os.environ.get("TRITON_INTERPRET") == "1" else max(4, n // 3)


def cache_with(
    E: int,
    resident: list[int],
    prefetched: list[int] = (),
    window: int = 0,
    device="cpu",
    slots: int | None = None,
) -> CacheState:
    """The state of a cache of E experts and `slots` slots (None: E, room for every expert) holding `resident`,
    admitted alternately by the last call's `ensure` (born at the cache's clock) and by an earlier call's prefetch,
    and `prefetched`, admitted for the coming call by the gate's prefetch (born at the clock too), the prefetch
    having hidden behind `window` ns of compute; the other slots empty."""
    experts = torch.tensor([*resident, *prefetched], dtype=torch.int64)
    C = E if slots is None else slots
    assert len(experts) <= C, f"{len(experts)} experts do not fit {C} slots"
    cache = ExpertCache({"w": torch.zeros(E, 1)}, C, "lru")
    s, n = cache.state, len(resident)
    s.expert_to_slot[experts] = torch.arange(len(experts))
    s.slot_to_expert[: len(experts)] = experts
    s.clock.fill_(3)
    earlier = torch.arange(n) % 2 == 1
    s.born[:n], s.born[n : len(experts)] = 3 - earlier.long(), 3
    s.source[:n], s.source[n : len(experts)] = earlier * GATE, GATE
    s.pace[PACE_WINDOW] = window
    return CacheState(*(t.to(device) for t in s))  # the module refuses to move; its tensors may


def assert_same(kernel: ExpertCache, reference: ExpertCache) -> None:
    """Every buffer of the kernel's cache equals the reference's, bit for bit, but the kernel's scratch."""
    for (name, a), (_, b) in zip(kernel.named_buffers(), reference.named_buffers(), strict=True):
        if name == "scratch":
            continue
        if name in (
            "expert_to_slot",
            "evicted_at",
        ):  # the last row is the reference's trash row for masked writes
            a, b = a[:-1], b[:-1]
        assert torch.equal(a, b), f"{name}: kernel {a.tolist()} != reference {b.tolist()}"
