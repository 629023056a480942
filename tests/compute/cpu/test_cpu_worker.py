"""The CPU worker (asyncmoe/compute/cpu/worker.py): this test plays the GPU, writing requests into the channel
and waiting for `done`; outputs are checked against the plain-torch reference, and malformed requests must come
back with an error code and untouched outputs."""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time
import weakref

import pytest
import torch

from asyncmoe.compute.cpu import Channel, CpuExperts, Pool, Projection, Worker, reference
from asyncmoe.compute.cpu.kernels import default_threads
from asyncmoe.compute.cpu.request import DONE_REFUSED
from asyncmoe.formats import Mxfp4

E, H, T, MAX_PAIRS = 8, 64, 8, 32


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def layers() -> list[CpuExperts | None]:
    """A bf16 SiLU-GLU layer, an mxfp4 GPT-OSS layer with biases, and a layer the CPU never serves."""
    gen = torch.Generator().manual_seed(0)
    dense = lambda *shape: (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)
    mixtral = CpuExperts(Projection(dense(E, 96, H)), Projection(dense(E, H, 48)))
    I = 64
    blocks = lambda N, K: torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    scales = lambda N, K: torch.randint(120, 124, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    bias = lambda N: (torch.randn(E, N, generator=gen) * 0.1).to(torch.bfloat16)
    up = Projection(blocks(2 * I, H), scales(2 * I, H), bias(2 * I), Mxfp4())
    down = Projection(blocks(H, I), scales(H, I), bias(H), Mxfp4())
    return [mixtral, CpuExperts(up, down, "gpt_oss"), None]


@pytest.fixture
def served():
    channel = Channel(MAX_PAIRS, T, H, torch.bfloat16)
    worker = Worker(channel, layers(), Pool(2, spin_us=100))
    yield channel, worker
    worker.close()


def request(gen: torch.Generator, tokens: int, k: int):
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    token_ids = torch.arange(tokens).repeat_interleave(k)
    expert_ids = torch.stack(
        [torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]
    ).flatten()
    return x, token_ids, expert_ids


def test_requests_round_trip(served):
    channel, worker = served
    gen = torch.Generator().manual_seed(1)
    for layer_index, tokens, k in [(0, 1, 2), (1, 1, 4), (0, 8, 4), (1, 5, 2), (0, 3, 1)]:
        x, token_ids, expert_ids = request(gen, tokens, k)
        seq = channel.submit(layer_index, token_ids, expert_ids, x)
        out = channel.result(seq).clone()
        layer = worker_layer(layer_index)
        ref = reference.experts_mlp(layer, x, token_ids, expert_ids)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-5 * ref.abs().max().item())


def worker_layer(i: int) -> CpuExperts:
    return layers()[i]  # the same seed: the same tensors the worker holds


def test_empty_request(served):
    channel, _ = served
    seq = channel.submit(
        0, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0, H)
    )
    assert channel.result(seq).shape == (0, H)
    assert int(channel.done) == seq  # served: DONE_REFUSED clear


def test_skipped_pairs(served):
    """Pairs of expert -1 (the hybrid's GPU pairs) are skipped: their rows keep what they held, the others are
    computed, and the worker counts only the pairs and experts it computed."""
    channel, worker = served
    x, token_ids, expert_ids = request(torch.Generator().manual_seed(4), 4, 2)
    skip = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    worker.stats(reset=True)
    channel.out.fill_(float("nan"))
    out = channel.result(channel.submit(0, token_ids, expert_ids.masked_fill(skip, -1), x)).clone()
    ref = reference.experts_mlp(worker_layer(0), x, token_ids, expert_ids)
    assert out[skip].isnan().all()
    torch.testing.assert_close(
        out[~skip], ref[~skip], rtol=1e-4, atol=2e-5 * ref.abs().max().item()
    )
    counts = dict(zip(("requests", "pairs", "experts"), worker.stats()[0, :3].tolist()))
    assert counts == {"requests": 1, "pairs": 3, "experts": len(set(expert_ids[~skip].tolist()))}
    everything = expert_ids.new_full(expert_ids.shape, -1)
    channel.out.fill_(float("nan"))
    assert channel.result(channel.submit(0, token_ids, everything, x)).isnan().all()


