"""Triton kernels, each beside its launcher; their plain-torch references live with the code they replace
(named in each module's docstring) and run on the CPU."""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401
except ImportError:  # non-Linux: triton is a Linux-only dependency
    triton = None


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run for a tensor on `t`'s device: CUDA with triton installed."""
    return t.is_cuda and triton is not None
