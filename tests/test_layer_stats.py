"""asyncmoe.stats (layer_stats.py): per-layer rows and totals, read on request, printable."""

import pytest
import torch

import asyncmoe

from models import tiny


def columns(table: str, row: str) -> dict[str, str]:
    """One row of a stats table, by column name (names hold no spaces but "MB h2d", "wait us", "ensure us")."""
    lines = table.splitlines()
    names = lines[0].replace("MB h2d", "MB_h2d").replace(" us", "_us").split()
    (cells,) = [line.split() for line in lines if line.split()[:1] == [row]]
    if len(cells) == len(names) - 1:  # the "all" row has no slots
        cells.insert(1, "")
    return dict(zip(names, cells, strict=True))


@torch.no_grad()
def test_stats_rows_totals_and_table():
    model = asyncmoe.compile(
        tiny("qwen3_moe"), cache=4, prefetch=True
    )  # on: the CPU's default is off
    model(torch.randint(0, 128, (2, 7)))
    model(torch.randint(0, 128, (2, 1)))
    s = asyncmoe.stats(model)
    assert [r.layer for r in s.layers] == [0, 1]
    assert all(
        r.name.endswith("mlp.experts") and r.slots == 4 and r.experts == 16 for r in s.layers
    )
    for r in s.layers:
        assert (
            r.calls >= 1
            and r.misses >= 2
            and r.bytes_h2d == (r.misses + r.prefetched) * r.expert_bytes
        )
        assert r.expert_bytes * r.experts == r.host_bytes
    assert s.totals["misses"] == sum(r.misses for r in s.layers)
    assert 0 <= s.totals["hit_rate"] <= 1
    table = str(s)
    assert "hit%" in table and "all" in table and "device slots+tables" in table
    assert s.totals["prefetched"] > 0
    assert "pf-recall%: routed experts found resident because a prefetch put them there" in table
    total = columns(table, "all")
    assert float(total["pf-recall%"]) == pytest.approx(100 * s.totals["prefetch_recall"], abs=0.05)
    assert float(total["hit%"]) == pytest.approx(100 * s.totals["hit_rate"], abs=0.05)
    assert (
        int(total["prefetch"]) == s.totals["prefetched"]
        and int(columns(table, "1")["calls"]) == s.layers[1].calls
    )

    asyncmoe.stats(model, reset=True)
    assert asyncmoe.stats(model).totals["misses"] == 0
    assert (
        s.totals["stall_ns"] is None and s.layers[0].stall_ns is None and "wait us" not in table
    )  # not timed


def test_stall_timing_needs_cuda():
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="time_stalls reads the GPU's clock.*device='cuda'"):
        asyncmoe.compile(model, cache=4, time_stalls=True)
    assert (
        asyncmoe.stats(asyncmoe.compile(model, cache=4)).totals["calls"] == 0
    )  # the refusal left the model as it was


def test_resident_model_says_so():
    model = asyncmoe.compile(tiny("mixtral"), cache=16)
    assert "all 2 MoE layers resident" in str(asyncmoe.stats(model))


@torch.no_grad()
def test_table_without_prefetch_or_lookups_has_no_empty_columns():
    model = asyncmoe.compile(tiny("qwen3_moe"), cache=4, prefetch=False)
    untouched = str(asyncmoe.stats(model))
    assert "nan" not in untouched and "no expert looked up yet" in untouched
    assert columns(untouched, "all")["hit%"] == "-"
    model(torch.randint(0, 128, (2, 7)))
    table = str(asyncmoe.stats(model))
    assert (
        "prefetch" not in table.splitlines()[0]
        and "pf-recall%" not in table
        and "nothing prefetched" in table
    )
    assert "no expert looked up" not in table and float(columns(table, "all")["hit%"]) >= 0
