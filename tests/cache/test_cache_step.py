"""The fused cache-step kernel (cache/cache_step.py) against its plain-torch reference (cache/algorithm.py):
every buffer equal after any sequence of calls.

On the CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py); on the GPU for real.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe.cache import algorithm, cache_step
from asyncmoe.cache.expert_cache import ExpertCache, expert_bytes, num_waves
from asyncmoe.cache.policies import POLICIES, get_policy
from asyncmoe.cache.state import WAVE_ELSEWHERE, Counter

from devices import assert_same, devices, examples


def pair(E, C, policy, device):
    hosts = {"w": torch.randn(E, 2, 3, generator=torch.Generator().manual_seed(E)).to(device)}
    return ExpertCache(hosts, C, policy), ExpertCache(hosts, C, policy)


def run(cache, kind, args, use_kernel):
    c = cache
    if kind == "ensure":
        ids, wave, elsewhere = args
        return algorithm.ensure(
            ids, wave, c.policy, c.state, c.hosts, c.slots, use_kernel, elsewhere
        )
    scores, sources, budget = args
    algorithm.prefetch(
        scores, sources, budget, c.policy, c.state, c.hosts, c.slots, use_kernel=use_kernel
    )


def script(draw_seed: int, E: int, C: int, k: int, calls: list[tuple[str, int]]):
    g = torch.Generator().manual_seed(draw_seed)
    for kind, size in calls:
        if kind == "ensure":
            scores = torch.rand(size, E, generator=g) * torch.linspace(2, 1, E)
            ids = scores.topk(k, dim=-1).indices
            if (
                torch.rand(1, generator=g) < 0.5
            ):  # some pairs on another rank's experts (expert parallelism): id E
                ids = torch.where(torch.rand(size, k, generator=g) < 0.3, E, ids)
            # a third of the calls have some experts computed elsewhere (the hybrid's CPU), another
            # third the excess over the slots, as the hybrid's split gives the CPU
            r, elsewhere = torch.rand(1, generator=g), None
            if r < 0.3:
                elsewhere = torch.rand(E, generator=g) < 0.3
            elif r < 0.6:
                routed = torch.zeros(E + 1, dtype=torch.bool).index_fill_(0, ids.flatten(), True)
                rank = torch.randperm(E, generator=g)  # [E]: which of the routed stay here
                here = routed[:E] & (rank < torch.randint(0, C + 1, (), generator=g))
                elsewhere = routed[:E] & ~here
            for wave in range(num_waves(size * k, C, E)):
                yield "ensure", (ids, wave, elsewhere)
        else:
            scores = torch.rand(E, generator=g) * (torch.rand(E, generator=g) < 0.4)
            scores[: size % E] = 0.5  # ties: lower expert id first
            sources = torch.randint(0, 8, (E,), generator=g, dtype=torch.int8)
            yield "prefetch", (scores, sources, min(k, C))


@settings(max_examples=examples(30), deadline=None)
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
    calls = data.draw(
        st.lists(
            st.tuples(st.sampled_from(["ensure", "ensure", "prefetch"]), st.integers(1, 7)),
            min_size=1,
            max_size=8,
        )
    )
    kernel, reference = pair(E, C, policy, device)
    for kind, args in script(seed, E, C, k, calls):
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        got = run(kernel, kind, args, use_kernel=True)
        want = run(reference, kind, args, use_kernel=False)
        if kind == "ensure":
            assert torch.equal(got, want)
        assert_same(kernel, reference)


@pytest.mark.parametrize("device", devices())
def test_launchers_plan_the_references_copies(device):
    """`ensure_triton` and `prefetch_triton` return the copies the references plan: the same real pairs
    (src, dst for i < count) and the same count; the gather copy then moves exactly those."""
    E, C = 10, 3
    kernel, reference = pair(E, C, "lru", device)
    nbytes = expert_bytes(kernel.slots)
    ids = torch.tensor(
        [3, 7, 1, 3, 9], device=device
    )  # 4 experts over 3 slots: 2 waves, copying 3 then 1
    copied = []
    for wave in range(num_waves(ids.numel(), C, E)):
        got, (src, dst, count) = cache_step.ensure_triton(
            ids, wave, get_policy("lru").id, kernel.state, nbytes
        )
        want, (rsrc, rdst, rcount) = algorithm.ensure_reference(
            ids, wave, get_policy("lru"), reference.state, nbytes
        )
        n = int(rcount)
        assert torch.equal(got, want) and int(count) == n
        assert torch.equal(src[:n], rsrc[:n]) and torch.equal(dst[:n], rdst[:n])
        copied.append(src[:n].tolist())
    assert copied == [[1, 3, 7], [9]]  # misses in expert-id order, each wave at most C
    predicted = torch.tensor([0.1, 0, 0, 0, 0, 0.5, 0.7, 0, 0, 0], device=device)
    nominated = torch.ones(E, dtype=torch.int8, device=device)
    src, dst, count = cache_step.prefetch_triton(
        predicted, nominated, 2, get_policy("lru").id, kernel.state, nbytes
    )
    rsrc, rdst, rcount = algorithm.prefetch_reference(
        predicted, nominated, 2, get_policy("lru"), reference.state, nbytes
    )
    n = int(rcount)
    assert int(count) == n == 2  # the two likeliest, none resident
    assert sorted(src[:n].tolist()) == sorted(rsrc[:n].tolist()) == [5, 6] and torch.equal(
        dst[:n], rdst[:n]
    )
    assert_same(kernel, reference)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("use_kernel", [False, True])
def test_elsewhere_taking_the_excess_serves_the_call_in_wave_0(device, use_kernel):
    """Eight experts routed over 4 slots, 1 and 9 resident, the CPU computing 0, 3, 4 and 7 (the
    split's excess): the GPU's four (1, 9 and the misses 2, 6) all land in wave 0, the elsewhere
    experts in no wave, so the second wave that the shapes allow has nothing to serve. Every routed
    expert still counts as routed."""
    E, C = 16, 4
    cache, _ = pair(E, C, "lru", device)
    c = cache
    one = torch.tensor([[1, 9]], device=device)
    algorithm.ensure(one, 0, c.policy, c.state, c.hosts, c.slots, use_kernel)
    ids = torch.tensor([[0, 1], [2, 3], [4, 9], [6, 7]], device=device)
    elsewhere = torch.zeros(E, dtype=torch.bool, device=device)
    elsewhere[[0, 3, 4, 7]] = True
    before = c.counters.clone()
    served = []
    for wave in range(num_waves(ids.numel(), C, E)):
        slots, (src, _, count) = algorithm.ensure_plan(
            ids, wave, c.policy, c.state, c.slots, use_kernel, elsewhere
        )
        served.append(sorted(ids[slots >= 0].tolist()))
        assert sorted(src[: int(count)].tolist()) == ([2, 6] if wave == 0 else [])
    assert served == [[1, 2, 6, 9], []]
    assert c.wave_of.tolist()[:10] == [
        WAVE_ELSEWHERE,
        0,
        0,
        *[WAVE_ELSEWHERE] * 2,
        -1,
        0,
        WAVE_ELSEWHERE,
        -1,
        0,
    ]
    assert c.routed.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 6, 7, 9]
    got = c.counters - before
    assert (int(got[Counter.CALLS]), int(got[Counter.HITS]), int(got[Counter.MISSES])) == (1, 2, 2)
    assert sorted(c.slot_to_expert.tolist()) == [1, 2, 6, 9]
