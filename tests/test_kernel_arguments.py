"""Every launcher that feeds a Triton kernel a state's tensors (a cache's `CacheState`, a prefetch's
`PrefetchState`, a CPU channel's `Fields`) feeds each parameter named after a field, `<field>_ptr`
(`chan_<field>_ptr` for the channel's), that field's own tensor: no order of fields is kept by hand.

Each launcher runs with its kernel's launch recorded instead of run; its arguments are bound to the
kernel's parameters as a launch binds them."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from asyncmoe.cache import cache_step
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.policies import POLICIES
from asyncmoe.cache.state import GATE, TEMPORAL, TRANSITION
from asyncmoe.compute.cpu import request
from asyncmoe.compute.cpu.worker import Channel
from asyncmoe.hybrid import split
from asyncmoe.prefetch import prefetch_scores
from asyncmoe.prefetch.state import PrefetchBuffers, PrefetchState

from devices import LAUNCH_OPTIONS

pytest.importorskip("triton", reason="triton is not installed (a Linux-only dependency)")

MARKOV = POLICIES["markov"].id


def _cache():
    return ExpertCache({"w": torch.randn(20, 2, 3)}, 8, "markov").state


def _channel():
    channel = Channel(8, 4, 32, torch.bfloat16)
    return channel.fields(channel.buffer)


def _ensure():
    s = _cache()
    away = torch.arange(20) % 3 == 0
    cache_step.ensure_triton(torch.tensor([1, 4, 7]), 0, MARKOV, s, 24, elsewhere=away)
    return cache_step._cache_step, [(s, "")]


def _prefetch():
    s = _cache()
    cache_step.prefetch_triton(torch.rand(20), torch.ones(20, dtype=torch.int8), 2, MARKOV, s, 24)
    return cache_step._cache_step, [(s, "")]


def _prefetch_scores():
    s, p = _cache(), PrefetchBuffers(20, torch.device("cpu"), 24).state
    sources = GATE | TEMPORAL | TRANSITION
    prefetch_scores.prefetch_scores_triton(sources, torch.rand(24) < 0.2, 2, s, p)
    return prefetch_scores._prefetch_scores, [(s, ""), (p, "")]


def _cost():
    return torch.tensor([15_000, 200_000, 1_000, 300_000])[: len(split.Cost)]


def _split():
    s = _cache()
    split.split(torch.tensor([[1, 3], [4, 5]]), s, _cost(), use_kernel=True)
    return split._split_kernel, [(s, "")]


def _split_and_send():
    s, fields = _cache(), _channel()
    executor = types.SimpleNamespace(
        gpu=fields, seq=torch.zeros(1, dtype=torch.int64), check_request=lambda x, ids: None
    )
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    split.split_and_send(x, torch.tensor([[1, 3], [4, 5]]), s, _cost(), executor, 1)
    return split._split_send_kernel, [(s, ""), (fields, "chan_")]


def _send():
    fields = _channel()
    x, ids = torch.randn(3, 32, dtype=torch.bfloat16), torch.randint(0, 8, (3, 2))
    request.send(x, ids, torch.zeros(1, dtype=torch.int64), fields, 1)
    return request._send_kernel, [(fields, "chan_")]


def _receive():
    fields = _channel()
    out, fault = torch.zeros(6, 32), torch.zeros(4, dtype=torch.int64)
    waited = torch.zeros(2, 2, dtype=torch.int64)
    request.receive(torch.zeros(1, dtype=torch.int64), fields, out, fault, waited, 1, 10**9)
    return request._receive_kernel, [(fields, "chan_")]


KERNELS = {
    "_cache_step": cache_step._cache_step,
    "_prefetch_scores": prefetch_scores._prefetch_scores,
    "_split_kernel": split._split_kernel,
    "_split_send_kernel": split._split_send_kernel,
    "_send_kernel": request._send_kernel,
    "_receive_kernel": request._receive_kernel,
}
LAUNCHERS = {
    "ensure": _ensure,
    "prefetch": _prefetch,
    "prefetch_scores": _prefetch_scores,
    "split": _split,
    "split_and_send": _split_and_send,
    "send": _send,
    "receive": _receive,
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_state_parameter_gets_its_field(launcher, monkeypatch):
    launches = []
    for kernel in KERNELS.values():
        monkeypatch.setattr(
            kernel, "run", lambda *a, grid, warmup, k=kernel, **kw: launches.append((k, a, kw))
        )
    kernel, states = LAUNCHERS[launcher]()
    assert [k for k, _, _ in launches] == [kernel]
    _, args, kwargs = launches[0]
    kwargs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
    for state, prefix in states:
        fed = [name for name in type(state)._fields if f"{prefix}{name}_ptr" in bound]
        assert fed, f"{kernel.fn.__name__} takes nothing of {type(state).__name__}"
        for name in fed:
            assert bound[f"{prefix}{name}_ptr"] is getattr(state, name), (
                f"{kernel.fn.__name__}'s {prefix}{name}_ptr is fed another tensor than "
                f"{type(state).__name__}.{name}"
            )


def test_the_declared_fields_are_the_kernels_parameters():
    """The field lists the launchers pass name parameters of their kernels, and only fields."""
    from asyncmoe.cache.state import CacheState
    from asyncmoe.compute.cpu.worker import Fields

    declared = [
        (cache_step._cache_step, CacheState, cache_step.CACHE_STATE, ""),
        (prefetch_scores._prefetch_scores, CacheState, prefetch_scores.CACHE_STATE, ""),
        (prefetch_scores._prefetch_scores, PrefetchState, PrefetchState._fields, ""),
        (split._split_kernel, CacheState, split.CACHE_STATE, ""),
        (split._split_send_kernel, CacheState, split.CACHE_STATE, ""),
        (split._split_send_kernel, Fields, request.SENT, "chan_"),
        (request._send_kernel, Fields, request.SENT, "chan_"),
        (request._receive_kernel, Fields, request.RECEIVED, "chan_"),
    ]
    for kernel, state, names, prefix in declared:
        params = list(inspect.signature(kernel.fn).parameters)
        assert set(names) <= set(state._fields), (kernel.fn.__name__, names)
        taken = [n for n in state._fields if f"{prefix}{n}_ptr" in params]
        assert sorted(taken) == sorted(names), (kernel.fn.__name__, taken, names)
