"""The per-layer expert cache: host store, slots, state, the algorithm, policies."""

from .expert_cache import ExpertCache
from .policies import POLICIES
from .state import COUNTERS, CacheState

__all__ = ["COUNTERS", "CacheState", "ExpertCache", "POLICIES"]
