"""What `compile` and `from_pretrained` were asked for: one frozen settings object, checked once
when it is built.

The checks here need only the values; those that need the model (top_k, the experts' dtypes, free
GPU memory) run where the model is installed (`integrations/install.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import os
import re
import textwrap
from dataclasses import dataclass, field

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


def check_bool(name: str, value) -> None:
    """A switch takes True or False only: "yes", 1 or a tensor is refused, not read as truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


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


def _option(default, doc: str):
    """A `Settings` field: its default and the phrase that `help(asyncmoe.compile)` shows for it."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What `compile` and `from_pretrained` are asked for, checked when built:
    `asyncmoe.compile(model, asyncmoe.Settings(cache=16))`, or its short form
    `asyncmoe.compile(model, cache=16)`. `cache` stays as given (for messages); `slots`, `budget` or
    `auto` say what it asks. With `cache=0` the rest of the model runs on `device` (on CUDA inside
    the same graphs: the GPU sends each layer's pairs to a CPU worker through pinned memory and
    waits for its outputs)."""

    cache: int | str | AutoCache = _option(
        16,
        "GPU slots per MoE layer; or a GPU-memory budget for all layers' slots ('6GiB', '512MiB'), "
        "the slots that fit for the experts' format; or 'auto' (asyncmoe.AutoCache(max_length=, "
        "batch_size=) to leave a Decoder's room): what fits in the GPU memory free now. "
        ">= num_experts: every expert resident (the model's own implementation); 0: every routed "
        "expert computed on the host's CPU from host memory",
    )
    policy: str = _option(
        DEFAULT_POLICY,
        "eviction policy: 'markov' (LFRU behind a prediction of the next call from the experts "
        "that followed the current ones; an [E, E] table a layer), 'lfru', 'lru', 'lfu', 'fifo'",
    )
    device: torch.device | str | None = _option(
        None,
        "where the model runs (None: where its experts are now; from_pretrained: cuda when "
        "available); a model on the CPU compiles onto the GPU without its experts going there",
    )
    prefetch: bool | Prefetch | None = _option(
        None,
        "predict the next layers' experts and copy them on a side stream while a layer computes: "
        "True (asyncmoe.Prefetch(), the gate predictor), False or an asyncmoe.Prefetch; None: on "
        "where the model runs on CUDA (on the CPU nothing runs beside the copies)",
    )
    replay: Trace | str | os.PathLike | None = _option(
        None,
        "a routing trace, or its .npz path, to route by instead of the routers, whose work still "
        "runs: realistic routing for random-weight models of real shapes, whatever the cache; MoE "
        "layer i replays trace layer i % its layers, and past its last token the trace wraps to "
        "its first, with a warning (docs/traces.md)",
    )
    time_stalls: bool = _option(
        False,
        "time each layer's waits for its prefetch and for its own decision and copies on the GPU "
        "clock, in `stats` (three one-thread kernels a call: docs/decisions.md#stall-timing-off)",
    )
    quantize: str | Format | None = _option(
        None,
        "store the experts as 'fp8' (block-wise 128x128, transformers' layout: half of bf16's "
        "bytes a miss), 'mxfp4' or 'int4', quantized on the way to host memory; None: the "
        "model's dtype, or a checkpoint's fp8 / mxfp4 experts as stored; from_pretrained's "
        "'dequantize': those in `dtype`",
    )
    cpu_threads: int | None = _option(
        None,
        "the CPU executor's threads (None: all but one core, two for a model on CUDA), shared by "
        "the models of a process; refused where nothing computes on the CPU (no cache=0, no hybrid)",
    )
    hybrid: bool | None = _option(
        None,
        "split a cached layer's misses between the link and the host's CPU by a cost model timed "
        "at compile (None: on where the model runs on CUDA and the CPU would take any of a decode "
        "call's misses; True on a CPU model splits them too, both sides on the host); a captured "
        "or compiled call of more experts than slots has the CPU take the excess, eager ones run "
        "in waves on the GPU",
    )
    hybrid_costs: HybridCosts | None = _option(
        None,
        "the hybrid's costs, an asyncmoe.HybridCosts (None: timed at compile, and printed as one "
        "to pass back for reproducible runs)",
    )

    def __post_init__(self):
        if isinstance(self.replay, (str, os.PathLike)):
            object.__setattr__(self, "replay", Trace.load(self.replay, what="replay="))
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
        check_bool("time_stalls", self.time_stalls)
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


OPTIONS = tuple(f.name for f in dataclasses.fields(Settings))


def options_doc() -> str:
    """Settings' fields as a docstring's list, one `name=default: what it asks` each."""
    lines = ["Options (the fields of asyncmoe.Settings):"]
    for f in dataclasses.fields(Settings):
        text = f"{f.name}={f.default!r}: {f.metadata['doc']}"
        lines.append(
            textwrap.fill(
                text, 100, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
            )
        )
    return "\n".join(lines)


Settings.__doc__ = f"{inspect.cleandoc(Settings.__doc__)}\n\n{options_doc()}"


def takes_settings(fn):
    """Append Settings' options to `fn`'s docstring: `help(fn)` lists the keywords it takes."""
    fn.__doc__ = f"{inspect.cleandoc(fn.__doc__)}\n\n{options_doc()}"
    return fn


def settings_from(settings: Settings | None, options: dict, what: str) -> Settings:
    """`what(..., settings, **options)` -> one Settings: the keyword options over `settings`'
    fields (`dataclasses.replace`, checked again), or over the defaults."""
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(
            f"{what}() takes an asyncmoe.Settings as its second argument, got {settings!r}; "
            f"options go by keyword: {what}(..., cache=16)"
        )
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTIONS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise TypeError(
            f"{what}() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes "
            f"{', '.join(OPTIONS)} (the fields of asyncmoe.Settings)"
        )
    if settings is None:
        return Settings(**options)
    return dataclasses.replace(settings, **options)
