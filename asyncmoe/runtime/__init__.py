"""The CUDA-graph decode loop."""

from .decoder import Decoder, Generation

__all__ = ["Decoder", "Generation"]
