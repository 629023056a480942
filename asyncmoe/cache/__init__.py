"""The per-layer expert cache: host store, slots, tables, policies, counters."""

from .expert_cache import COUNTERS, ExpertCache
from .policies import POLICIES

__all__ = ["COUNTERS", "ExpertCache", "POLICIES"]
