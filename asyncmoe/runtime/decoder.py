"""`asyncmoe.Decoder`: prefill eagerly, then replay one CUDA graph per generated token.

A decode step is the model's forward on one token per sequence with a `StaticCache` (every asyncmoe
op included: ensure, prefetch on the side stream, the copies), the choice of the next token, and
the bookkeeping of the position, all on the device; the host only replays. Eager Python costs six
times the graph's time on an OLMoE-shaped model (DESIGN.md), so without the graph no offload scheme
gets near the resident ceiling.

Dims: B batch, L prompt length, N max length, V vocabulary.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable

import torch
import transformers
from torch import nn

from ..integrations.transformers import PROVIDER, find_experts, top_k_of
from ..providers import CachedProvider
from .sampling import sample


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, L + new_tokens], prompt included
    new_tokens: int
    prefill_ms: float
    decode_ms_per_token: float  # wall time of the decode loop / tokens it produced

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.decode_ms_per_token if self.decode_ms_per_token else float("inf")


def check_capturable(model: nn.Module, batch_size: int) -> None:
    """A captured step must serve every call in one wave: cache >= min(E, B*k) per cached layer."""
    for name, m in find_experts(model):
        provider = getattr(m, PROVIDER, None)
        if not isinstance(provider, CachedProvider):
            continue
        cache, k = provider.cache, top_k_of(m.config) or 1
        need = min(cache.num_experts, batch_size * k)
        if cache.num_slots < need:
            raise ValueError(
                f"capturing a decode step of batch {batch_size} needs cache >= min(num_experts={cache.num_experts}, "
                f"batch*top_k={batch_size * k}) = {need} slots per layer, but {name} has {cache.num_slots}: with fewer, "
                "one step's distinct experts can exceed the slots and be served in waves copied on the compute "
                f"stream, which the graph would serialise. Use cache>={need}, or batch_size<={cache.num_slots // k}, "
                "or Decoder(..., waves=True) to capture the waves anyway."
            )


class Decoder:
    """Generate with a static KV cache, one CUDA graph per step (eager steps on the CPU).

    `batch_size` sequences of equal prompt length; `max_length` bounds prompt + new tokens.
    The first `generate` with a given sampling mode captures its graph; later calls replay it.

    A captured step refuses a cache smaller than one step's possible experts (`check_capturable`) unless
    `waves=True`: then each layer runs the most waves its shapes allow (`num_waves`, fixed, so capturable),
    each wave's copies on the compute stream after the previous wave's compute, and waves with nothing
    to copy still launch their kernels.
    """

    def __init__(self, model: nn.Module, batch_size: int = 1, max_length: int = 4096, graph: bool | None = None,
                 waves: bool = False):
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.device = model.device
        self.graphed = self.device.type == "cuda" if graph is None else graph
        if self.graphed and not waves:
            check_capturable(model, batch_size)
        self.kv = transformers.StaticCache(config=model.config, max_cache_len=max_length)
        # the KV cache's keyword: `past_key_values` up to transformers 5.2x, then `cache`
        self._kv_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        i64 = dict(dtype=torch.long, device=self.device)
        self.tok = torch.zeros(batch_size, 1, **i64)  # the token fed to the next step
        self.pos = torch.zeros(1, **i64)  # its position
        self.history = torch.zeros(batch_size, max_length, **i64)
        self.logits = None  # [B, V] of the last step, for inspection; allocated by the first forward
        self.temperature = torch.ones(1, device=self.device)
        self.top_p = torch.ones(1, device=self.device)
        self._graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        # positions come from the StaticCache's own device-side length, so a replayed step advances them
        logits = self.model(input_ids=ids, **{self._kv_arg: self.kv}).logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        return logits

    @torch.no_grad()
    def _step(self, do_sample: bool, top_k: int) -> None:
        logits = self._forward(self.tok)
        nxt = sample(logits, do_sample, top_k, self.temperature, self.top_p)  # [B]
        self.history.index_copy_(1, self.pos + 1, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)

    def _graph(self, key: tuple[bool, int]) -> torch.cuda.CUDAGraph:
        """Capture one step. Warm-up and capture run on whatever state is there; `generate` resets it after."""
        if key not in self._graphs:
            self.kv.reset()
            self.pos.zero_()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: KV allocation, cuBLAS handles, Triton compiles
                for _ in range(2):
                    self._step(*key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step(*key)
            self._graphs[key] = graph
        return self._graphs[key]

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Reset, run the prompts eagerly (waves where needed), choose the first new token [B]; capture if needed."""
        B, L = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"this Decoder was built for batch_size={self.batch_size}; got {B} prompts")
        if L >= self.max_length:
            raise ValueError(f"prompt length {L} leaves no room in max_length={self.max_length}")
        self._sampling = (do_sample, top_k)
        if self.graphed:
            self._graph(self._sampling)
        if seed is not None:
            torch.manual_seed(seed)
        self.temperature.fill_(temperature)
        self.top_p.fill_(top_p)
        self.kv.reset()
        ids = input_ids.to(self.device)
        first = sample(self._forward(ids), do_sample, top_k, self.temperature, self.top_p)
        self.history[:, :L] = ids
        self.history[:, L] = first
        self.tok.copy_(first[:, None])
        self.pos.fill_(L)
        self.length = L + 1  # tokens in `history`, kept on the host so decoding never waits for the device
        return first

    def decode(self, steps: int) -> None:
        """`steps` more tokens after `prefill`: graph replays on the GPU, eager steps elsewhere."""
        if self.length + steps > self.max_length:
            raise ValueError(f"{steps} more steps would pass max_length={self.max_length}")
        self.length += steps
        for _ in range(steps):
            if self.graphed:
                self._graphs[self._sampling].replay()
            else:
                self._step(*self._sampling)

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
        eos_token_id: int | None = None,
        callback: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """Greedy (default) or sampled generation; `callback` gets each step's tokens (a host sync per token)."""
        L = input_ids.shape[1]
        if L + max_new_tokens > self.max_length:
            raise ValueError(f"prompt {L} + max_new_tokens {max_new_tokens} exceeds max_length={self.max_length}")
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        first = self.prefill(input_ids, do_sample, temperature, top_k, top_p, seed)
        if callback:
            callback(first.tolist())  # host sync, between graph replays: streaming asked for it
        sync()
        t1 = time.perf_counter()
        n = 1
        check_every = 1 if callback else 16  # the EOS check is a host sync between replays; streaming syncs anyway
        while n < max_new_tokens:
            self.decode(1)
            n += 1
            if callback:
                callback(self.tok[:, 0].tolist())  # host sync between replays, as above
            if eos_token_id is not None and n % check_every == 0 and (self.history[:, L : L + n] == eos_token_id).any(1).all():
                break
        sync()
        t2 = time.perf_counter()
        return Generation(self.history[:, : L + n].clone(), n, (t1 - t0) * 1e3, (t2 - t1) * 1e3 / max(n - 1, 1))