def test_a_change_of_awake_wakes_the_sleeping_pool_for_one_spin():
    """A call that sends the CPU nothing changes `awake`: the worker wakes its sleeping pool, which
    spins for one `spin_us`, then sleeps again."""
    channel = Channel(MAX_PAIRS, T, H, torch.bfloat16)
    worker = Worker(channel, layers(), Pool(3, spin_us=300_000))

    def until(asleep: int, seconds: float) -> float:
        start = time.monotonic()
        while worker.sleeping() != asleep:
            assert time.monotonic() - start < seconds, (
                f"{worker.sleeping()} of 2 asleep, not {asleep}"
            )
            time.sleep(0.001)
        return time.monotonic() - start

    try:
        until(2, 5.0)  # started, spun, asleep
        time.sleep(0.4)
        assert worker.sleeping() == 2  # nothing wakes them but a task or a nudge
        channel.awake[0] += 1
        until(0, 0.25)  # woken, within the spin they were given
        assert until(2, 5.0) > 0.03  # ... which they spin before sleeping again
    finally:
        worker.close()


def test_empty_request_latency(served, capsys):
    """Printed, not asserted: the worker's turn-around of a request with no pairs, from Python through ctypes, over
    1000 requests (or as many as 2 s allow: on a machine whose cores are all busy, a polling thread waits for its
    turn on one)."""
    channel, _ = served
    none = torch.zeros(0, dtype=torch.int32)
    channel.write(0, none, none, torch.zeros(0, H))
    times, deadline = [], time.perf_counter_ns() + 2 * 10**9
    while len(times) < 1000 and time.perf_counter_ns() < deadline:
        start = time.perf_counter_ns()
        channel.seq += 1
        channel.publish(channel.seq)
        assert channel.wait(channel.seq) == 0
        times.append(time.perf_counter_ns() - start)
    with capsys.disabled():
        median = statistics.median(times) / 1e3
        print(f"\nCPU worker: empty request round trip, median of {len(times)}: {median:.1f} us")


def test_malformed_requests_set_an_error(served):
    channel, _ = served
    gen = torch.Generator().manual_seed(2)
    x, token_ids, expert_ids = request(gen, 2, 2)

    def refused(
        expected: int, layer=0, tokens=token_ids, experts=expert_ids, rows=x, pairs=None
    ) -> int:
        channel.out.fill_(float("nan"))
        channel.write(layer, tokens, experts, rows)
        if pairs is not None:
            channel.pairs[0] = pairs
        channel.seq += 1
        channel.publish(channel.seq)
        assert channel.wait(channel.seq) == expected
        assert int(channel.done) == channel.seq | DONE_REFUSED  # the GPU's wait reads only this
        assert channel.out.isnan().all(), "a refused request must leave the outputs alone"
        return int(channel.detail)

    assert refused(2, layer=2) == 2  # never registered
    assert refused(2, layer=3) == 3  # out of range
    assert refused(2, layer=-1) == -1
    assert refused(3, pairs=MAX_PAIRS + 1) == MAX_PAIRS + 1
    assert refused(6, experts=torch.tensor([0, 1, E, 2])) == 2
    assert refused(5, tokens=torch.tensor([0, 1, 1, 2])) == 3
    with pytest.raises(ValueError, match="expert id"):
        channel.result(channel.submit(0, token_ids, torch.tensor([0, 1, -2, 2]), x))

    # out of order: skipped ahead, then back; the worker answers each with an error and takes it as the last
    channel.write(0, token_ids, expert_ids, x)
    channel.publish(channel.seq + 5)
    assert channel.wait(channel.seq + 5) == 1 and int(channel.detail) == channel.seq + 1
    channel.publish(channel.seq + 2)
    assert channel.wait(channel.seq + 2) == 1 and int(channel.detail) == channel.seq + 6
    channel.seq += 2
    out = channel.result(channel.submit(0, token_ids, expert_ids, x))  # in order again: served
    torch.testing.assert_close(
        out, reference.experts_mlp(worker_layer(0), x, token_ids, expert_ids), rtol=1e-4, atol=1e-4
    )


