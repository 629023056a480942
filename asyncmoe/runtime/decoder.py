"""`asyncmoe.Decoder`: prefill eagerly, then replay one CUDA graph per generated token.

A decode step is the model's forward on one token per sequence with a `StaticCache` (every asyncmoe
op included: ensure, prefetch on the side stream, the copies), the choice of the next token, the
padding of finished sequences and the bookkeeping of the position, all on the device; the host only
replays. Eager decode steps spend most of their time launching kernels from Python, so without the
graph no offload scheme gets near the resident ceiling (docs/decisions.md#cuda-graph-decode).

Dims: B batch, L prompt length, N max length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import masking_utils
from transformers.cache_utils import StaticLayer

from ..cache.host import available_host_bytes, human_bytes
from ..compute.cpu.executor import explains_cpu_faults
from ..integrations.install import kv_cache_bytes
from ..integrations.replay import replays
from ..integrations.transformers import (
    PROVIDER,
    check_model,
    families_hint,
    find_experts,
    top_k_of,
)
from ..prefetch.prefetch_gate import EXPLORE_EVERY
from ..providers import CachedProvider, prefetch_paused
from ..settings import check_bool, is_int
from .sampling import check_sampling, sample


@dataclass
class Generation:
    # [B, longest sequence], prompt included; past a sequence's EOS: pad_token_id
    tokens: torch.Tensor
    # [B] prompt + new tokens of each sequence, up to and including its first EOS
    lengths: torch.Tensor
    new_tokens: int  # the longest sequence's
    prefill_ms: float
    decode_ms_per_token: float  # wall time of the decode loop / decode steps it ran

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.decode_ms_per_token if self.decode_ms_per_token else float("inf")


def _token_ids(value, name: str) -> list[int]:
    """An id or a list of ids, each an int >= 0."""
    ids = [value] if is_int(value) else value
    if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    if any(t < 0 for t in ids):
        raise ValueError(f"{name} must hold token ids >= 0, got {value!r}")
    return [int(t) for t in ids]


def stop_tokens(model: nn.Module, eos_token_id, pad_token_id) -> tuple[list[int], int | None]:
    """EOS ids and the pad that follows a finished sequence, resolved as transformers' generate
    does: the model's generation config fills what is not given, and the pad falls back to the first
    EOS id."""
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id, name = (
            getattr(config, "eos_token_id", None),
            "model.generation_config.eos_token_id",
        )
    else:
        name = "eos_token_id"
    eos = [] if eos_token_id is None else _token_ids(eos_token_id, name)
    if pad_token_id is None:
        pad_token_id, name = (
            getattr(config, "pad_token_id", None),
            "model.generation_config.pad_token_id",
        )
    else:
        name = "pad_token_id"
    if pad_token_id is None:
        return eos, eos[0] if eos else None
    if not is_int(pad_token_id):
        raise TypeError(f"{name} must be an int, got {pad_token_id!r}")
    return eos, _token_ids(pad_token_id, name)[0]


def check_prompts(input_ids, batch_size: int, vocab: int) -> tuple[int, int]:
    """[B, L] integer token ids of the model's vocabulary, B = the Decoder's batch_size; returns (B,
    L)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            "input_ids must be a torch.Tensor of token ids [batch, length], got "
            f"{type(input_ids).__name__}"
        )
    if input_ids.ndim != 2:
        raise ValueError(
            f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}; for one "
            "prompt use input_ids[None]"
        )
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise TypeError(
            f"input_ids must hold integer token ids, got {input_ids.dtype}; convert "
            "with input_ids.long()"
        )
    B, L = input_ids.shape
    if B != batch_size:
        raise ValueError(f"this Decoder was built for batch_size={batch_size}; got {B} prompts")
    if L == 0:
        raise ValueError("input_ids has no tokens: each prompt needs at least one")
    if input_ids.min() < 0 or input_ids.max() >= vocab:
        raise ValueError(
            f"input_ids must be token ids in [0, {vocab}), the model's vocabulary; got values in "
            f"[{input_ids.min().item()}, {input_ids.max().item()}]"
        )
    return B, L


