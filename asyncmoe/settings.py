"""What `compile` and `from_pretrained` were asked for: one frozen settings object, checked once
when it is built.

The checks here need only the values; those that need the model (top_k, the experts' dtypes, free
GPU memory) run where the model is installed (`integrations/install.py`).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

import torch

from .cache.policies import DEFAULT_POLICY, get_policy
from .formats import Format, parse_quantize
from .prefetch.predictors import Prefetch
from .trace.format import Trace

BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
CACHE_FORMS = (
    "slots per MoE layer as an int (cache=16, or 0: every routed expert on the CPU), a GPU-memory "
    "budget such as cache='6GiB', or cache='auto'"
)


def parse_budget(cache: str) -> int:
    """`cache="6GiB"` (also "6GB", "512MiB", ...) -> bytes."""
    match = BUDGET.match(cache)
    if not match:
        raise ValueError(f"cache={cache!r}: give {CACHE_FORMS}")
    return int(float(match[1]) * UNITS[match[2].lower()])


def budget_text(nbytes: int) -> str:
    """A budget string of at least `nbytes` (rounded up in the largest binary unit that keeps it >=
    1)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if nbytes >= UNITS[unit.lower()]:
            return f"{math.ceil(nbytes / UNITS[unit.lower()] * 100) / 100:g}{unit}"
    return f"{nbytes}B"


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class AutoCache:
    """`cache=AutoCache(max_length=4096, batch_size=1)`: the slots that fit in the GPU memory free
    at compile time once the model's other weights are on the GPU, leaving room for the KV cache and
    activations of a Decoder of that `max_length` and `batch_size`. Without a `max_length`
    (`cache="auto"`), the slots take `share` of that free memory and leave the rest for the KV cache
    and activations."""

    max_length: int | None = None
    batch_size: int = 1
    share: float = 0.8

    def __post_init__(self):
        if self.max_length is not None and (not is_int(self.max_length) or self.max_length < 1):
            raise ValueError(
                f"AutoCache(max_length={self.max_length!r}): give the Decoder's "
                "max_length, an int >= 1"
            )
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(
                f"AutoCache(batch_size={self.batch_size!r}): give the Decoder's "
                "batch_size, an int >= 1"
            )
        if not isinstance(self.share, numbers.Real) or not 0 < self.share <= 1:
            raise ValueError(
                f"AutoCache(share={self.share!r}): the share of free GPU memory for "
                "slots, in (0, 1]"
            )


@dataclass(frozen=True)
class HybridCosts:
    """The hybrid's cost model (hybrid/split.py), in ns: a request to the CPU beyond its experts' work,
    the CPU's work for an expert beyond its tokens', for each of its tokens, and one expert's copy
    over the link. Timed on this host at compile unless given (`hybrid_costs=`, for reproducible
    runs); `asyncmoe.stats(model).hybrid_costs` reads back the model's."""

    round_trip: int
    per_expert: int
    per_pair: int
    copy: int

    def __post_init__(self):
        for name, ns in vars(self).items():
            if not is_int(ns) or ns < 1:
                raise ValueError(
                    f"HybridCosts({name}={ns!r}): each cost is an int of ns >= 1; a cost of 0 "
                    "would make that work free to the split"
                )


def parse_cache(cache) -> int | AutoCache:
    """`cache=` -> slots per MoE layer (an int), a budget in bytes (an int, as `Settings.budget`) or
    an AutoCache."""
    if isinstance(cache, AutoCache) or is_int(cache):
        return cache
    if isinstance(cache, str) and cache.strip().lower() == "auto":
        return AutoCache()
    if isinstance(cache, str):
        return parse_budget(cache)
    raise TypeError(
        "cache must be an int (GPU slots per MoE layer), a GPU-memory budget such as '6GiB', "
        "'auto' or "
        f"an asyncmoe.AutoCache, got {type(cache).__name__} {cache!r}"
    )


