"""A compiled model lives as long as its references: dropping the last one frees the model, its
caches' slots, its host store and its CPU executor at once, with the garbage collector off. Nothing
asyncmoe adds holds a model in a reference cycle or in a module-level registry.

transformers' lazy modules leave a reference cycle through the frames that first import a model
class (an exception's traceback), which holds whatever those frames held; so each case runs once with
the collector on before the run that is checked.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

import asyncmoe
from asyncmoe.cache import host
from asyncmoe.integrations.transformers import PROVIDER, find_experts

from models import tiny

PROMPT = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def owned(model) -> tuple[list[weakref.ref], list[weakref.finalize]]:
    """Weak references to `model` and to what asyncmoe gave it (providers, caches, pinned blocks,
    prefetch buffers, CPU executors with their layers and workers), and the finalizers that stop the
    executors' worker threads."""
    objects = [model]
    for _, m in find_experts(model):
        provider = getattr(m, PROVIDER)
        objects.append(provider)
        cache = getattr(provider, "cache", None)
        hybrid = getattr(provider, "hybrid", None)
        executor = getattr(provider, "executor", None) or getattr(hybrid, "executor", None)
        objects += [
            cache,
            getattr(cache, "pinned_block", None),
            getattr(provider, "prefetch", None),
        ]
        objects += [getattr(provider, "pinned_block", None), executor]
        if executor is not None:
            objects += [*executor.layers, getattr(executor, "worker", None)]
    live = list({id(o): o for o in objects if o is not None}.values())
    workers = [o for o in live if hasattr(o, "_close") and hasattr(o, "channel")]
    return [weakref.ref(o) for o in live], [w._close for w in workers]


def assert_freed_at_once(run) -> None:
    """`run()` builds a model and uses it, returning it and what else the caller holds (a Decoder);
    dropping both must free everything `owned` lists, with the collector off."""
    run()  # first imports, kernels built: their garbage is not the model's
    with collector_off():
        model, held = run()
        refs, finalizers = owned(model)
        assert len(refs) > 1, "asyncmoe gave this model nothing to check"
        del model, held
        assert_released(refs, finalizers)


def assert_released(refs: list[weakref.ref], finalizers: list[weakref.finalize]) -> None:
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert alive == [], f"held by a reference cycle or a registry after del: {alive}"
    assert not any(f.alive for f in finalizers), "a CPU worker thread outlived its model"
    assert host._deferred == []  # every pinned block unpinned


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint to load, and a trace recorded with its gate to replay."""
    path = tmp_path_factory.mktemp("olmoe")
    model = tiny("olmoe", seed=3)
    model.save_pretrained(path)
    with torch.no_grad(), asyncmoe.record(model, gate=True) as recorder:
        model(PROMPT)
    return path, recorder.trace


# how each case builds its model from `saved`; `record` also records its routing while it runs
CASES = {
    "cached": lambda path, trace: asyncmoe.compile(tiny("olmoe"), cache=4, prefetch=True),
    "cpu": lambda path, trace: asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1),
    "hybrid": lambda path, trace: asyncmoe.compile(
        tiny("olmoe"), cache=4, prefetch=True, hybrid=True, cpu_threads=1
    ),
    "from_pretrained": lambda path, trace: asyncmoe.from_pretrained(
        path, cache=4, dtype=torch.float32, device="cpu", prefetch=True
    ),
    "replay": lambda path, trace: asyncmoe.compile(
        tiny("olmoe"), cache=4, prefetch=True, replay=trace
    ),
    "record": lambda path, trace: asyncmoe.compile(tiny("olmoe"), cache=4, prefetch=True),
}


@pytest.mark.parametrize("decoder", [False, True], ids=["generate", "decoder"])
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_a_dropped_model_is_freed_at_once(case, decoder, saved):
    def run():
        model = CASES[case](*saved)
        recording = asyncmoe.record(model, gate=True) if case == "record" else None
        with recording or contextlib.nullcontext():
            if decoder:
                held = asyncmoe.Decoder(model, 1, 32, graph=False)
                held.generate(PROMPT, 4)
            else:
                held = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        if recording is not None:
            assert recording.trace.ids.shape[0] == PROMPT.shape[1] + 3
        return model, held

    assert_freed_at_once(run)


@torch.no_grad()
def test_an_unmodified_model_is_freed_at_once():
    """The control: transformers itself holds a model in no cycle (after its first imports)."""
    model = tiny("olmoe")
    ref = weakref.ref(model)
    with collector_off():
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        del model
        assert ref() is None


def _cuda_allocated() -> int:
    """Bytes the caching allocator has handed out, less cuBLAS's per-stream workspaces (each new
    stream gets one, which outlives the model; torch's own leak check clears them the same way)."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


@pytest.mark.cuda
@pytest.mark.parametrize("hybrid", [False, True], ids=["cached", "hybrid"])
def test_cuda_memory_returns_when_the_model_is_dropped(hybrid):
    """After a graph Decoder has decoded, `del dec, model` returns every byte the model and the
    Decoder took on the GPU (no gc.collect, no empty_cache), and the host store is unpinned."""

    # given costs: a calibration too noisy to time would refuse hybrid=True
    costs = asyncmoe.HybridCosts(round_trip=20_000, per_expert=5_000, per_pair=1_000, copy=10_000)
    kw = dict(hybrid=True, hybrid_costs=costs, cpu_threads=1) if hybrid else dict(hybrid=False)

    def run():
        model = tiny("olmoe", dtype=torch.bfloat16, hidden_size=256, intermediate_size=1024)
        model = asyncmoe.compile(model, cache=4, device="cuda", prefetch=True, **kw)
        dec = asyncmoe.Decoder(model, 1, 32)
        dec.generate(PROMPT.cuda(), 8)
        return model, dec

    model, dec = run()  # first imports, kernels compiled, streams made
    del model, dec
    with collector_off():
        before = _cuda_allocated()
        model, dec = run()
        assert dec.graphed
        slots = sum(p.cache.expert_bytes * p.cache.num_slots for p in dec.cached)
        # not _cuda_allocated: the captured graphs use the workspaces it would free
        assert torch.cuda.memory_allocated() - before > slots >= 2 * 4 * 256 * 1024 * 3 * 2
        refs, finalizers = owned(model)
        del model, dec
        assert _cuda_allocated() - before < 2**20  # the model's slots alone are 12 MiB
        assert_released(refs, finalizers)
