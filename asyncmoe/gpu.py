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


def pointers(state, names: tuple[str, ...], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors `names` of `state` (a NamedTuple of tensors: a cache's or a prefetch's state, a
    CPU channel's fields) as a Triton kernel's keyword arguments `{prefix}{name}_ptr`: the kernel
    binds each by its parameter's name, so no order of fields is kept by hand, and a name the kernel
    lacks fails at launch (tests/test_kernel_arguments.py checks every launcher's)."""
    return {f"{prefix}{name}_ptr": getattr(state, name) for name in names}
