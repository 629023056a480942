"""The cost model's split (hybrid/split.py): the plain-torch decision against hand-worked cases, and
the one-program kernel against it, bit for bit (under TRITON_INTERPRET=1 on the CPU, for real on a
GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe.cache.state import Counter
from asyncmoe.hybrid.split import LIKELY, TOKENS, Cost, split

from devices import cache_with, devices, examples


def costs(round_trip: int, per_expert: int, per_pair: int, copy: int) -> torch.Tensor:
    cost = torch.zeros(len(Cost), dtype=torch.int64)
    cost[Cost.ROUND_TRIP], cost[Cost.PER_EXPERT] = round_trip, per_expert
    cost[Cost.PER_PAIR], cost[Cost.COPY] = per_pair, copy
    return cost


def test_the_split_finishes_both_sides_soonest():
    """Four misses (1, 3, 5, 7), two hits. A copy 10 ns, the CPU 5 + 8 an expert: n = 1: max(13, 30);
    n = 2: max(21, 20); n = 3: max(29, 10). Two go to the CPU: the fewest tokens first (3 and 7 have
    one token each, 1 and 5 two)."""
    ids = torch.tensor([[1, 2], [3, 4], [5, 1], [7, 5]])
    s = cache_with(8, [2, 4])
    elsewhere, cpu_ids = split(ids, s, costs(5, 8, 0, 10), use_kernel=False)
    assert cpu_ids.tolist() == [[-1, -1], [3, -1], [-1, -1], [7, -1]]
    assert elsewhere.nonzero().flatten().tolist() == [3, 7]
    assert s.counters[Counter.CPU_MISSES] == 2 and s.counters[Counter.COST_NS] == 21


def test_the_link_owes_this_calls_prefetch_first():
    """The case above with 2 and 4 prefetched for this call, behind 5 ns of compute: the link owes
    2 * 10 - 5 = 15 ns before the misses' copies. n = 2: max(21, 35); n = 3: max(29, 25); n = 4:
    max(37, 15). So the CPU takes three."""
    ids = torch.tensor([[1, 2], [3, 4], [5, 1], [7, 5]])
    s = cache_with(8, [], prefetched=[2, 4], window=5)
    elsewhere, cpu_ids = split(ids, s, costs(5, 8, 0, 10), use_kernel=False)
    assert elsewhere.nonzero().flatten().tolist() == [1, 3, 7]  # 5 last: ties by expert id
    assert s.counters[Counter.CPU_MISSES] == 3 and s.counters[Counter.COST_NS] == 29
    # the prefetch hidden by its compute owes nothing: the split of the first case
    s = cache_with(8, [], prefetched=[2, 4], window=25)
    assert split(ids, s, costs(5, 8, 0, 10), use_kernel=False)[0].sum() == 2


def test_the_gpus_experts_fit_the_slots():
    """The first case's call (two hits, four misses) with fewer slots. At 4 slots the GPU's 2 + 2
    fit: the cost's choice stands (n = 2). At 3 the CPU must take n >= 2 + 4 - 3 = 3 though n = 2
    finishes sooner: 3 and 7, then 1 (two tokens, like 5: ties by expert id), max(29, 10). At 2 it
    takes every miss: max(5 + 4 * 8, 0) = 37."""
    ids = torch.tensor([[1, 2], [3, 4], [5, 1], [7, 5]])
    for slots, cpu, cost_ns in [(4, [3, 7], 21), (3, [1, 3, 7], 29), (2, [1, 3, 5, 7], 37)]:
        for use_kernel in (False, True):
            s = cache_with(8, [2, 4], slots=slots)
            elsewhere, cpu_ids = split(ids, s, costs(5, 8, 0, 10), use_kernel=use_kernel)
            assert elsewhere.nonzero().flatten().tolist() == cpu, (slots, use_kernel)
            assert torch.equal(cpu_ids, torch.where(elsewhere[ids], ids, -1))
            assert s.counters[Counter.CPU_MISSES] == len(cpu)
            assert s.counters[Counter.COST_NS] == cost_ns


def test_eager_the_split_is_free_of_the_slots_and_within_the_timed_tokens():
    """The first case's call at 3 slots, eager (the GPU may run waves): the cost's choice stands,
    n = 2, max(21, 20), though the GPU's four experts need two waves. With the costs free of the
    tokens (per_pair 0) and a copy dear, the CPU would take every miss; it takes those of at most
    TOKENS tokens only: of a call where expert 1 has TOKENS + 1, all but 1."""
    ids = torch.tensor([[1, 2], [3, 4], [5, 1], [7, 5]])
    many = torch.tensor([[1, 3]] + [[1, 5]] * TOKENS)
    for use_kernel in (False, True):
        s = cache_with(8, [2, 4], slots=3)
        elsewhere, _ = split(ids, s, costs(5, 8, 0, 10), use_kernel=use_kernel, waves=True)
        assert elsewhere.nonzero().flatten().tolist() == [3, 7], use_kernel
        assert s.counters[Counter.CPU_MISSES] == 2 and s.counters[Counter.COST_NS] == 21
        s = cache_with(8, [], slots=3)
        elsewhere, _ = split(many, s, costs(5, 8, 0, 1000), use_kernel=use_kernel, waves=True)
        assert elsewhere.nonzero().flatten().tolist() == [3, 5], use_kernel
        assert s.counters[Counter.COST_NS] == 1000  # the link's one copy outlasts the CPU


def test_the_fit_overrides_a_slow_cpu():
    """A CPU too slow to take any miss by cost alone still takes those the slots cannot hold: three
    misses, one hit, 2 slots: two on the CPU (the fewest tokens: 6, then 0 before 3 by id)."""
    ids = torch.tensor([[0, 3], [3, 6], [0, 1]])
    for use_kernel in (False, True):
        s = cache_with(8, [1], slots=2)
        elsewhere, _ = split(ids, s, costs(150, 60, 0, 100), use_kernel=use_kernel)
        assert elsewhere.nonzero().flatten().tolist() == [0, 6]
        assert s.counters[Counter.CPU_MISSES] == 2
        assert s.counters[Counter.COST_NS] == max(150 + 2 * 60, 100)


def test_no_misses_or_a_slow_cpu_sends_nothing():
    ids = torch.tensor([[1, 2]])
    for resident, cost in [([1, 2], costs(0, 1, 0, 100)), ([], costs(150, 60, 0, 100))]:
        s = cache_with(8, resident)
        elsewhere, cpu_ids = split(ids, s, cost, use_kernel=False)
        assert not elsewhere.any() and (cpu_ids == -1).all()
        assert s.counters[Counter.CPU_MISSES] == 0
        # all hits: nothing to wait for; two misses on the link: 200 ns (with the CPU: 210)
        assert s.counters[Counter.COST_NS] == (200 if not resident else 0)


def test_a_fast_cpu_takes_every_miss():
    ids = torch.tensor([[0, 3], [3, 6]])
    s = cache_with(8, [6])
    elsewhere, cpu_ids = split(ids, s, costs(1, 1, 1, 1000), use_kernel=False)
    assert cpu_ids.tolist() == [[0, 3], [3, -1]]
    assert elsewhere.nonzero().flatten().tolist() == [0, 3]
    assert s.counters[Counter.CPU_MISSES] == 2 and s.counters[Counter.COST_NS] == 1 + 2 + 3


@pytest.mark.parametrize("use_kernel", [False, True])
def test_among_equal_costs_the_cpu_takes_what_the_next_call_is_least_likely_to_route(use_kernel):
    """One token's four misses (1, 3, 5, 7), costs as the first case's: the CPU takes two. With no
    history (a policy that learns none), the lowest ids; where the Markov policy learnt that 1 and 3
    follow these experts, 5 and 7, and the link copies 1 and 3 into the slots, which keep them."""
    ids = torch.tensor([[1, 3, 5, 7]])
    s = cache_with(8, [])
    assert split(ids, s, costs(5, 8, 0, 10), use_kernel=use_kernel)[
        0
    ].nonzero().flatten().tolist() == [1, 3]
    follows = torch.zeros(8, 8, dtype=torch.int32)
    follows[[1, 3, 5, 7], 1], follows[[3, 5], 3] = (
        48,
        32,
    )  # likely: 1 -> 48, 3 -> 16 (the mean of 4 rows)
    s = cache_with(8, [])._replace(follows=follows)
    elsewhere, cpu_ids = split(ids, s, costs(5, 8, 0, 10), use_kernel=use_kernel)
    assert elsewhere.nonzero().flatten().tolist() == [5, 7]
    assert cpu_ids.tolist() == [[-1, -1, 5, 7]]
    # fewer tokens still go first: 1, routed twice, stays on the link however unlikely it is
    ids = torch.tensor([[1, 3], [1, 5]])
    follows.zero_()
    follows[:, 3] = follows[:, 5] = 64
    s = cache_with(8, [])._replace(follows=follows)
    cost = costs(5, 8, 2, 10)  # n = 1: max(15, 20); n = 2: max(25, 10): one goes to the CPU
    assert split(ids, s, cost, use_kernel=use_kernel)[0].nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("device", devices())
def test_the_kernel_counts_no_padding_pair_among_the_routed(device):
    """A call of fewer pairs than its block pads them with the id E, which is no expert: the mean
    likelihood counts the 5 experts routed, not a 6th. 51 experts, one token of 5, the costs all
    zero and a random history: the kernel's choice equals the reference's for each."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(51, generator=g)[:5].view(1, 5).to(device)
        follows = torch.randint(0, 2 * LIKELY, (51, 51), generator=g, dtype=torch.int32)
        out = []
        for use_kernel in (True, False):
            s = cache_with(51, [], [], 0, device, 1)._replace(follows=follows.to(device))
            out.append(
                [
                    t.cpu()
                    for t in (*split(ids, s, costs(0, 0, 0, 0).to(device), use_kernel), s.counters)
                ]
            )
        for a, b in zip(*out):
            assert torch.equal(a, b), seed


