"""The host as a second executor: expert MLPs computed by the CPU from the host store (experts.c, built at first
use), and the worker thread that serves them to a captured GPU step through pinned memory."""

from .kernels import CpuExperts, Pool, Projection, experts_mlp
from .worker import Channel, Worker

__all__ = ["Channel", "CpuExperts", "Pool", "Projection", "Worker", "experts_mlp"]
