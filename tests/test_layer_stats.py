"""asyncmoe.stats (layer_stats.py): per-layer rows and totals, read on request, printable."""

import pytest
import torch

import asyncmoe
from asyncmoe.layer_stats import LayerStats, Stats
from asyncmoe.settings import HybridCosts

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
            and r.miss_bytes == r.misses * r.expert_bytes
        )
        assert r.expert_bytes * r.experts == r.host_bytes
    assert s.totals["misses"] == sum(r.misses for r in s.layers)
    assert s.totals["miss_bytes"] == sum(r.misses * r.expert_bytes for r in s.layers)
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


def layer_stats(i: int, **fields) -> LayerStats:
    """A layer's counters as `read_stats` returns them: 4 of 16 slots, 10 calls, 1 MB experts."""
    counted = dict(calls=10, hits=30 + i, misses=10 - i, evictions=6, bytes_h2d=12_000_000)
    prefetch = (
        dict.fromkeys(
            (
                "prefetched",
                "wasted",
                "prefetch_hits",
                "hits_gate",
                "hits_temporal",
                "hits_transition",
            ),
            0,
        )
        | dict.fromkeys(
            ("prefetch_timely", "prefetch_victims", "explored", "explored_paid", "runners_up"), 0
        )
        | dict(runners_up_paid=0)
    )
    sizes = dict(expert_bytes=1_000_000, gpu_bytes=5 * 2**20, host_bytes=16 * 2**20)
    return LayerStats(
        layer=i,
        name=f"model.layers.{i}.mlp.experts",
        slots=4,
        experts=16,
        **(counted | prefetch | sizes | fields),
    )


PLAIN = """\
layer   slots   calls     hits   misses   hit%   evict    MB h2d
----------------------------------------------------------------
    0    4/16      10       30       10   75.0       6      12.0
    1    4/16      10       31        9   77.5       6      12.0
----------------------------------------------------------------
  all              20       61       19   76.2      12      24.0
nothing prefetched (prefetch off, or it found nothing worth a copy): no prefetch columns
device slots+tables 10.0 MiB, host store 32.0 MiB"""

IDLE = """\
layer   slots   calls     hits   misses   hit%   evict    MB h2d
----------------------------------------------------------------
    0    4/16       0        0        0      -       0       0.0
----------------------------------------------------------------
  all               0        0        0      -       0       0.0
no expert looked up yet: no rates
nothing prefetched (prefetch off, or it found nothing worth a copy): no prefetch columns
device slots+tables 5.0 MiB, host store 16.0 MiB"""

# lines split where they pass the linter's width
EVERY_COLUMN = "\n".join(
    [
        "layer   slots   calls     hits   misses   hit%   evict cpu miss model us prefetch pf-recall% "
        " wasted    MB h2d  wait us ensure us  cpu exp    cpu MB   cpu us gpu wait us",
        "-" * 169,
        "    0    4/16      10       30       10   71.4       6        2      5.5        5        9.5   "
        "    1      12.0      0.1       2.3        7       7.0     41.0         9.0",
        "    1    4/16      10       31        9   73.8       6        2      5.5        5        9.5   "
        "    1      12.0      0.3       2.3        7       7.0     41.0           -",
        "-" * 169,
        "  all              20       61       19   72.6      12        4      5.5       10        9.5   "
        "    2      24.0      0.2       2.3       14      14.0     41.0         4.5",
        "pf-recall%: routed experts found resident because a prefetch put them there (part of hit%)",
        "prefetch hits by predictor (an expert can have several): gate 6, temporal 2, transition 0; 4 of"
        " 8 in the call they were fetched for",
        "closed prefetch gates explored 6 times with no copy: 2 would have saved a miss",
        "prefetch nominations past each call's likeliest: 8, of which the call routed to 4 (copied only"
        " while enough of them are)",
        "device slots+tables 10.0 MiB, host store 32.0 MiB",
        "prefetch gate: an expert's copy 254.0 us, the compute a prefetch hid behind 210.0 us: open"
        " while 50% of prefetches save a miss",
        "wait us, ensure us: per call, on the GPU clock: waiting for the prefetch; deciding and copying"
        " misses",
        "cpu exp, cpu MB, cpu us: experts the host's CPU computed, the weights it read, its time a call;"
        " gpu wait us: the GPU's wait for it",
        "misses: copied into slots; cpu miss: computed by the CPU instead (hybrid); model us: the cost"
        " model's time for a call's misses",
        "GB/s of expert weights: the link 20.0 copying the misses, 3.9 alone (at compile)",
        "1 more MoE layers fully resident",
    ]
)


