"""asyncmoe: run Mixture-of-Experts models whose experts do not fit in GPU memory.

model = asyncmoe.compile(model, cache=16)   # 16 GPU slots per MoE layer; experts -> pinned host memory
model.generate(ids, max_new_tokens=64)
print(asyncmoe.stats(model))

The names below load on first use (PEP 562), so that the `asyncmoe` command can speak before torch loads.
"""

import importlib

__version__ = "0.1.0"
_WHERE = {
    "AutoCache": ".settings",
    "Settings": ".settings",
    "compile": ".api",
    "demo_model_path": ".api",
    "expert_parallel": ".integrations.parallel",
    "from_pretrained": ".api",
    "HybridCosts": ".settings",
    "record": ".api",
    "stats": ".api",
    "ops": ".ops",
    "Prefetch": ".prefetch",
    "Decoder": ".runtime",
    "Generation": ".runtime",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'asyncmoe' has no attribute {name!r}")
    importlib.import_module(".ops", __name__)  # registers the custom ops before any of them is used
    module = importlib.import_module(_WHERE[name], __name__)
    value = module if name == "ops" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
