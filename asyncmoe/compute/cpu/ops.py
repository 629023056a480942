"""The CPU executor's custom op with its fake: what torch.compile sees of a layer computed on the
host.

An op, so that a compiled graph stays whole around the ctypes call (CPU) or the send/receive kernels
(CUDA), and the executor, which holds the worker, is named by an int id.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .executor import executor


@torch.library.custom_op("asyncmoe::cpu_experts", mutates_args=())
def _cpu_experts(x: Tensor, top_k_index: Tensor, executor_id: int, layer: int) -> Tensor:
    """Every routed pair's expert output of `layer` [T*k, H] float32, computed by the host's CPU
    (executor.CpuExecutor.compute)."""
    return executor(executor_id).compute(x, top_k_index, layer)


@_cpu_experts.register_fake
def _(x, top_k_index, executor_id, layer):
    T, k = top_k_index.shape
    torch._check(
        x.dim() == 2 and x.shape[0] == T,
        lambda: f"x must be [T={T}, H], one row per token of top_k_index, got {tuple(x.shape)}",
    )
    return x.new_empty(T * k, x.shape[1], dtype=torch.float32)


def cpu_experts(x: Tensor, top_k_index: Tensor, executor_id: int, layer: int) -> Tensor:
    return torch.ops.asyncmoe.cpu_experts(x, top_k_index, executor_id, layer)
