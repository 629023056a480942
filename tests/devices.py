"""Where a Triton kernel can be tested against its reference, and the comparison of two caches after it ran."""

from __future__ import annotations

import os

import pytest
import torch

from asyncmoe.cache.expert_cache import ExpertCache


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
