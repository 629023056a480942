"""Every Triton kernel of the package compiles for sm_90 (H100, H200) under the installed triton, on the CPU.

The interpreter (TRITON_INTERPRET=1, which the other kernel tests run under without a GPU) checks what a kernel
computes, not that the compiler takes it: a kernel can pass there and fail to compile for a GPU under a newer
triton. Triton compiles for a named target without a GPU, so this does, in a child process without the
interpreter (triton reads TRITON_INTERPRET when a kernel is decorated, and conftest sets it for this process).

The child launches each kernel through its launcher with CPU tensors, as the package calls it, but records the
launch instead of running it; then it specializes the arguments as a launch does (types, constexprs, 16-byte
alignment) and compiles for the target. Every @triton.jit function of the package must be a launched kernel or
called from one, so that a new kernel cannot be left out: add its launch to CASES.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncmoe.cache.policies import POLICIES

from devices import LAUNCH_OPTIONS

pytestmark = pytest.mark.slow

TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size: H100 and H200


# --- the launches, one case each: a launcher called as the package calls it, with small CPU tensors ---


def _cache(E=20, C=8, policy="lfru"):
    from asyncmoe.cache.expert_cache import ExpertCache

    return ExpertCache({"w": torch.randn(E, 2, 3)}, C, policy)


def _ensure(policy: str, elsewhere: bool = False):
    from asyncmoe.cache import algorithm

    c = _cache(policy=policy)
    ids = torch.randint(0, c.num_experts, (3, 2))
    away = torch.arange(c.num_experts) % 3 == 0 if elsewhere else None  # the hybrid's CPU experts
    algorithm.ensure_plan(ids, 0, c.policy, c.state, c.slots, use_kernel=True, elsewhere=away)


def _prefetch(policy: str):
    from asyncmoe.cache import algorithm

    c = _cache(policy=policy)
    predicted, nominated = torch.rand(c.num_experts), torch.ones(c.num_experts, dtype=torch.int8)
    algorithm.prefetch_plan(predicted, nominated, 2, c.policy, c.state, c.slots, use_kernel=True)


def _prefetch_scores(sources: tuple[str, ...]):
    from asyncmoe.cache.state import GATE, TEMPORAL, TRANSITION
    from asyncmoe.prefetch.prefetch import Request, predict_and_plan
    from asyncmoe.prefetch.state import PrefetchBuffers

    bits = {"gate": GATE, "temporal": TEMPORAL, "transition": TRANSITION}
    c = _cache()
    p = PrefetchBuffers(c.num_experts, torch.device("cpu"), 24)
    before = torch.rand(24) < 0.2 if "transition" in sources else None
    request = Request(sum(bits[s] for s in sources), 2, c.policy)
    predict_and_plan(request, c.state, p.state, before, c.slots, use_kernel=True)


def _gate_scores(dtype: torch.dtype):
    from asyncmoe.prefetch.predictors import gate_scores

    gate_scores(
        torch.randn(3, 64, dtype=dtype),
        torch.randn(40, 64, dtype=dtype),
        None,
        4,
        torch.zeros(40),
        use_kernel=True,
    )


def _recorded_scores():
    from asyncmoe.prefetch.predictors import recorded_gate_scores

    # a trace's [N, L, g] arrays, one layer's slice, as the replay holds them (integrations/replay.py)
    ids, probs = torch.randint(0, 40, (7, 2, 8))[:, 0], torch.rand(7, 2, 8)[:, 0]
    recorded_gate_scores([ids, probs, torch.tensor([5])], 3, 4, torch.zeros(40), use_kernel=True)


def _observe():
    from asyncmoe.prefetch.predictors import observe

    observe(torch.rand(24) < 0.2, torch.rand(40) < 0.2, torch.zeros(24, 40), use_kernel=True)


def _slot_gemv(dtype: torch.dtype):
    from asyncmoe.compute.slot_gemv import slot_gemv_triton

    slot_gemv_triton(
        torch.randn(5, 384, dtype=dtype),
        torch.randn(4, 96, 384, dtype=dtype),
        torch.tensor([0, 3, -1, 2, 1]),
    )


def _fp8_gemv(transposed: bool, block: tuple[int, int]):
    from asyncmoe.compute.fp8_gemv import fp8_gemv_triton
    from asyncmoe.formats import quantize_fp8

    q, scale = quantize_fp8(torch.randn((4, 256, 128) if transposed else (4, 128, 256)), block)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    fp8_gemv_triton(x, q, scale, torch.tensor([0, 3, -1, 2, 1]), block, transposed)


def _formats(kind: str):
    from asyncmoe.formats import Int4, Mxfp4

    return Mxfp4() if kind == "mxfp4" else Int4(32)


def _gemv4(kind: str):
    from asyncmoe.compute.gemv4 import gemv4_triton

    packed, scales = _formats(kind).quantize(torch.randn(4, 96, 256), transposed=False)
    gemv4_triton(
        torch.randn(5, 256, dtype=torch.bfloat16),
        packed,
        scales,
        torch.tensor([0, 3, -1, 2, 1]),
        kind,
    )


def _dequantize(kind: str, dtype: torch.dtype):
    from asyncmoe.compute.dequantize import dequantize_triton
    from asyncmoe.formats import Fp8

    fmt = Fp8((128, 128)) if kind == "fp8" else _formats(kind)
    w, scales = fmt.quantize(torch.randn(3, 96, 256), transposed=False)
    dequantize_triton(fmt, w, scales, dtype)


def _gather_copy():
    from asyncmoe.cache.gather_copy import gather_copy_triton

    # four tensors, as an expert with biases has, of 8-, 4-, 2- and 1-byte words
    rows = [
        ((2, 4000), torch.bfloat16),
        ((2, 3), torch.float32),
        ((3,), torch.bfloat16),
        ((5, 3), torch.float8_e4m3fn),
    ]
    hosts = [torch.randn(7, *row).to(dtype) for row, dtype in rows]
    slots = [torch.zeros(5, *row).to(dtype) for row, dtype in rows]
    gather_copy_triton(
        hosts, slots, torch.tensor([3, 0, 6]), torch.tensor([1, 4, 0]), torch.tensor(2), programs=8
    )


def _clock():
    from asyncmoe.cache import clock

    times, pace = (
        torch.zeros(clock.TIMER_SIZE, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
    )
    clock.stamp(times, clock.START)
    clock.lap(times, torch.ones(1, dtype=torch.int64))
    clock.window(pace)


def _cpu_request():
    from asyncmoe.compute.cpu import request
    from asyncmoe.compute.cpu.worker import Channel

    channel = Channel(8, 4, 32, torch.bfloat16)
    fields, seq = channel.fields(channel.buffer), torch.zeros(1, dtype=torch.int64)
    x, ids = torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(0, 8, (3, 2))
    request.send(x, ids, seq, fields, 1)
    out, fault = torch.zeros(6, 32), torch.zeros(4, dtype=torch.int64)
    waited = torch.zeros(2, 2, dtype=torch.int64)
    request.receive(seq, fields, out, fault, waited, 1, 10**9)
    for weights in (torch.rand(3, 2), torch.rand(3, 2).bfloat16()):  # fp32 and bf16 products
        parts = request.Combine(
            torch.tensor([[0, -1], [3, -1], [-1, 2]]),
            torch.zeros(6, 32, dtype=torch.bfloat16),
            weights,
        )
        out = torch.empty(3, 32, dtype=torch.bfloat16)
        request.receive(seq, fields, out, fault, waited, 1, 10**9, parts)


def _hybrid_split():
    from asyncmoe.hybrid.split import Cost, split

    from devices import cache_with

    cost = torch.tensor([15_000, 200_000, 1_000, 300_000])[: len(Cost)]
    split(torch.tensor([[1, 3], [4, 5]]), cache_with(16, [1], [5]), cost, use_kernel=True)
    # the Markov policy's history orders the misses too
    s = cache_with(16, [1], [5])._replace(
        follows=torch.randint(0, 999, (16, 16), dtype=torch.int32)
    )
    split(torch.tensor([[1, 3], [4, 5]]), s, cost, use_kernel=True)
    # an eager call's: the GPU may run waves
    split(torch.tensor([[1, 3], [4, 5]]), s, cost, use_kernel=True, waves=True)


def _hybrid_split_send():
    from asyncmoe.compute.cpu.worker import Channel
    from asyncmoe.hybrid import split
    from asyncmoe.hybrid.split import Cost

    from devices import cache_with

    cost = torch.tensor([15_000, 200_000, 1_000, 300_000])[: len(Cost)]
    channel = Channel(8, 4, 32, torch.bfloat16)
    executor = types.SimpleNamespace(
        gpu=channel.fields(channel.buffer), seq=torch.zeros(1, dtype=torch.int64),
        check_request=lambda x, ids: None,
    )  # fmt: skip
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    s = cache_with(16, [1], [5])._replace(
        follows=torch.randint(0, 999, (16, 16), dtype=torch.int32)
    )
    split.split_and_send(x, torch.tensor([[1, 3], [4, 5]]), s, cost, executor, 1)
    split.split_and_send(x, torch.tensor([[1, 3], [4, 5]]), s, cost, executor, 1, waves=True)


SOURCES = [
    ("gate",),
    ("temporal",),
    ("transition",),
    ("temporal", "transition"),
    ("gate", "temporal", "transition"),
]
CASES: dict[str, Callable[[], None]] = {
    **{f"cache_step-ensure-{p}": (lambda p=p: _ensure(p)) for p in POLICIES},
    "cache_step-ensure-elsewhere": lambda: _ensure("lfru", elsewhere=True),
    **{f"cache_step-prefetch-{p}": (lambda p=p: _prefetch(p)) for p in POLICIES},
    **{f"prefetch_scores-{'+'.join(s)}": (lambda s=s: _prefetch_scores(s)) for s in SOURCES},
    "gate_scores-bf16": lambda: _gate_scores(torch.bfloat16),
    "gate_scores-fp32": lambda: _gate_scores(torch.float32),
    "recorded_scores": _recorded_scores,
    "observe": _observe,
    "slot_gemv-bf16": lambda: _slot_gemv(torch.bfloat16),
    "slot_gemv-fp32": lambda: _slot_gemv(torch.float32),
    "fp8_gemv": lambda: _fp8_gemv(False, (128, 128)),
    "fp8_gemv-transposed": lambda: _fp8_gemv(True, (16, 32)),
    "fp8_gemv-scale-a-weight": lambda: _fp8_gemv(False, (24, 24)),  # a block not dividing a step
    "gemv4-mxfp4": lambda: _gemv4("mxfp4"),
    "gemv4-int4": lambda: _gemv4("int4"),
    "dequantize-mxfp4-bf16": lambda: _dequantize("mxfp4", torch.bfloat16),
    "dequantize-int4-bf16": lambda: _dequantize("int4", torch.bfloat16),
    "dequantize-fp8-bf16": lambda: _dequantize("fp8", torch.bfloat16),
    "gather_copy": _gather_copy,
    "clock": _clock,
    "cpu_request": _cpu_request,
    "hybrid_split": _hybrid_split,
    "hybrid_split_send": _hybrid_split_send,
}


# --- the child: record each case's launches, compile them, write what came of each ---


def _jit_functions(triton) -> dict[str, object]:
    """Every @triton.jit function defined in the package's modules, by qualified name."""
    import asyncmoe

    found = {}
    for info in pkgutil.walk_packages(asyncmoe.__path__, "asyncmoe."):
        if info.ispkg or info.name.endswith("__main__"):  # __main__ runs the command
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                not isinstance(value, triton.runtime.KernelInterface)
                or value.fn.__module__ != module.__name__
            ):
                continue
            if not isinstance(
                value, triton.runtime.JITFunction
            ):  # @triton.autotune, @triton.heuristics: no CASES yet
                raise TypeError(
                    f"{module.__name__}.{name} is a {type(value).__name__}: compile it here as one"
                )
            found[f"{module.__name__}.{name}"] = value
    return found