@dataclass(frozen=True)
class Settings:
    """`compile`'s keywords, checked. `cache` as given (for messages); `slots`, `budget` or `auto`:
    what it asks."""

    cache: int | str | AutoCache = 16
    policy: str = DEFAULT_POLICY
    device: torch.device | None = None  # None: where the experts are now
    prefetch: bool | Prefetch | None = None  # None: on where the model runs on CUDA
    replay: Trace | None = None
    time_stalls: bool = False
    quantize: str | Format | None = None
    # the CPU executor's threads (None: all but one core, two on CUDA)
    cpu_threads: int | None = None
    # split a cached layer's misses between the link and the CPU (None: where it pays, on CUDA)
    hybrid: bool | None = None
    # the hybrid's costs (None: timed at compile)
    hybrid_costs: HybridCosts | None = None

    def __post_init__(self):
        asked = parse_cache(self.cache)
        if isinstance(self.cache, str) and not isinstance(asked, AutoCache) and asked <= 0:
            raise ValueError(f"cache={self.cache!r}: a budget must be more than 0 bytes")
        if is_int(self.cache) and self.cache < 0:
            raise ValueError(
                f"cache={self.cache}: give slots per MoE layer (at least the model's top_k), or 0 "
                "to compute every routed expert on the host's CPU"
            )
        if self.cpu_threads is not None and (not is_int(self.cpu_threads) or self.cpu_threads < 1):
            raise ValueError(
                f"cpu_threads={self.cpu_threads!r}: the CPU threads computing experts, an int >= 1 "
                "(None: all but one core, two on CUDA)"
            )
        if self.hybrid is not None and not isinstance(self.hybrid, bool):
            raise TypeError(
                f"hybrid must be True, False or None (on where it pays), got {self.hybrid!r}"
            )
        if self.hybrid and self.cache == 0:
            raise ValueError(
                "hybrid splits a GPU cache's misses between the link and the CPU, and cache=0 has "
                "no GPU cache (the CPU computes every routed expert already): give slots "
                "(cache=16 or a budget) or leave hybrid out"
            )
        if self.hybrid_costs is not None and not isinstance(self.hybrid_costs, HybridCosts):
            raise TypeError(
                "hybrid_costs must be an asyncmoe.HybridCosts(round_trip=, per_expert=, per_pair=, "
                f"copy=) in ns, got {type(self.hybrid_costs).__name__} {self.hybrid_costs!r}"
            )
        if self.hybrid_costs is not None and (self.hybrid is False or self.cache == 0):
            raise ValueError(
                "hybrid_costs are the costs the hybrid splits a GPU cache's misses by, and "
                f"{'hybrid=False' if self.hybrid is False else 'cache=0'} has no hybrid: leave "
                "hybrid_costs out"
            )
        if self.cpu_threads is not None and self.cache != 0 and self.hybrid is False:
            raise ValueError(
                f"cpu_threads={self.cpu_threads} sets the threads of the CPU executor, which "
                "hybrid=False turns off: pass cache=0 or hybrid=True, or leave cpu_threads out"
            )
        if self.cache == 0 and self.prefetch not in (None, False):
            raise ValueError(
                "prefetch copies experts into GPU slots, and cache=0 has none (the CPU computes "
                "every routed expert): leave prefetch out"
            )
        if self.cache == 0 and self.time_stalls:
            raise ValueError(
                "time_stalls times the waits of the GPU cache, and cache=0 has none; stats always "
                "report how long the GPU waited for the CPU: leave time_stalls out"
            )
        get_policy(self.policy)
        # from_pretrained's: an fp8 checkpoint's experts read in the model's dtype
        if self.quantize != "dequantize":
            parse_quantize(self.quantize)
        if not isinstance(self.time_stalls, bool):
            raise TypeError(f"time_stalls must be True or False, got {self.time_stalls!r}")
        if self.prefetch is not None and not isinstance(self.prefetch, (bool, Prefetch)):
            raise TypeError(
                "prefetch must be True, False, None (on where the model runs on CUDA) or an "
                "asyncmoe.Prefetch, got "
                f"{self.prefetch!r}; to choose predictors use e.g. "
                "asyncmoe.Prefetch(sources=('gate', 'temporal'))"
            )
        if self.replay is not None and not isinstance(self.replay, Trace):
            raise TypeError(
                "replay must be an asyncmoe.trace.Trace or the path of its .npz file, got "
                f"{type(self.replay).__name__}"
            )

    @property
    def slots(self) -> int | None:
        """Slots per MoE layer where `cache` gives them."""
        return self.cache if is_int(self.cache) else None

    @property
    def budget(self) -> int | None:
        """Bytes for every layer's slots together where `cache` is a budget."""
        asked = parse_cache(self.cache)
        return asked if isinstance(self.cache, str) and not isinstance(asked, AutoCache) else None

    @property
    def auto(self) -> AutoCache | None:
        asked = parse_cache(self.cache)
        return asked if isinstance(asked, AutoCache) else None
