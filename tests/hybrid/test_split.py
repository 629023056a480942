"""The cost model's split (hybrid/split.py): the plain-torch decision against hand-worked cases, and
the one-program kernel against it, bit for bit (under TRITON_INTERPRET=1 on the CPU, for real on a
GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncmoe.cache.state import Counter
from asyncmoe.hybrid.split import Cost, split

from devices import devices


def costs(round_trip: int, per_expert: int, per_pair: int, copy: int) -> torch.Tensor:
    cost = torch.zeros(len(Cost), dtype=torch.int64)
    cost[Cost.ROUND_TRIP], cost[Cost.PER_EXPERT] = round_trip, per_expert
    cost[Cost.PER_PAIR], cost[Cost.COPY] = per_pair, copy
    return cost


def resident(E: int, experts: list[int]) -> torch.Tensor:
    table = torch.full((E + 1,), -1, dtype=torch.int64)
    table[experts] = torch.arange(len(experts))
    return table


def test_the_split_finishes_both_sides_soonest():
    """Four misses (1, 3, 5, 7), two hits. A copy 10 ns, the CPU 5 + 8 an expert: n = 1: max(13, 30);
    n = 2: max(21, 20); n = 3: max(29, 10). Two go to the CPU: the fewest tokens first (3 and 7 have
    one token each, 1 and 5 two)."""
    ids = torch.tensor([[1, 2], [3, 4], [5, 1], [7, 5]])
    counters = torch.zeros(len(Counter), dtype=torch.int64)
    elsewhere, cpu_ids = split(
        ids, resident(8, [2, 4]), costs(5, 8, 0, 10), counters, use_kernel=False
    )
    assert cpu_ids.tolist() == [[-1, -1], [3, -1], [-1, -1], [7, -1]]
    assert elsewhere.nonzero().flatten().tolist() == [3, 7]
    assert counters[Counter.CPU_MISSES] == 2 and counters[Counter.COST_NS] == 21


def test_no_misses_or_a_slow_cpu_sends_nothing():
    ids = torch.tensor([[1, 2]])
    for table, cost in [
        (resident(8, [1, 2]), costs(0, 1, 0, 100)),
        (resident(8, []), costs(150, 60, 0, 100)),
    ]:
        counters = torch.zeros(len(Counter), dtype=torch.int64)
        elsewhere, cpu_ids = split(ids, table, cost, counters, use_kernel=False)
        assert not elsewhere.any() and (cpu_ids == -1).all()
        assert counters[Counter.CPU_MISSES] == 0
        # all hits: nothing to wait for; two misses on the link: 200 ns (with the CPU: 210)
        assert counters[Counter.COST_NS] == (0 if table[1] >= 0 else 200)


def test_a_fast_cpu_takes_every_miss():
    ids = torch.tensor([[0, 3], [3, 6]])
    counters = torch.zeros(len(Counter), dtype=torch.int64)
    elsewhere, cpu_ids = split(
        ids, resident(8, [6]), costs(1, 1, 1, 1000), counters, use_kernel=False
    )
    assert cpu_ids.tolist() == [[0, 3], [3, -1]]
    assert elsewhere.nonzero().flatten().tolist() == [0, 3]
    assert counters[Counter.CPU_MISSES] == 2 and counters[Counter.COST_NS] == 1 + 2 + 3


@pytest.mark.parametrize("device", devices())
@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31 - 1), st.integers(2, 70), st.integers(1, 6), st.integers(1, 5), st.data()
)
def test_the_kernel_equals_the_reference(device, seed, E, T, k, data):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    table = resident(E, torch.randperm(E, generator=g)[: data.draw(st.integers(0, E))].tolist())
    cost = costs(*(data.draw(st.integers(0, 3000)) for _ in range(4)))
    out = []
    for use_kernel in (True, False):
        counters = torch.full((len(Counter),), 7, dtype=torch.int64, device=device)
        split_ids = split(ids.to(device), table.to(device), cost.to(device), counters, use_kernel)
        out.append([t.cpu() for t in (*split_ids, counters)])
    for a, b in zip(*out):
        assert torch.equal(a, b)
