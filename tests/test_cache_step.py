"""The fused cache-step kernel against its plain-torch reference: every buffer equal after any sequence of calls.

On the CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py); on the GPU for real.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe.cache import expert_cache
from asyncmoe.cache.expert_cache import ExpertCache, num_waves
from asyncmoe.cache.policies import POLICIES


def devices():
    out = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cpu")
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out or [pytest.param("cpu", marks=pytest.mark.skip(reason="neither TRITON_INTERPRET=1 nor a GPU"))]


def pair(E, C, policy, device):
    hosts = {"w": torch.randn(E, 2, 3, generator=torch.Generator().manual_seed(E)).to(device)}
    return ExpertCache(hosts, C, policy), ExpertCache(hosts, C, policy)


def run(cache, kind, args, use_kernel):
    c = cache
    if kind == "ensure":
        ids, wave = args
        return expert_cache.ensure(
            ids, wave, c.policy, c.expert_to_slot, c.slot_to_expert, c.state, c.counters, c.hosts, c.slots, use_kernel=use_kernel
        )
    scores, sources, budget = args
    expert_cache.prefetch(
        scores, sources, budget, c.policy, c.expert_to_slot, c.slot_to_expert, c.state, c.counters, c.hosts, c.slots,
        use_kernel=use_kernel,
    )


def assert_same(kernel: ExpertCache, reference: ExpertCache):
    for (name, a), (_, b) in zip(kernel.named_buffers(), reference.named_buffers()):
        if name in ("scratch", "predicted", "nominated", "outcomes"):  # outcomes: float, compared by the predictor tests
            continue
        if name in ("expert_to_slot", "evicted_at"):  # the last row is the reference's trash row for masked writes
            a, b = a[:-1], b[:-1]
        assert torch.equal(a, b), f"{name}: kernel {a.tolist()} != reference {b.tolist()}"


def script(draw_seed: int, E: int, C: int, k: int, calls: list[tuple[str, int]]):
    g = torch.Generator().manual_seed(draw_seed)
    for kind, size in calls:
        if kind == "ensure":
            scores = torch.rand(size, E, generator=g) * torch.linspace(2, 1, E)
            ids = scores.topk(k, dim=-1).indices
            for wave in range(num_waves(size * k, C, E)):
                yield "ensure", (ids, wave)
        else:
            scores = torch.rand(E, generator=g) * (torch.rand(E, generator=g) < 0.4)
            scores[: size % E] = 0.5  # ties: lower expert id first
            sources = torch.randint(0, 8, (E,), generator=g, dtype=torch.int8)
            yield "prefetch", (scores, sources, min(k, C))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(3, 40),
    st.data(),
)
@pytest.mark.parametrize("device", devices())
def test_kernel_equals_reference(device, seed, E, data):
    k = data.draw(st.integers(1, min(4, E)))
    C = data.draw(st.integers(k, E))
    policy = data.draw(st.sampled_from(sorted(POLICIES)))
    calls = data.draw(st.lists(st.tuples(st.sampled_from(["ensure", "ensure", "prefetch"]), st.integers(1, 7)), min_size=1, max_size=8))
    kernel, reference = pair(E, C, policy, device)
    for kind, args in script(seed, E, C, k, calls):
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        got = run(kernel, kind, args, use_kernel=True)
        want = run(reference, kind, args, use_kernel=False)
        if kind == "ensure":
            assert torch.equal(got, want)
        assert_same(kernel, reference)
