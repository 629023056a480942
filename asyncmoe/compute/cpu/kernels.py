"""The CPU expert kernels (experts.c) from Python: a layer's description, the thread pool, and the expert MLP.

`CpuExperts` says how one MoE layer's experts are stored in the host store (its two `Projection`s, their
format and layout) and combined (the gate and activation); it checks everything the kernels rely on once, and
refuses what they cannot compute with a message saying why. `experts_mlp` computes the pairs' expert outputs
through ctypes, which releases the GIL for the call.

Dims: E experts, T tokens, P (token, expert) pairs, H hidden, I intermediate; a projection has N outputs and K
inputs.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...formats import FP8, Format, Fp8, Int4, Mxfp4
from . import build

DENSE = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}  # the C side's AMC_F32, AMC_BF16, AMC_F16
FP8_CODE, MXFP4_CODE, INT4_CODE = 3, 4, 5
GATES = {
    "none": 0,
    "halves": 1,
    "gpt_oss": 2,
}  # act(up); act(gate) * up, gate first; GPT-OSS's interleaved gate
ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}
ERRORS = {
    1: "request number out of order (expected {detail})",
    2: "layer {detail} is out of range or was never registered",
    3: "{detail} pairs: negative or above the channel's capacity",
    4: "{detail} tokens: negative or above the channel's capacity",
    5: "pair {detail} has a token id outside [0, T)",
    6: "pair {detail} has an expert id outside [-1, E) (-1: a pair to skip)",
    7: "out of memory for the kernels' workspace",
    8: "layer descriptor refused by the kernels (check {detail})",
}


# a layer's counters, as the worker keeps them (worker.h's AMC_STAT_*): requests served, (token, expert) pairs,
# distinct experts computed (each read once per request), bytes of weights read, ns computing
STATS = ("requests", "pairs", "experts", "bytes", "ns")


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("format", ctypes.c_int32),
        ("bias_format", ctypes.c_int32),
        ("transposed", ctypes.c_int32),
        ("block_rows", ctypes.c_int32),
        ("block_cols", ctypes.c_int32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("up", _Matrix),
        ("down", _Matrix),
        ("experts", ctypes.c_int64),
        ("gate", ctypes.c_int32),
        ("act", ctypes.c_int32),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


class ChannelLayout(ctypes.Structure):
    """Byte offsets of the request channel's fields (worker.h says what each holds)."""

    _fields_ = [
        ("max_pairs", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("x_format", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        *[
            (name, ctypes.c_int64)
            for name in ("request", "awake", "done", "error", "detail", "layer", "pairs", "tokens")
            + ("token_ids", "expert_ids", "x", "out", "nbytes")
        ],
    ]


def library(isa: str = "native") -> ctypes.CDLL:
    """experts.c built for `isa`, its functions' signatures declared."""
    lib = build.load(isa)
    if getattr(lib, "_asyncmoe_declared", False):
        return lib
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    signatures = {
        "amc_isa": (ctypes.c_char_p, []),
        "amc_pool_create": (p, [i32, i64]),
        "amc_pool_destroy": (None, [p]),
        "amc_experts": (
            i32,
            [
                p,
                ctypes.POINTER(_Layer),
                i64,
                p,
                p,
                p,
                i32,
                i64,
                p,
                ctypes.POINTER(i64),
                ctypes.POINTER(i64),
            ],
        ),
        "amc_channel_layout_init": (i32, [ctypes.POINTER(ChannelLayout), i64, i64, i64, i32]),
        "amc_request_publish": (None, [p, i64]),
        "amc_done_wait": (i32, [p, i64, i64]),
        "amc_worker_create": (p, [p, ctypes.POINTER(ChannelLayout), i32, p, i64, i64]),
        "amc_worker_set_layer": (i32, [p, i32, ctypes.POINTER(_Layer)]),
        "amc_worker_start": (i32, [p]),
        "amc_worker_destroy": (None, [p]),
        "amc_worker_stats": (None, [p, p, i32]),
        "amc_worker_sleeping": (i32, [p]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib._asyncmoe_declared = True
    return lib


def default_threads(beside_gpu: bool = False) -> int:
    """The threads a CPU computation takes by default: all but one of the cores this process may run
    on, left to the host's other threads, which would otherwise preempt a thread mid-task and hold the
    whole computation for a scheduler slice (ms); `beside_gpu` (a worker serving the GPU's requests),
    all but two: Python spins on another while it waits for the GPU."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, cores - (2 if beside_gpu else 1))


class Pool:
    """The threads each projection is split over, the calling thread being one of them. Between calls a thread
    spins for `spin_us`, then sleeps until the next call wakes it. Calls from several threads (in-line callers,
    workers) take turns. For another thread count, make another pool; a model's comes from `shared_pool`."""

    def __init__(self, threads: int | None = None, spin_us: float = 200.0, isa: str = "native"):
        self.lib = library(isa)
        threads = default_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(
                f"threads={threads}: a pool needs at least the calling thread (threads >= 1)"
            )
        self.handle = self.lib.amc_pool_create(threads, int(spin_us * 1e3))
        if not self.handle:
            raise MemoryError(f"could not start a pool of {threads} CPU threads")
        self.threads = threads
        self._close = weakref.finalize(self, self.lib.amc_pool_destroy, self.handle)

    def close(self) -> None:
        """Stop and join the threads (also done when the pool is collected, or at exit)."""
        self._close()
        self.handle = None


def _code(t: torch.Tensor | None, what: str) -> int:
    if t is None:
        return 0
    if t.dtype not in DENSE:
        raise ValueError(
            f"{what} is {t.dtype}; the CPU kernels read float32, bfloat16 or float16 there"
        )
    return DENSE[t.dtype]


@dataclass(frozen=True, eq=False)
class Projection:
    """One weight matrix of every expert, as the host store holds it (formats.py):

    - dense (`fmt` None): `weight` [E, N, K] in float32, bfloat16 or float16, or [E, K, N] when `transposed`;
    - `Fp8`: float8_e4m3fn `weight` in the module's own layout as above, float32 `scales` (scale_inv) per block;
    - `Mxfp4` / `Int4`: `weight` [E, N, K/2] uint8 whatever the module's layout, `scales` [E, N, K/group].
    `bias` [E, N] in float32, bfloat16 or float16, or None.
    """

    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    fmt: Format | None = None
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K)."""
        E, rows, cols = self.weight.shape
        if isinstance(self.fmt, (Mxfp4, Int4)):
            return E, rows, cols * 2
        return (E, cols, rows) if self.transposed else (E, rows, cols)

    def check(self, what: str) -> None:
        w, s, fmt = self.weight, self.scales, self.fmt
        tensors = {"weight": w, "scales": s, "bias": self.bias}
        for name, t in tensors.items():
            if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(
                    f"{what}'s {name} must be a contiguous CPU tensor (the host store's), got {t.device}"
                )
        if w.dim() != 3:
            raise ValueError(f"{what}'s weight must be [E, ...] of 3 dims, got {tuple(w.shape)}")
        E, N, K = self.shape
        if fmt is None:
            _code(w, f"{what}'s dense weight")
            if s is not None:
                raise ValueError(
                    f"{what} has scales but no format: pass fmt=Fp8(...), Mxfp4() or Int4(...)"
                )
        elif isinstance(fmt, Fp8):
            block = tuple(fmt.block)
            rows, cols = w.shape[1:]
            want = (E, -(-rows // block[0]), -(-cols // block[1]))
            if w.dtype != FP8 or s is None or s.dtype != torch.float32 or tuple(s.shape) != want:
                got = None if s is None else (s.dtype, tuple(s.shape))
                raise ValueError(
                    f"{what}: fp8 needs float8_e4m3fn weights and float32 scales {want}, got {got}"
                )
        elif isinstance(fmt, (Mxfp4, Int4)):
            if self.transposed:
                raise ValueError(
                    f"{what}: {fmt.name} is stored [E, N, K/2] whatever the module's layout: transposed=False"
                )
            want = (E, N, K // fmt.group)
            if (
                w.dtype != torch.uint8
                or s is None
                or s.dtype != fmt.scale_dtype
                or tuple(s.shape) != want
            ):
                got = None if s is None else (s.dtype, tuple(s.shape))
                raise ValueError(
                    f"{what}: {fmt.name} needs uint8 weights and {fmt.scale_dtype} scales {want}, got {got}"
                )
            if K % fmt.group:
                raise ValueError(
                    f"{what}: {fmt.name} packs groups of {fmt.group} inputs; K={K} is not a multiple"
                )
        else:
            raise ValueError(
                f"{what}: format {fmt!r} is not one the CPU kernels compute (dense, Fp8, Mxfp4, Int4)"
            )
        _code(self.bias, f"{what}'s bias")
        if self.bias is not None and tuple(self.bias.shape) != (E, N):
            raise ValueError(
                f"{what}'s bias must be [E, N] = {(E, N)}, got {tuple(self.bias.shape)}"
            )

    def descriptor(self) -> _Matrix:
        E, N, K = self.shape
        fmt = self.fmt
        if fmt is None:
            code, block = DENSE[self.weight.dtype], (0, 0)
        elif isinstance(fmt, Fp8):
            code, block = FP8_CODE, tuple(fmt.block)
        else:
            code, block = (MXFP4_CODE if isinstance(fmt, Mxfp4) else INT4_CODE), (1, fmt.group)
        ptr = lambda t: None if t is None else t.data_ptr()
        return _Matrix(
            ptr(self.weight), ptr(self.scales), ptr(self.bias), N, K, code, _code(self.bias, "bias"),
            int(self.transposed), *block,
        )  # fmt: skip


@dataclass(frozen=True, eq=False)
class CpuExperts:
    """One MoE layer's experts as the CPU kernels compute them: out = down(gate(up(x))) per (token, expert) pair.

    `gate`: "halves" (transformers' default `_apply_gate`: act(gate) * up, the gate the first half of gate_up),
    "gpt_oss" (GptOssExperts._apply_gate: interleaved gate/up columns, clamped at `limit`, (up + 1) * gate *
    sigmoid(`alpha` * gate)) or "none" (up_proj, act(up)). `act`: one of ACTS. The tensors must outlive every
    computation that reads them (the worker keeps its layers alive).
    """

    up: Projection
    down: Projection
    gate: str = "halves"
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    _descriptor: _Layer = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.gate not in GATES:
            raise ValueError(
                f"gate={self.gate!r}: the CPU kernels combine {', '.join(map(repr, GATES))}"
            )
        if self.act not in ACTS:
            raise ValueError(
                f"act={self.act!r}: the CPU kernels apply {', '.join(map(repr, ACTS))}"
            )
        self.up.check("up")
        self.down.check("down")
        (E, N_up, H), (E_down, H_down, I) = self.up.shape, self.down.shape
        if E != E_down or H != H_down or N_up != (I if self.gate == "none" else 2 * I):
            raise ValueError(
                f"up {self.up.shape} and down {self.down.shape} (E, N, K) do not make one MLP: down must be "
                f"(E, H, I) for up (E, {'I' if self.gate == 'none' else '2I'}, H)"
            )
        d = _Layer(
            self.up.descriptor(), self.down.descriptor(), E, GATES[self.gate], ACTS[self.act]
        )
        d.alpha, d.limit = self.alpha, self.limit
        object.__setattr__(self, "_descriptor", d)

    @property
    def num_experts(self) -> int:
        return self.up.shape[0]

    @property
    def hidden(self) -> int:
        return self.up.shape[2]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in the host store: what computing it reads."""
        tensors = (t for p in (self.up, self.down) for t in (p.weight, p.scales, p.bias))
        return sum(t[0].nbytes for t in tensors if t is not None)

    @classmethod
    def from_module(
        cls, experts, weights: dict[str, torch.Tensor], fmt: Format | None = None
    ) -> CpuExperts:
        """The layer of a transformers `@use_experts_implementation` module whose host store is `weights` (the
        module's tensor names; a quantized weight's scales under its name + `fmt.suffix`)."""
        if getattr(experts, "has_post_expert_norm", False):
            raise ValueError(
                f"{type(experts).__name__} normalizes each expert's output; the CPU kernels do not"
            )
        up = "gate_up_proj" if experts.has_gate else "up_proj"
        gate = _gate_name(experts) if experts.has_gate else "none"
        if gate == "gpt_oss":  # its gate carries its own activation
            act, extra = "silu", dict(alpha=float(experts.alpha), limit=float(experts.limit))
        else:
            act, extra = _act_name(experts), {}

        def projection(name: str) -> Projection:
            quantized = fmt is not None and name + fmt.suffix in weights
            return Projection(
                weights[name],
                weights[name + fmt.suffix] if quantized else None,
                weights.get(f"{name}_bias") if experts.has_bias else None,
                fmt if quantized else None,
                bool(experts.is_transposed) and not (quantized and isinstance(fmt, (Mxfp4, Int4))),
            )

        return cls(projection(up), projection("down_proj"), gate, act, **extra)


def _gate_name(experts) -> str:
    from transformers.integrations import moe

    gate_fn = type(experts)._apply_gate
    if gate_fn is getattr(moe, "_default_apply_gate", None):
        return "halves"
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        GptOssExperts = None
    if GptOssExperts is not None and gate_fn is GptOssExperts._apply_gate:
        return "gpt_oss"
    raise ValueError(
        f"{type(experts).__name__} has its own _apply_gate ({gate_fn.__qualname__}); the CPU kernels compute "
        "transformers' default gate (act(gate) * up) and GPT-OSS's"
    )


def _act_name(experts) -> str:
    """The ACTS name of the module's `act_fn`, matched by exact type (a subclass may compute something else)."""
    from transformers import activations as A

    act_fn = getattr(experts, "act_fn", None)
    known = {
        "SiLUActivation": "silu",
        "GELUActivation": "gelu",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "NewGELUActivation": "gelu_tanh",
        "FastGELUActivation": "gelu_tanh",
        "ReLUSquaredActivation": "relu2",
    }
    for name, kind in known.items():
        if type(act_fn) is getattr(A, name, None):
            return kind
    modules = {torch.nn.SiLU: "silu", torch.nn.ReLU: "relu"}
    if type(act_fn) in modules:
        return modules[type(act_fn)]
    if type(act_fn) is torch.nn.GELU:
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    functions = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu"}
    if act_fn in functions:
        return functions[act_fn]
    raise ValueError(
        f"{type(experts).__name__}'s activation {act_fn!r} is not one the CPU kernels apply "
        f"({', '.join(ACTS)}; transformers' SiLU, GELU, tanh-GELU, ReLU and ReLU² modules)"
    )


class PoolSizeError(ValueError):
    """A model asked for another thread count than the process's live pool has."""


# held weakly: the executors using the pool hold it, so it stops with the last model
_shared: weakref.WeakValueDictionary[str, Pool] = weakref.WeakValueDictionary()


def shared_pool(threads: int | None = None, beside_gpu: bool = False) -> Pool:
    """The process's pool, which every model's CPU executor computes on: one set of threads on the cores, not
    one a model contending for them. Made at first use with `threads` (None: `default_threads(beside_gpu)`),
    its threads spinning 1 ms between calls beside a GPU, whose worker nudges them awake
    (docs/decisions.md#calls-with-nothing-for-the-cpu-skip-the-channel), 200 µs on the CPU. Raises where
    `threads` differs from the live pool's size."""
    pool = _shared.get("pool")
    if pool is not None and threads not in (None, pool.threads):
        del pool
        gc.collect()  # a freed model in a reference cycle may hold it still
        pool = _shared.get("pool")
    if pool is None:
        threads = default_threads(beside_gpu) if threads is None else threads
        pool = _shared["pool"] = Pool(threads, spin_us=1000.0 if beside_gpu else 200.0)
    elif threads not in (None, pool.threads):
        size = pool.threads
        del pool  # the error's traceback keeps this frame: not the pool with it
        raise PoolSizeError(
            f"cpu_threads={threads}, but the models of a process share one CPU pool, and the one a live model "
            f"uses has {size} threads: pass cpu_threads={size} or leave it out, or free the models using it first"
        )
    return pool


def experts_mlp(
    layer: CpuExperts,
    x: torch.Tensor,
    token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    pool: Pool,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each pair's expert output before routing weights, float32 [P, H]: pair p is (token_ids[p], expert_ids[p])
    of x [T, H] (float32, bfloat16 or float16); a pair of expert -1 is skipped (its row is left unset), computed on
    `pool`'s threads. `stats`: an int64 [len(STATS)] row this call's counts are added to, as the worker counts its
    requests."""
    if pool.handle is None:
        raise ValueError("this Pool was closed: make another")
    if x.dim() != 2 or x.shape[1] != layer.hidden or x.device.type != "cpu":
        raise ValueError(
            f"x must be a CPU tensor [T, H={layer.hidden}], got {tuple(x.shape)} on {x.device}"
        )
    x = x.contiguous()
    x_code = _code(x, "x")
    token_ids = token_ids.to(torch.int32).contiguous()
    expert_ids = expert_ids.to(torch.int32).contiguous()
    if token_ids.shape != expert_ids.shape or token_ids.dim() != 1:
        raise ValueError(
            f"token_ids {tuple(token_ids.shape)} and expert_ids {tuple(expert_ids.shape)}: one id per pair"
        )
    P = token_ids.numel()
    out = torch.empty(P, layer.hidden, dtype=torch.float32)
    detail, groups = ctypes.c_int64(0), ctypes.c_int64(0)
    start = time.perf_counter_ns()
    err = pool.lib.amc_experts(
        pool.handle, ctypes.byref(layer._descriptor), P, token_ids.data_ptr(), expert_ids.data_ptr(), x.data_ptr(),
        x_code, x.shape[0], out.data_ptr(), ctypes.byref(detail), ctypes.byref(groups),
    )  # fmt: skip
    if err:
        raise ValueError(
            f"CPU experts: {ERRORS.get(err, 'error {err}').format(detail=detail.value, err=err)}"
        )
    if stats is not None:
        n = groups.value
        computed = int((expert_ids >= 0).sum())
        stats += torch.tensor(
            [1, computed, n, n * layer.expert_bytes, time.perf_counter_ns() - start]
        )
    return out
