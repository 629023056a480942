"""The GPU's side of the CPU channel (compute/cpu/request.py) with Triton interpreting its kernels on
the host (TRITON_INTERPRET=1, as CI runs): they write requests into a real channel, a real worker
thread serves them, and they wait for its answers, so what they write, combine and fail on is tested
without a GPU. The fences and PTX loads have host twins here; test_executor.py runs the real ones on
CUDA."""

from __future__ import annotations

import types

import pytest
import torch

import asyncmoe
from asyncmoe import gpu
from asyncmoe.compute.cpu import Channel, Worker, request
from asyncmoe.compute.experts import combine
from asyncmoe.hybrid.split import Cost, split, split_and_send
from asyncmoe.integrations.transformers import PROVIDER, find_experts

from devices import cache_with
from models import NUM_EXPERTS, TOP_K, tiny

pytestmark = pytest.mark.skipif(
    not gpu.interpreted(), reason="the request kernels run on the CPU under TRITON_INTERPRET=1"
)
T_MAX = 8


class Link(types.SimpleNamespace):
    """A bf16 model's CPU executor `ex` (its kernels run in-line: the reference here), a channel
    `fields` served by a one-thread `worker` for its layers, and the GPU side's tensors."""


@pytest.fixture
def link():
    model = asyncmoe.compile(tiny("olmoe", dtype=torch.bfloat16), cache=0, cpu_threads=1)
    ex = getattr(find_experts(model)[0][1], PROVIDER).executor
    channel = Channel(T_MAX * TOP_K, T_MAX, ex.hidden, torch.bfloat16)
    worker = Worker(channel, ex.layers, ex.pool)  # the model's pool: they take turns
    yield Link(
        model=model, ex=ex, channel=channel, worker=worker, fields=channel.fields(channel.buffer),
        seq=torch.zeros(1, dtype=torch.int64), fault=torch.zeros(4, dtype=torch.int64),
        waited=torch.zeros(len(ex.layers), 2, dtype=torch.int64),
    )  # fmt: skip
    worker.close()


def rows(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 32, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(T)])
    return x, ids


def receive(link: Link, out: torch.Tensor, layer: int, parts=None, timeout_ns: int = 10**10):
    request.receive(link.seq, link.fields, out, link.fault, link.waited, layer, timeout_ns, parts)
    return out


@torch.no_grad()
def test_requests_sent_and_received_are_what_the_executor_computes(link):
    for n, (layer, T) in enumerate([(0, 3), (1, 1), (0, T_MAX)], start=1):
        x, ids = rows(T, seed=n)
        request.send(x, ids, link.seq, link.fields, layer)
        out = receive(link, torch.empty(T * TOP_K, 32), layer)
        assert torch.equal(out, link.ex.compute(x, ids, layer))
        assert int(link.seq) == int(link.channel.done) == n
    assert link.waited[:, request.WAITS].tolist() == [2, 1]


def test_a_request_with_nothing_for_the_cpu_is_not_sent(link):
    x, ids = rows(2)
    before = link.channel.buffer.clone()
    request.send(x, torch.full_like(ids, -1), link.seq, link.fields, 0)
    awake = slice(link.channel.layout.awake, link.channel.layout.awake + 8)
    assert not torch.equal(link.channel.buffer[awake], before[awake])
    before[awake] = link.channel.buffer[awake]
    assert torch.equal(link.channel.buffer, before) and int(link.seq) == 0


@torch.no_grad()
def test_the_combine_weights_and_sums_the_cpus_rows_and_the_gpus(link):
    """As `combine` of the rows it picks: the CPU's where ids name an expert, the GPU's elsewhere.
    In float32: Triton's interpreter rounds to bf16 toward zero, the GPU to nearest, so the bf16
    roundings are test_executor.py's, on CUDA."""
    T = 5
    x, ids = rows(T)
    ids[0, 0] = ids[2, 1] = ids[3, 0] = ids[3, 1] = -1  # the GPU's pairs
    cpu_out = link.ex.compute(x, ids, 0)  # the same pairs: the same sums of each expert's tokens
    gpu_out, weights = torch.randn(T * TOP_K, 32), torch.rand(T, TOP_K)
    request.send(x, ids, link.seq, link.fields, 0)
    got = receive(link, torch.empty(T, 32), 0, request.Combine(ids, gpu_out, weights))
    picked = torch.where((ids >= 0).reshape(-1, 1), cpu_out, gpu_out)
    assert torch.equal(got, combine(picked, weights, torch.float32))  # top-2: one order of sums


def test_a_combine_with_nothing_from_the_cpu_waits_for_nothing(link):
    link.worker.close()
    link.seq.fill_(1)  # a request the stopped worker never answers
    skipped = torch.full((2, TOP_K), -1)
    gpu_out, weights = torch.randn(2 * TOP_K, 32), torch.rand(2, TOP_K)
    parts = request.Combine(skipped, gpu_out, weights)
    got = receive(link, torch.empty(2, 32), 0, parts, timeout_ns=10**6)
    assert torch.equal(got, combine(gpu_out, weights, torch.float32))
    assert int(link.waited.sum()) == 0


@torch.no_grad()
def test_the_split_sends_the_cpus_pairs_from_its_own_program(link):
    """`split_and_send`: the split's decision, bit for bit the reference's, and its CPU pairs in the
    channel, served as `send` would have sent them."""
    x, ids = rows(4, seed=3)
    # token 0's experts resident, one of them prefetched for this call
    states = [cache_with(NUM_EXPERTS, ids[0, 1:].tolist(), ids[0, :1].tolist()) for _ in range(2)]
    cost = torch.zeros(len(Cost), dtype=torch.int64)
    cost[Cost.PER_EXPERT], cost[Cost.COPY] = 10, 10  # misses split about evenly
    want = split(ids, states[0], cost, use_kernel=False)
    ex = types.SimpleNamespace(gpu=link.fields, seq=link.seq, check_request=link.ex.check_request)
    got = split_and_send(x, ids, states[1], cost, ex, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(states[0].counters, states[1].counters)
    cpu_ids = got[1]
    assert (cpu_ids >= 0).any() and (cpu_ids < 0).any()
    out = receive(link, torch.empty(4 * TOP_K, 32), 1)
    on_cpu = (cpu_ids >= 0).reshape(-1)
    assert torch.equal(out[on_cpu], link.ex.compute(x, cpu_ids, 1)[on_cpu])


def test_a_refused_request_fails_loudly(link):
    x, ids = rows(1)
    ids[0, 1] = NUM_EXPERTS + 3  # no such expert: the worker refuses the request
    request.send(x, ids, link.seq, link.fields, 0)
    with pytest.raises(Exception, match="trap: a CPU request failed"):  # the interpreter wraps it
        receive(link, torch.empty(TOP_K, 32), 0)
    seq, layer, seen, kind = link.fault.tolist()
    assert (seq, layer, kind) == (1, 0, request.REFUSED) and seen == int(link.channel.error)


def test_a_wait_past_its_timeout_fails_loudly(link):
    link.worker.close()
    x, ids = rows(1)
    request.send(x, ids, link.seq, link.fields, 1)
    with pytest.raises(Exception, match="trap: a CPU request failed"):  # the interpreter wraps it
        receive(link, torch.empty(TOP_K, 32), 1, timeout_ns=20_000_000)
    assert link.fault.tolist() == [1, 1, 0, request.TIMED_OUT]
