"""Registers every custom op asyncmoe adds, the only surface torch.compile sees: each feature's ops
live with it (cache/ops.py, prefetch/ops.py, compute/ops.py, compute/cpu/ops.py, hybrid/ops.py),
each beside its fake."""

from .cache import ops as cache_ops
from .compute import ops as compute_ops
from .compute.cpu import ops as cpu_ops
from .hybrid import ops as hybrid_ops
from .prefetch import ops as prefetch_ops

__all__ = ["cache_ops", "compute_ops", "cpu_ops", "hybrid_ops", "prefetch_ops"]