def test_the_table_is_pinned_column_by_column():
    """The whole table, character for character: the base columns alone; a cache that looked nothing up; and every
    optional column (hybrid, prefetch, stall timing, the CPU and its GPU wait, "-" for a layer without one) with
    every note below the table."""
    every = dict(prefetched=5, wasted=1, prefetch_hits=4, hits_gate=3, hits_temporal=1)
    every |= dict(prefetch_timely=2, explored=3, explored_paid=1, runners_up=4, runners_up_paid=2)
    every |= dict(ensure_ns=23_000, cpu_experts=7, cpu_bytes=7_000_000, cpu_ns=410_000)
    every |= dict(cpu_misses=2, cost_ns=55_000)
    layers = [
        layer_stats(
            i,
            **every,
            wait_ns=1500 * (i + 1),
            miss_copy_ns=50_000 * (10 - i),
            miss_copies=10 - i,
            cpu_wait_ns=None if i else 90_000,
        )
        for i in range(2)
    ]
    full = Stats(layers, 1, copy_ns=254_000, window_ns=210_000, min_precision=0.5)
    assert str(Stats([layer_stats(0), layer_stats(1)])) == PLAIN
    idle = layer_stats(0, calls=0, hits=0, misses=0, evictions=0, bytes_h2d=0)
    assert str(Stats([idle])) == IDLE
    assert str(full) == EVERY_COLUMN


def test_the_hybrid_reports_each_sides_speed_beside_its_own_alone():
    """Each side's GB/s of expert weights: 1 MB experts; the CPU 14 MB in 820 us in the step, and an
    expert of one token 40 + 10 us at compile; the link 19 misses copied in 1,900 us in the step (stall
    timing), a copy 200 us alone and 250 beside the CPU at compile."""
    every = dict(cpu_experts=7, cpu_bytes=7_000_000, cpu_ns=410_000, cpu_misses=2, cost_ns=55_000)
    costs = HybridCosts(round_trip=30_000, per_expert=40_000, per_pair=10_000, copy=250_000)
    timed = [
        layer_stats(
            i, **every, wait_ns=0, ensure_ns=0, miss_copy_ns=100_000 * (10 - i), miss_copies=10 - i
        )
        for i in range(2)
    ]
    s = Stats(timed, copy_ns=200_000, hybrid_costs=costs)
    t = s.totals
    assert (t["link_GB_per_s"], t["link_alone_GB_per_s"], t["link_beside_cpu_GB_per_s"]) == (
        10.0,
        5.0,
        4.0,
    )
    assert (round(t["cpu_GB_per_s"], 3), t["cpu_alone_GB_per_s"]) == (17.073, 20.0)
    assert (
        "GB/s of expert weights: the CPU 17.1 in the step, 20.0 alone; the link 10.0 in the step, 5.0 "
        "alone, 4.0 beside the CPU (at compile)"
    ) in str(s).splitlines()
    # not timed: the link's speed in the step unmeasured
    untimed = Stats(
        [layer_stats(i, **every) for i in range(2)], copy_ns=200_000, hybrid_costs=costs
    )
    assert untimed.totals["link_GB_per_s"] is None and "the link - in the step" in str(untimed)
    # GPU-only, timed: the link's line alone; untimed: nothing measured, no line
    gpu_only = Stats(
        [
            layer_stats(
                i, wait_ns=0, ensure_ns=0, miss_copy_ns=100_000 * (10 - i), miss_copies=10 - i
            )
            for i in range(2)
        ],
        copy_ns=200_000,
    )
    assert (
        "GB/s of expert weights: the link 10.0 copying the misses, 5.0 alone (at compile)"
        in str(gpu_only).splitlines()
    )
    # misses counted that no timed copy moved do not enter the link's speed: 5 MB in 100 us
    fewer = Stats([layer_stats(0, wait_ns=0, ensure_ns=0, miss_copy_ns=100_000, miss_copies=5)])
    assert fewer.layers[0].misses == 10 and fewer.totals["link_GB_per_s"] == 50.0
    plain = Stats([layer_stats(0)])
    assert plain.totals["cpu_GB_per_s"] is None and "GB/s of expert weights" not in str(plain)
