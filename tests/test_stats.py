"""asyncmoe.stats: per-layer rows and totals, read on request, printable."""

import pytest
import torch

import asyncmoe

from models import tiny


@torch.no_grad()
def test_stats_rows_totals_and_table():
    model = asyncmoe.compile(tiny("qwen3_moe"), cache=4)
    model(torch.randint(0, 128, (2, 7)))
    s = asyncmoe.stats(model)
    assert [r.layer for r in s.layers] == [0, 1]
    assert all(r.name.endswith("mlp.experts") and r.slots == 4 and r.experts == 16 for r in s.layers)
    for r in s.layers:
        assert r.calls >= 1 and r.misses >= 2 and r.bytes_h2d == (r.misses + r.prefetched) * r.expert_bytes
        assert r.expert_bytes * r.experts == r.host_bytes
    assert s.totals["misses"] == sum(r.misses for r in s.layers)
    assert 0 <= s.totals["hit_rate"] <= 1
    table = str(s)
    assert "hit%" in table and "pf-hit%" in table and "all" in table and "device slots+tables" in table

    asyncmoe.stats(model, reset=True)
    assert asyncmoe.stats(model).totals["misses"] == 0
    assert s.totals["stall_ns"] is None and s.layers[0].stall_ns is None and "wait us" not in table  # not timed


def test_stall_timing_needs_cuda():
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="time_stalls reads the GPU's clock.*device='cuda'"):
        asyncmoe.compile(model, cache=4, time_stalls=True)
    assert asyncmoe.stats(asyncmoe.compile(model, cache=4)).totals["calls"] == 0  # the refusal left the model as it was


def test_resident_model_says_so():
    model = asyncmoe.compile(tiny("mixtral"), cache=16)
    assert "all 2 MoE layers resident" in str(asyncmoe.stats(model))