def test_idle_worker_naps_and_still_serves():
    channel = Channel(MAX_PAIRS, T, H)
    worker = Worker(channel, layers(), Pool(1), idle_spin_ms=1, idle_sleep_us=200)
    try:
        time.sleep(0.05)  # well past the idle spin: the worker sleeps between polls
        x, token_ids, expert_ids = request(torch.Generator().manual_seed(3), 2, 2)
        out = channel.result(channel.submit(1, token_ids, expert_ids, x))
        torch.testing.assert_close(out, reference.experts_mlp(worker_layer(1), x, token_ids, expert_ids), rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
    finally:
        worker.close()


def test_close_and_collect_stop_the_thread():
    channel = Channel(MAX_PAIRS, T, H)
    worker = Worker(channel, layers(), Pool(2))
    worker.close()
    worker.close()  # idempotent
    none = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(TimeoutError):
        channel.result(channel.submit(0, none, none, torch.zeros(0, H)), timeout=0.05)

    channel = Channel(MAX_PAIRS, T, H)
    ref = weakref.ref(Worker(channel, layers(), Pool(1)))
    gc.collect()
    assert ref() is None
    with pytest.raises(TimeoutError):
        channel.result(channel.submit(0, none, none, torch.zeros(0, H)), timeout=0.05)


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_default_threads_leave_a_core_to_the_host_and_one_to_python_beside_a_gpu(
    monkeypatch, cores
):
    """Every busy thread beside a GPU (the worker's, and Python spinning on the GPU) on a core of its own
    with one to spare: one more runnable thread holds a request for a scheduler slice."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads(beside_gpu=True) == max(1, cores - 2)
    pool = Pool()
    try:
        assert pool.threads == max(1, cores - 1)
    finally:
        pool.close()


def test_workers_sharing_a_pool_take_turns():
    """Two workers, each polling its own channel, compute on one pool: requests in flight on both at
    once come back right."""
    pool, gen = Pool(2, spin_us=100), torch.Generator().manual_seed(5)
    channels = [Channel(MAX_PAIRS, T, H, torch.bfloat16) for _ in range(2)]
    workers = [Worker(c, layers(), pool) for c in channels]
    try:
        for _ in range(20):
            sent = []
            for layer_index, channel in enumerate(channels):
                x, token_ids, expert_ids = request(gen, T, 4)
                sent.append(
                    (
                        channel.submit(layer_index, token_ids, expert_ids, x),
                        x,
                        token_ids,
                        expert_ids,
                    )
                )
            for layer_index, (channel, (seq, x, token_ids, expert_ids)) in enumerate(
                zip(channels, sent)
            ):
                ref = reference.experts_mlp(worker_layer(layer_index), x, token_ids, expert_ids)
                torch.testing.assert_close(
                    channel.result(seq), ref, rtol=1e-4, atol=2e-5 * ref.abs().max().item()
                )
    finally:
        for w in workers:
            w.close()
    assert all(w.pool is pool for w in workers)


def test_refuses_layers_of_another_hidden_size():
    channel = Channel(MAX_PAIRS, T, 2 * H)
    with pytest.raises(ValueError, match="hidden size"):
        Worker(channel, layers(), Pool(1))


@pytest.mark.slow
def test_interpreter_exit_joins_a_running_worker():
    """A worker never closed is stopped and joined at exit (its finalizer's atexit hook): the process ends, rc 0."""
    script = f"""
import torch
from asyncmoe.compute.cpu import Channel, CpuExperts, Pool, Projection, Worker
layer = CpuExperts(Projection(torch.randn({E}, 96, {H})), Projection(torch.randn({E}, {H}, 48)))
channel = Channel(4, 2, {H})
worker = Worker(channel, [layer], Pool(2))
channel.result(channel.submit(0, torch.tensor([0]), torch.tensor([1]), torch.randn(1, {H})))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