def _called(fn, jit_type) -> list:
    """The @triton.jit functions that `fn`'s body names, and those they name, ..."""
    seen, todo = [], [fn]
    while todo:
        f = todo.pop()
        for name in f.fn.__code__.co_names:
            g = f.fn.__globals__.get(name)
            if isinstance(g, jit_type) and g not in seen:
                seen.append(g)
                todo.append(g)
    return seen


def _compile(triton, kernel, args, kwargs, target, backend):
    """Compile one recorded launch for `target` as the launch would: the JIT's own specialization of each argument
    (type; an int equal to 1 as a constexpr unless do_not_specialize; 16-byte divisibility), its options."""
    from triton._C.libtriton import (
        native_specialize_impl,
    )  # what a launch specializes its arguments with

    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, bound.arguments.values(), strict=True)):
        if param.is_constexpr:
            ty, spec = "constexpr", None
        else:
            specialize, align = (
                not param.do_not_specialize,
                not param.do_not_specialize_on_alignment,
            )
            ty, spec = native_specialize_impl(backend, value, param.is_const, specialize, align)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[param.name] = value
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    src = triton.compiler.ASTSource(
        fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(src, target=target, options=options)


def _child(out: Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    if triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: kernels are interpreted, not compiled")
    target = GPUTarget(*TARGET)
    backend = triton.compiler.make_backend(target)
    kernels = _jit_functions(triton)
    launches = []

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            launches.append((kernel, args, kwargs))

        return run

    for kernel in kernels.values():
        kernel.run = recorder(
            kernel
        )  # kernel[grid](...) calls it: nothing runs, nothing needs a GPU
    names = {id(k): name for name, k in kernels.items()}
    covered, results = set(), {}
    for case, launch in CASES.items():
        launches.clear()
        result = results[case] = {
            "kernels": [],
            "cubin_bytes": [],
            "ptx_targets": [],
            "error": None,
        }
        try:
            launch()
            if not launches:
                raise RuntimeError("launched no kernel")
            for kernel, args, kwargs in launches:
                result["kernels"].append(names[id(kernel)])
                compiled = _compile(triton, kernel, args, dict(kwargs), target, backend)
                result["cubin_bytes"].append(len(compiled.asm["cubin"]))
                ptx = compiled.asm["ptx"].splitlines()
                result["ptx_targets"].append(
                    next((line for line in ptx if line.startswith(".target")), None)
                )
                covered |= {id(kernel)} | {
                    id(f) for f in _called(kernel, triton.runtime.JITFunction)
                }
        except Exception as e:  # reported per case by the test
            result["error"] = f"{type(e).__name__}: {e}"
    uncovered = sorted(name for name, k in kernels.items() if id(k) not in covered)
    out.write_text(
        json.dumps({"triton": triton.__version__, "cases": results, "uncovered": uncovered})
    )


# --- the tests, in this process: one child compiles every case ---


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    triton = pytest.importorskip(
        "triton", reason="triton is not installed (a Linux-only dependency)"
    )
    if "nvidia" not in triton.backends.backends:
        pytest.skip(f"triton {triton.__version__} has no NVIDIA backend to compile for sm_90 with")
    tmp = tmp_path_factory.mktemp("compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")  # compile afresh, not from an earlier run's cache
    # the package this process imports (a checkout's), not whichever one the environment installed
    root = str(Path(importlib.import_module("asyncmoe").__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = tmp / "results.json"
    child = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=1800
    )
    assert child.returncode == 0, f"the compiling process failed:\n{child.stdout}\n{child.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90(compiled, case):
    result = compiled["cases"][case]
    assert result["error"] is None, f"triton {compiled['triton']}: {case}: {result['error']}"
    assert all(n > 0 for n in result["cubin_bytes"]), result
    assert all(t is not None and t.split()[1].startswith("sm_90") for t in result["ptx_targets"]), (
        result
    )


def test_every_jit_function_is_compiled(compiled):
    """Each @triton.jit function of the package is launched by a case or called from a launched kernel."""
    assert not compiled["uncovered"], (
        f"no case in tests/test_kernels_compile.py launches {compiled['uncovered']}: add the launch to CASES"
    )


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
