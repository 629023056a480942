"""The CPU executor of a model: every layer whose routed experts the host's CPU computes
(`cache=0`), and how a forward reaches it.

Model on CUDA: one channel in pinned memory and its worker thread (worker.py) serve every layer; a
layer's call sends its pairs and hidden rows and receives the outputs through two kernels
(request.py), in chunks of at most `max_tokens` tokens, all inside whatever graph is being captured.
Model on the CPU: the same kernels run in-line on a thread pool. Every executor of the process computes on
one pool (`kernels.shared_pool`), which its users take turns on.

The custom op `asyncmoe::cpu_experts` names its executor by an id (ops.py), so a compiled graph
holds an int, not the executor.

Dims: T tokens, k experts a token, P = T*k pairs, H hidden.
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref
from dataclasses import dataclass

import torch

from ...cache.host import PinnedBlock, device_view, uva_view
from ..experts import combine
from . import request
from .kernels import STATS, CpuExperts, experts_mlp, shared_pool
from .worker import Channel, Worker, channel_layout

_executors: weakref.WeakValueDictionary[int, CpuExecutor] = weakref.WeakValueDictionary()
_ids = itertools.count()


class CpuExecutorError(RuntimeError):
    """A GPU wait for the CPU failed: what it waited for and why (the CUDA context is lost)."""


@dataclass(frozen=True)
class CpuSettings:
    """`threads`: the CPU threads computing experts, those of the process's shared pool (None: the live
    pool's, or `default_threads`: all but one core, two for a model on CUDA). `max_tokens`: rows in
    one request; a longer call is sent in chunks.
    `timeout_s`: how long the GPU waits for one chunk before it fails."""

    threads: int | None = None
    max_tokens: int = 256
    timeout_s: float = 60.0


class CpuExecutor:
    """The host's CPU computing `layers` (index: the layer's number in requests) for a model running
    on `device`, whose hidden states are `x_dtype`; at most `top_k` experts a token."""

    def __init__(
        self,
        layers: list[CpuExperts],
        device: torch.device,
        x_dtype: torch.dtype,
        top_k: int,
        settings: CpuSettings = CpuSettings(),
    ):
        self.layers, self.device, self.x_dtype, self.top_k = layers, device, x_dtype, top_k
        self.settings = settings
        self.pool = shared_pool(settings.threads, beside_gpu=device.type == "cuda")
        self.hidden = layers[0].hidden
        self.id = next(_ids)
        _executors[self.id] = self
        if device.type == "cuda":
            self._start_worker()
        else:
            self.counts = torch.zeros(len(layers), len(STATS), dtype=torch.int64)
            self.pending: torch.Tensor | None = None  # the outputs `send` computed in-line

    def _start_worker(self) -> None:
        T, H = self.settings.max_tokens, self.hidden
        self.block = PinnedBlock(channel_layout(T * self.top_k, T, H, self.x_dtype).nbytes)
        self.block.data.zero_()
        self.channel = Channel(T * self.top_k, T, H, self.x_dtype, buffer=self.block.data)
        self.gpu = self.channel.fields(uva_view(self.block, self.device))
        self.worker = Worker(self.channel, self.layers, self.pool)
        self.seq = torch.zeros(1, dtype=torch.int64, device=self.device)  # the last request sent
        host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        self.fault, self.fault_view = host, device_view(host, self.device)
        # per layer: requests received, ns the GPU waited for them (request.WAITS, WAITED_NS)
        self.waited = torch.zeros(len(self.layers), 2, dtype=torch.int64, device=self.device)

    def compute(self, x: torch.Tensor, top_k_index: torch.Tensor, layer: int) -> torch.Tensor:
        """Every pair's expert output of `layer`, float32 [T*k, H]: pair t*k + j is token t's j-th
        routed expert, as `top_k_index` [T, k] says."""
        T, k = top_k_index.shape
        out = torch.empty(T * k, self.hidden, dtype=torch.float32, device=self.device)
        chunk = self.settings.max_tokens
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            self.send(x[t0:t1], top_k_index[t0:t1], layer)
            out[t0 * k : t1 * k] = self.receive(layer, (t1 - t0) * k)
        return out

    def check_request(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Raise unless rows `x` [T, H] and pairs `ids` [T, k] fit one request of this executor."""
        T, k = ids.shape
        if x.dtype != self.x_dtype or x.shape != (T, self.hidden) or x.device != self.device:
            raise ValueError(
                f"the CPU executor of this model takes hidden states [T, {self.hidden}] "
                f"{self.x_dtype} on {self.device}, got {tuple(x.shape)} {x.dtype} on {x.device}: "
                "run the model in the dtype and on the device it was compiled for"
            )
        if T > self.settings.max_tokens or k > self.top_k:
            raise ValueError(
                f"one request holds at most {self.settings.max_tokens} tokens of {self.top_k} "
                f"experts, got ids {tuple(ids.shape)}: send longer calls in chunks (compute)"
            )

    def send(self, x: torch.Tensor, ids: torch.Tensor, layer: int) -> None:
        """Start computing the pairs of `ids` [T, k] (T <= max_tokens) on rows `x` [T, H]; a pair of
        expert -1 is skipped. `receive` takes the outputs; one request is in flight at a time."""
        self.check_request(x, ids)
        if self.device.type != "cuda":
            T, k = ids.shape
            token_ids = torch.arange(T).repeat_interleave(k)
            self.pending = experts_mlp(
                self.layers[layer], x, token_ids, ids.flatten(), self.pool, self.counts[layer]
            )
            return
        request.send(x.contiguous(), ids.contiguous(), self.seq, self.gpu, layer)

    def receive(self, layer: int, pairs: int) -> torch.Tensor:
        """The outputs of the request `send` started, float32 [pairs, H] (rows of skipped pairs
        unset). On CUDA a kernel waits for them, failing loudly after the timeout."""
        if self.device.type != "cuda":
            out, self.pending = self.pending, None
            return out
        out = torch.empty(pairs, self.hidden, dtype=torch.float32, device=self.device)
        timeout_ns = int(self.settings.timeout_s * 1e9)
        request.receive(self.seq, self.gpu, out, self.fault_view, self.waited, layer, timeout_ns)
        return out

    def combine(
        self, gpu_out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int, dtype: torch.dtype
    ) -> torch.Tensor:  # fmt: skip
        """Each token's output [T, H] in `dtype`: its pairs' outputs weighted by `weights` [T, k] and
        summed (`compute.experts.combine`), where a pair's output is the CPU's (from the request
        `send` started, rounded to gpu_out's dtype) where `ids` [T, k] names an expert and
        `gpu_out`'s [T*k, H] row elsewhere. On CUDA one kernel waits as `receive` does and reads
        only the CPU's rows over the link."""
        if self.device.type != "cuda":
            cpu_out, self.pending = self.pending, None
            on_cpu = (ids >= 0).reshape(-1, 1)
            return combine(torch.where(on_cpu, cpu_out.to(gpu_out.dtype), gpu_out), weights, dtype)
        out = torch.empty(ids.shape[0], self.hidden, dtype=dtype, device=gpu_out.device)
        timeout_ns = int(self.settings.timeout_s * 1e9)
        parts = request.Combine(ids.contiguous(), gpu_out.contiguous(), weights.contiguous())
        request.receive(
            self.seq, self.gpu, out, self.fault_view, self.waited, layer, timeout_ns, parts
        )
        return out

    def stats(self, reset: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per layer: the worker's counters [layers, len(STATS)] and, on CUDA, the GPU's waits
        [layers, 2] (requests, ns); a host sync, on request only."""
        if self.device.type != "cuda":
            counts = self.counts.clone()
            if reset:
                self.counts.zero_()
            return counts, None
        # the host sync stats are read with, on request, never in a forward
        waited = self.waited.cpu()
        if reset:
            self.waited.zero_()
        return self.worker.stats(reset), waited

    def check(self, patience_s: float = 0.1) -> None:
        """Raise if a GPU wait for this executor failed (its kernel then ended the CUDA context).
        Called after a CUDA error: the fault's writes may still be on their way, so it looks for
        `patience_s`, reading pinned memory only."""
        if self.device.type != "cuda":
            return
        deadline = time.monotonic() + patience_s
        while not int(self.fault[request.FAULT_KIND]):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        seq, layer, seen, kind = self.fault.tolist()  # pinned host memory: no sync
        if kind == request.TIMED_OUT:
            why = (
                f"the GPU waited more than {self.settings.timeout_s:g} s for the CPU's outputs of "
                f"request {seq} (layer {layer}); the worker had answered up to request {seen}. "
                "The worker thread is stalled or far slower than expected: check that this "
                "process has CPU cores to itself (cpu_threads=) and is not being stopped"
            )
        else:
            why = (
                f"the CPU worker refused request {seq} of layer {layer} with error {seen} "
                "(asyncmoe.compute.cpu.kernels.ERRORS)"
            )
        raise CpuExecutorError(f"asyncmoe CPU executor: {why}. The CUDA context is lost.")


def executor(id: int) -> CpuExecutor:
    """The live executor of that id (the custom op's argument)."""
    found = _executors.get(id)
    if found is None:
        raise ValueError(f"no live CPU executor {id}: its model was freed")
    return found


def check_all() -> None:
    """Raise for the first executor whose GPU wait failed (see `CpuExecutor.check`)."""
    for ex in list(_executors.values()):
        ex.check()


def explains_cpu_faults(fn):
    """`fn`, whose CUDA errors are preceded by the reason where a CPU executor's wait failed."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CpuExecutorError:
            raise
        except RuntimeError:
            check_all()
            raise

    return wrapped
