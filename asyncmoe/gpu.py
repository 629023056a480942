"""Whether the Triton kernels run: each feature's kernels sit beside their plain-torch references,
which run on the CPU and wherever triton is missing."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
except ImportError:  # non-Linux: triton is a Linux-only dependency
    triton = None


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run for a tensor on `t`'s device: CUDA with triton installed."""
    return t.is_cuda and triton is not None


def interpreted() -> bool:
    """Whether Triton interprets the kernels on the host (TRITON_INTERPRET=1, as the CPU tests run
    them): the few jit functions written in PTX have host twins then."""
    return os.environ.get("TRITON_INTERPRET") == "1"
