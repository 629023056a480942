"""Cross-layer expert predictors for prefetch."""

from .predictors import Prefetch

__all__ = ["Prefetch"]
