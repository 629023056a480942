"""host_probe.py on the tiny shape and a small buffer: every probe times something, and the threads are restored."""

import math

import torch
from host_probe import CPU_FORMATS, HEADER, INT4, probe, table_row


def test_every_probe_gives_a_positive_finite_time_and_bandwidth():
    before = torch.get_num_threads()
    small = dict(shapes=["tiny"], experts=2, gib=1 / 64)
    rows = list(probe(**small, threads=[1, 2], tokens=[1, 4], repeats=2))
    assert torch.get_num_threads() == before
    probes = {"read", "bf16 expert MLP"} | ({"int4 expert MLP"} if INT4 else set())
    probes |= {f"asyncmoe {fmt} expert MLP" for fmt in CPU_FORMATS}
    assert probes <= {r["probe"] for r in rows}
    scalar = list(
        probe(**small, threads=[1], tokens=[1], repeats=1, formats=("mxfp4",), isas=("scalar",))
    )
    assert {r["probe"] for r in scalar} == {"read", "asyncmoe mxfp4 expert MLP (scalar)"}
    assert len([r for r in rows if r["probe"] == "bf16 expert MLP"]) == 2 * 2  # threads x tokens
    for r in rows:
        assert all(0 < r[k] < math.inf for k in ("ms", "GB_per_s") if k in r), r  # NaN fails too
    columns = HEADER.splitlines()[0].count("|")
    assert all(table_row(r).count("|") == columns for r in rows)
