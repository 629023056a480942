"""report.py on a real run of the suite's CPU profile: every case becomes a row, the derived columns add up."""

import subprocess
import sys

import pytest

import report


def test_report_rows_and_files(tmp_path):
    json_path = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks/test_latency.py",
           "--benchmark-only", f"--benchmark-json={json_path}", "-k", "router"]
    subprocess.run(cmd, check=True, capture_output=True)
    import json

    data = json.loads(json_path.read_text())
    table = report.rows(data)
    assert {r["system"] for r in table} >= {"unmodified", "seed", "asyncmoe-eager"}
    for r in table:
        assert r["tokens_per_s"] == pytest.approx(1e3 * r["batch"] / r["ms_per_token"])
    eager = next(r for r in table if r["system"] == "asyncmoe-eager")
    seed = next(r for r in table if r["system"] == "seed")
    assert eager["speedup_vs_seed"] == pytest.approx(seed["ms_per_token"] / eager["ms_per_token"])
    paths = report.write(json_path)
    md = paths[0].read_text()
    prefill = report.prefill_rows(data)
    assert prefill and md.count("\n| tiny | router |") == len(table) + len(prefill)
    for png in paths[1:]:
        assert png.read_bytes()[:4] == b"\x89PNG"
    # split into two runs and merged back: the same rows
    half = len(data["benchmarks"]) // 2
    parts = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, benches in zip(parts, [data["benchmarks"][:half], data["benchmarks"][half:]]):
        path.write_text(json.dumps(dict(data, benchmarks=benches)))
    assert report.rows(report.merge(parts)) == table
