"""asyncmoe: run Mixture-of-Experts models whose experts do not fit in GPU memory.

model = asyncmoe.compile(model, cache=16)   # 16 GPU slots per MoE layer; experts -> pinned host
memory model.generate(ids, max_new_tokens=64) print(asyncmoe.stats(model))
"""

from . import ops  # registers the custom ops
from .api import compile, demo_model_path, from_pretrained, record, stats
from .integrations.parallel import expert_parallel
from .prefetch import Prefetch
from .runtime import Decoder, Generation
from .settings import AutoCache

__all__ = [
    "AutoCache",
    "compile",
    "demo_model_path",
    "expert_parallel",
    "from_pretrained",
    "record",
    "stats",
    "ops",
    "Prefetch",
    "Decoder",
    "Generation",
]
__version__ = "0.1.0"
