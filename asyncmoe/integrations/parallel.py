"""Expert parallelism as transformers does it, in the form each supported transformers release
takes.

Under expert parallelism every rank holds E/ranks of each layer's experts; transformers' router and
its sum of the ranks' outputs stay as they are, and asyncmoe caches each rank's own experts over its
own link. The distributed API changed between the releases asyncmoe supports: 5.17 has
`enable_expert_parallel` beside `tp_size`; later releases have `ep_size`, and refuse expert
parallelism without a tensor-parallel plan for the other layers (so the attention is split over the
same ranks).
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist
from transformers import DistributedConfig


def expert_parallel(ranks: int | None = None) -> DistributedConfig:
    """transformers' `DistributedConfig` that splits every MoE layer's experts over `ranks`
    processes (default: the world size of `torch.distributed`, else `WORLD_SIZE` as torchrun sets
    it), for `asyncmoe.from_pretrained(path, cache=...,
    distributed_config=asyncmoe.expert_parallel())`."""
    if ranks is None:
        ranks = (
            dist.get_world_size()
            if dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "0"))
        )
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(
            f"expert parallelism needs 2 or more ranks, got {ranks!r}: launch with `torchrun "
            "--nproc-per-node N` "
            "(which sets WORLD_SIZE), or pass ranks=N"
        )
    fields = {f.name for f in dataclasses.fields(DistributedConfig)}
    # every rank runs its experts on the batch all ranks share, then sums: sentinel ids
    if "ep_size" in fields:
        return DistributedConfig(tp_size=ranks, ep_size=ranks, ep_implementation="all_reduce")
    return DistributedConfig(tp_size=ranks, enable_expert_parallel=True)