def warn_past_positions(model: nn.Module, length: int, what: str) -> None:
    """Warn, as transformers' generate does, where a length runs past the positions the model was
    trained for: its output degenerates there."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and length > positions:
        warnings.warn(
            f"{what}={length} is past the model's max_position_embeddings={positions}: tokens past "
            "that position "
            "are likely to be gibberish (the model was not trained on them)",
            stacklevel=3,
        )


def check_memory(model: nn.Module, batch_size: int, max_length: int, device: torch.device) -> None:
    """Refuse a KV cache and token history that cannot fit in the device's free memory, before any
    of it is allocated."""
    itemsize = model.dtype.itemsize
    need = (
        kv_cache_bytes(model.config, max_length, batch_size, itemsize) + 8 * batch_size * max_length
    )
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_host_bytes()
    if need > free:
        raise MemoryError(
            f"Decoder(batch_size={batch_size}, max_length={max_length}) needs "
            f"{human_bytes(need)} on {device} for its KV cache and token history, but "
            f"{human_bytes(free)} is free: give the max_length a run needs, prompt + new tokens "
            "(the default is the model's max_position_embeddings, at most 4096)"
        )


def check_capturable(model: nn.Module, batch_size: int) -> None:
    """A captured step must serve every call in one wave: cache >= min(E, B*k) per cached layer,
    but a hybrid layer, whose CPU takes the excess of a batch of one CPU request."""
    for name, m in find_experts(model):
        provider = getattr(m, PROVIDER, None)
        if not isinstance(provider, CachedProvider):
            continue
        hybrid = provider.hybrid
        if hybrid is not None and batch_size <= hybrid.executor.settings.max_tokens:
            continue
        cache, k = provider.cache, top_k_of(m.config) or 1
        need = min(cache.num_experts, batch_size * k)
        if cache.num_slots < need:
            cpu = (
                ", or compile with hybrid=True: its CPU takes the excess" if hybrid is None else ""
            )
            raise ValueError(
                f"capturing a decode step of batch {batch_size} needs cache >= "
                f"min(num_experts={cache.num_experts}, "
                f"batch*top_k={batch_size * k}) = {need} slots per layer, but {name} has "
                f"{cache.num_slots}: with "
                "fewer, one step's distinct experts can exceed the slots and be served in waves "
                "copied on the compute "
                f"stream, which the graph would serialise. Use cache>={need}, or "
                f"batch_size<={cache.num_slots // k}, "
                f"or Decoder(..., waves=True) to capture the waves anyway{cpu}."
            )


def eager_mask(*, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """transformers' eager-attention mask (0 where attended, the dtype's minimum elsewhere), built
    from a zero made on the device: transformers 5.17 makes it with `torch.tensor(0.0, device=...)`,
    a host-to-device copy that a CUDA graph cannot capture, so eager-attention models (GPT-OSS)
    would not capture."""
    kwargs.pop("allow_is_causal_skip", None)
    mask = masking_utils.sdpa_mask(allow_is_causal_skip=False, **kwargs)
    if mask is None:
        return None
    return torch.where(
        mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min
    )


@contextlib.contextmanager
def capturable_masks():
    """While a step is warmed up and captured, eager attention takes its mask from `eager_mask`."""
    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    before = masks["eager"]
    masks["eager"] = eager_mask
    try:
        yield
    finally:
        masks["eager"] = before


def static_cache(model: nn.Module, max_length: int) -> transformers.StaticCache:
    """transformers' StaticCache with every sliding-window layer kept whole. A sliding layer decides
    on the host whether it is full (then it rolls its keys), so a step captured before the window
    fills would write past it once it has; a whole layer, read through the model's own
    sliding-window mask, attends to the same keys."""
    kv = transformers.StaticCache(config=model.config, max_cache_len=max_length)
    kv.layers = [
        StaticLayer(max_cache_len=max_length) if layer.is_sliding else layer for layer in kv.layers
    ]
    return kv


# decode steps between the host's looks at whether every sequence has finished (one sync each)
CHECK_EVERY = 16
LEAD = 4  # most graph steps the host queues ahead of the GPU while it reads the prefetch gates


class Gates:
    """Whether the next decode step prefetches, from the prefetch gates as the device last wrote
    them to pinned memory (`PrefetchBuffers.gate_open_host`: no sync). While every gate is closed a
    step skips prefetch (`prefetch_paused`): a closed gate copies nothing, but a step with prefetch
    costs its side streams' dependencies all the same
    (docs/decisions.md#a-step-without-prefetch-while-every-gate-is-closed). One step in
    EXPLORE_EVERY still runs the predictors, on which closed gates explore as they would every
    step.

    A step of `batch_size` tokens whose pairs exceed every layer's slots, each layer's excess taken by
    the CPU (the hybrid), never prefetches (`off`): the CPU takes at least the excess whatever the
    slots hold, so a prefetch cannot shorten its share, and a copy beside it takes host memory the
    CPU reads (docs/decisions.md#no-prefetch-where-the-cpu-takes-a-batchs-excess)."""

    def __init__(self, providers: list[CachedProvider], batch_size: int, top_k: int):
        targets = {id(t): t for p in providers for t in p.links.targets}.values()
        self.flags = [t.prefetch.gate_open_host.numpy() for t in targets]
        self.closed = 0  # steps since a gate was last seen open
        self.off = bool(self.flags) and all(
            p.hybrid is not None
            and batch_size <= p.hybrid.executor.settings.max_tokens
            and batch_size * top_k > p.cache.num_slots
            for p in providers
        )

    def __bool__(self) -> bool:
        return bool(self.flags)

    def prefetch(self) -> bool:
        if self.off:
            return False
        if any(flag[0] for flag in self.flags):
            self.closed = 0
            return True
        self.closed += 1
        return self.closed % EXPLORE_EVERY == 0


def cached_providers(model: nn.Module) -> list[CachedProvider]:
    return [
        p
        for _, m in find_experts(model)
        if isinstance(p := getattr(m, PROVIDER, None), CachedProvider)
    ]


def kv_keyword(model: nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache by: `past_key_values` up to transformers 5.2x,
    then `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Decoder:
    """Generate with a static KV cache, one CUDA graph per step (eager steps on the CPU).

    `batch_size` sequences of equal prompt length; `max_length` bounds prompt + new tokens (default:
    the model's max_position_embeddings, at most 4096; past them it warns, as transformers' generate
    does; a KV cache that cannot fit in the free memory is refused). The model is a transformers MoE
    model, asyncmoe-compiled or unmodified. The first `generate` with a given sampling mode captures
    its graph; later calls replay it. A sequence that has produced an EOS is fed `pad_token_id` from
    then on, on the device, as transformers does.

    A captured step refuses a cache smaller than one step's possible experts (`check_capturable`)
    unless `waves=True`: then each layer runs the most waves its shapes allow (`num_waves`, fixed,
    so capturable), each wave's copies on the compute stream after the previous wave's compute, and
    waves with nothing to copy still launch their kernels. A hybrid layer needs neither: its CPU
    takes what the slots cannot hold, so a batch of one CPU request is one wave.

    With prefetch, each step runs with it or without it as the prefetch gates ask (`Gates`; a graph
    of each), and the host queues at most LEAD graph steps ahead of the GPU, so that it reads the
    gates of recent steps.

    `compile=True` runs each step's forward through `torch.compile` (Inductor fuses the model's
    many small ops around the experts into few kernels); the first step of each kind compiles,
    for seconds to minutes, and prompts stay eager, so no prompt length compiles again.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size: int = 1,
        max_length: int | None = None,
        graph: bool | None = None,
        waves: bool = False,
        compile: bool = False,
    ):
        check_model(model)
        if not find_experts(model):
            raise ValueError(
                f"{type(model).__name__} has no MoE layer: the Decoder runs transformers MoE "
                f"models, asyncmoe-compiled or unmodified (to compare with); {families_hint()}"
            )
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if graph is not None and not isinstance(graph, bool):
            raise TypeError(
                f"graph must be True, False or None (graphs on CUDA, eager steps elsewhere), got "
                f"{graph!r}"
            )
        check_bool("waves", waves)
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(
                "batch_size must be an int >= 1, the number of prompts per call; got "
                f"{batch_size!r}"
            )
        if max_length is None:  # the model's positions, up to a KV cache of 4096
            max_length = min(4096, getattr(model.config, "max_position_embeddings", None) or 4096)
        if not is_int(max_length) or max_length < 2:
            raise ValueError(
                f"max_length must be an int >= 2, room for prompt + new tokens; got {max_length!r}"
            )
        self.model, self.batch_size, self.max_length = model, int(batch_size), int(max_length)
        self._step_model = torch.compile(model, dynamic=False) if compile else model
        self.device = model.device
        self.vocab = model.get_input_embeddings().num_embeddings  # ids a prompt may hold
        self.graphed = self.device.type == "cuda" if graph is None else graph
        if self.graphed and self.device.type != "cuda":
            raise ValueError(
                "graph=True captures each step in a CUDA graph, which needs a model on a CUDA "
                "device; this model is "
                f"on {self.device}. Compile it onto the GPU (asyncmoe.compile(model, ..., "
                "device='cuda')) or pass "
                "graph=False (or leave graph=None: graphs on CUDA, eager steps elsewhere)"
            )
        warn_past_positions(model, max_length, "max_length")
        check_memory(model, batch_size, max_length, self.device)
        if self.graphed and not waves:
            check_capturable(model, batch_size)
        self.kv = static_cache(model, max_length)
        self._kv_arg = kv_keyword(model)
        i64 = dict(dtype=torch.long, device=self.device)
        self.tok = torch.zeros(batch_size, 1, **i64)  # the token fed to the next step
        self.pos = torch.zeros(1, **i64)  # its position
        self.history = torch.zeros(batch_size, max_length, **i64)
        # [B] has produced an EOS
        self.done = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self.pad = torch.zeros(1, **i64)  # what a finished sequence is fed
        # [B, V] of the last step, for inspection; allocated by the first forward
        self.logits = None
        self.is_eos = None  # [V] bool, allocated with the logits
        self.temperature = torch.ones(1, device=self.device)
        self.top_p = torch.ones(1, device=self.device)
        # (do_sample, top_k, prefetch)
        self._graphs: dict[tuple[bool, int, bool], torch.cuda.CUDAGraph] = {}
        self.cached = cached_providers(model)
        self.gates = Gates(self.cached, batch_size, top_k_of(model.config) or 1)
        # replayed layers' host counts, which graph and compiled steps do not run the hook of
        self.replays = replays(model) if self.graphed or compile else []
        # one a graph step the GPU may not have run yet
        self._queued: deque[torch.cuda.Event] = deque()
        self._sampling = None  # (do_sample, top_k) of the last prefill: the graph's key
        # tokens in `history`, kept on the host so decoding never waits for the device
        self.length = 0
        self.stops = False  # whether the last prefill has EOS ids the model can produce

    def _forward(self, ids: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """The last position's logits of `ids` through `model` (None: the model itself; a step
        passes its compiled forward)."""
        # positions come from the StaticCache's own device-side length, so a replayed step advances
        # them
        model = self.model if model is None else model
        logits = model(input_ids=ids, **{self._kv_arg: self.kv}).logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
            self.is_eos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=self.device)
        self.logits.copy_(logits)
        return logits

    def _finish(self, nxt: torch.Tensor) -> torch.Tensor:
        """Pad for sequences already finished, then mark those that just produced an EOS; [B] ->
        [B]."""
        nxt = torch.where(self.done, self.pad, nxt)
        self.done |= self.is_eos[nxt]
        return nxt

    @torch.no_grad()
    def _step(self, do_sample: bool, top_k: int) -> None:
        logits = self._forward(self.tok, self._step_model)
        nxt = self._finish(sample(logits, do_sample, top_k, self.temperature, self.top_p))  # [B]
        self.history.index_copy_(1, self.pos + 1, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)

    def _paused(self, prefetch: bool):
        return contextlib.nullcontext() if prefetch else prefetch_paused(self.cached)

    def _capture(self, sampling: tuple[bool, int]) -> None:
        """Capture a step with prefetch and, where the gates may close, one without. Warm-up and
        capture run on whatever state is there; `prefill` resets it after."""
        for prefetch in (False,) if self.gates.off else (True, False) if self.gates else (True,):
            key = (*sampling, prefetch)
            if key in self._graphs:
                continue
            self.kv.reset()
            self.pos.zero_()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream())
            with capturable_masks(), self._paused(prefetch):
                # warm-up: KV allocation, cuBLAS handles, Triton compiles
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._step(*sampling)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._step(*sampling)
            self._graphs[key] = graph

    def _set_stops(self, eos: list[int], pad: int | None) -> None:
        """Fill the EOS table and the pad in place (a captured step reads them). Ids past the logits
        are never chosen, so they end nothing; where an id can end a sequence, the pad must be a
        token the model can read."""
        live = [t for t in eos if t < self.is_eos.numel()]
        if live and not pad < self.vocab:
            raise ValueError(
                f"pad_token_id={pad} is outside the model's vocabulary of {self.vocab}: a finished "
                "sequence is fed it; pass pad_token_id=<an id below the vocabulary size>"
            )
        self.is_eos.zero_()
        self.is_eos[live] = True
        self.pad.fill_(pad if live else 0)
        self.stops = bool(live)

    @explains_cpu_faults
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Reset, run the prompts eagerly (waves where needed), choose the first new token [B];
        capture if needed.

        `eos_token_id` and `pad_token_id` default to the model's generation config, as in
        `generate`."""
        B, L = check_prompts(input_ids, self.batch_size, self.vocab)
        if L >= self.max_length:
            raise ValueError(
                f"prompt length {L} leaves no room in max_length={self.max_length}; "
                f"use Decoder(..., max_length={L + 1}) or more"
            )
        check_sampling(do_sample, temperature, top_k, top_p)
        if seed is not None and not is_int(seed):
            raise TypeError(f"seed must be an int (torch.manual_seed's) or None, got {seed!r}")
        eos, pad = stop_tokens(self.model, eos_token_id, pad_token_id)
        outside = [t for t in eos if t >= self.vocab] if eos_token_id is not None else []
        if outside:
            raise ValueError(
                f"eos_token_id={eos_token_id!r} holds ids outside the model's vocabulary of "
                f"{self.vocab} ({', '.join(map(str, outside))}): the model never produces them, "
                f"so they would end nothing; pass ids below {self.vocab}, or eos_token_id=[] to "
                "stop only at max_new_tokens"
            )
        self._sampling = (True, int(top_k)) if do_sample else (False, 0)
        if self.graphed:
            self._capture(self._sampling)
        if seed is not None:
            torch.manual_seed(seed)
        self.temperature.fill_(temperature if do_sample else 1.0)
        self.top_p.fill_(top_p if do_sample else 1.0)
        self.kv.reset()
        ids = input_ids.to(self.device, torch.long)
        logits = self._forward(ids)
        self._set_stops(eos, pad)
        self.done.zero_()
        first = self._finish(sample(logits, *self._sampling, self.temperature, self.top_p))
        self.history[:, :L] = ids
        self.history[:, L] = first
        self.tok.copy_(first[:, None])
        self.pos.fill_(L)
        self.length = L + 1
        return first

    @explains_cpu_faults
    def decode(self, steps: int) -> None:
        """`steps` more tokens after `prefill`: graph replays on the GPU, eager steps elsewhere. A
        sequence past its EOS gets `pad_token_id`; the steps run all the same (`generate` stops when
        every sequence is done)."""
        if not is_int(steps) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if self._sampling is None:
            raise ValueError("decode continues a prefill: call prefill(input_ids) first")
        if self.length + steps > self.max_length:
            raise ValueError(f"{steps} more steps would pass max_length={self.max_length}")
        self.length += steps
        for _ in range(steps):
            for replay in self.replays:
                replay.count(self.batch_size)
            prefetch = not self.gates or self.gates.prefetch()
            if not self.graphed:
                with self._paused(prefetch):
                    self._step(*self._sampling)
                continue
            self._graphs[(*self._sampling, prefetch)].replay()
            if self.gates:  # the gates the host reads are at most LEAD steps old
                # the host sleeps while it waits
                self._queued.append(torch.cuda.Event(blocking=True))
                self._queued[-1].record()
                if len(self._queued) > LEAD:
                    self._queued.popleft().synchronize()

    def _lengths(self, prompt_length: int) -> torch.Tensor:
        """[B] prompt + new tokens of each sequence in `history`, up to and including its first
        EOS."""
        new = self.history[:, prompt_length : self.length]  # [B, n]
        hit = self.is_eos[new]
        return prompt_length + torch.where(hit.any(1), hit.int().argmax(1) + 1, new.shape[1])

    @explains_cpu_faults
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        callback: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """Greedy (default) or sampled generation, with transformers' `generate` semantics for the
        stop.

        Each sequence ends at its first `eos_token_id` (an id or a list; default the model's
        generation config) and holds `pad_token_id` after it (default the config's, else the first
        EOS id); the loop ends when every sequence has ended or after `max_new_tokens`. The host
        looks every CHECK_EVERY steps, so up to that many steps run past the last EOS; `tokens` is
        cut to the longest sequence. `callback` gets each step's tokens (a host sync per token) and
        the loop then ends right at the last EOS.
        """
        _, L = check_prompts(input_ids, self.batch_size, self.vocab)
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if L + max_new_tokens > self.max_length:
            raise ValueError(
                f"prompt {L} + max_new_tokens {max_new_tokens} exceeds "
                f"max_length={self.max_length}; "
                f"use Decoder(..., max_length={L + max_new_tokens}) or fewer new tokens"
            )
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        first = self.prefill(
            input_ids, do_sample, temperature, top_k, top_p, seed, eos_token_id, pad_token_id
        )
        if callback:
            callback(first.tolist())  # host sync, between graph replays: streaming asked for it
        sync()
        t1 = time.perf_counter()
        n, check_every = 1, 1 if callback else CHECK_EVERY
        while n < max_new_tokens and not (self.stops and n % check_every == 0 and self.done.all()):
            self.decode(1)
            n += 1
            if callback:
                callback(self.tok[:, 0].tolist())  # host sync between replays, as above
        sync()
        t2 = time.perf_counter()
        lengths = self._lengths(L)
        longest = int(lengths.max())
        return Generation(
            self.history[:, :longest].clone(),
            lengths,
            longest - L,
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3 / max(n - 1, 1),
        )
