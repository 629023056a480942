"""Stall timing's lap (cache/clock.py) on the Triton interpreter and the GPU: each sum gets its own
stretch between the stamps."""

from __future__ import annotations

import pytest
import torch

from asyncmoe.cache import clock

from devices import devices


@pytest.mark.parametrize("device", devices())
def test_a_lap_adds_the_wait_the_decision_and_the_copies(device):
    """Stamps 1,000 / 1,500 / 4,000 ns and sums already holding 7 each: the wait adds 2,500, the
    copies what ran since 4,000, `ensure` its 500 of deciding and the copies, and the copies' count
    the 3 experts they moved."""
    times = torch.zeros(clock.TIMER_SIZE, dtype=torch.int64, device=device)
    times[[clock.START, clock.WAIT_FROM, clock.WAITED]] = torch.tensor([1000, 1500, 4000])
    times[[clock.WAIT_NS, clock.ENSURE_NS, clock.COPY_NS, clock.COPIED]] = 7
    clock.lap(times, torch.tensor([3], device=device))
    t = times.tolist()
    assert t[clock.WAIT_NS] == 7 + 2500
    assert t[clock.COPY_NS] > 7 + 0  # the clock reads far past 4,000 ns
    assert t[clock.ENSURE_NS] - t[clock.COPY_NS] == 500
    assert t[clock.COPIED] == 7 + 3