@pytest.mark.parametrize("device", devices())
@settings(max_examples=examples(25), deadline=None)
@given(
    st.integers(0, 2**31 - 1), st.integers(2, 70), st.integers(1, 6), st.integers(1, 5), st.data()
)
def test_the_kernel_equals_the_reference(device, seed, E, T, k, data):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    held = torch.randperm(E, generator=g)[: data.draw(st.integers(0, E))].tolist()
    n = data.draw(st.integers(0, len(held)))  # the last n prefetched for this call
    # slots from those held to E: often fewer than the call's experts, whose excess the CPU takes
    slots = data.draw(st.integers(max(len(held), 1), E))
    window = data.draw(st.integers(0, 6000))
    cost = costs(*(data.draw(st.integers(0, 3000)) for _ in range(4))).to(device)
    # the Markov policy's history, up to past the largest likelihood a key holds; or none
    follows = torch.randint(0, 2 * LIKELY, (E, E), generator=g, dtype=torch.int32)
    if not data.draw(st.booleans()):
        follows = follows[:0, :0]
    waves = data.draw(st.booleans())
    out = []
    for use_kernel in (True, False):
        s = cache_with(E, held[: len(held) - n], held[len(held) - n :], window, device, slots)
        s = s._replace(follows=follows.to(device))
        s.counters.fill_(7)
        got = split(ids.to(device), s, cost, use_kernel, waves=waves)
        out.append([t.cpu() for t in (*got, s.counters)])
    for a, b in zip(*out):
        assert torch.equal(a, b)
    elsewhere = out[1][0]
    tokens = torch.bincount(ids.flatten(), minlength=E)
    if waves:  # the CPU's experts within the tokens the costs timed
        assert (tokens[elsewhere] <= TOKENS).all()
    else:  # the GPU's experts fit the slots
        assert int(((tokens > 0) & ~elsewhere).sum()) <= slots
