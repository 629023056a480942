"""Routing traces: the format, and the offline simulator with the Belady bound."""

from .format import Trace

__all__ = ["Trace"]
