"""report.py on a real run of the suite's CPU profile (every case becomes a row, the derived columns add up), and on
hand-made cases whose floor, limit ratio and speedups are worked out by hand."""

import json
import os
import subprocess
import sys

import pytest

import report


def test_report_rows_and_files(tmp_path):
    json_path, cases_path = tmp_path / "bench.json", tmp_path / "cases.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "benchmarks/test_latency.py",
        "--benchmark-only",
        f"--benchmark-json={json_path}",
        f"--cases-json={cases_path}",
        "-k",
        "router",
    ]
    subprocess.run(cmd, check=True, capture_output=True)

    data = json.loads(json_path.read_text())
    # --cases-json, rewritten after each case, ends as pytest-benchmark's own JSON
    assert dict(json.loads(cases_path.read_text()), datetime=None) == dict(data, datetime=None)
    table = report.rows(data)
    assert {r["system"] for r in table} >= {"unmodified", "seed", "asyncmoe-eager"}
    for b in data[
        "benchmarks"
    ]:  # a case's wall time holds its build and every round, warm-up included
        e, rounds = b["extra_info"], len(b["stats"]["data"])
        assert e["wall_s"] > e["setup_s"] + rounds * b["stats"]["min"]
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


def finished(child: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = child.communicate()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_report_runs_a_profile_by_name(tmp_path):
    """`report.py --profile NAME` runs that profile's cases (-k narrows them) into bench-<date>-NAME.json and writes
    its table; a profile the machine cannot run is an error that names it, and writes nothing."""
    run = [sys.executable, "benchmarks/report.py", "--out", str(tmp_path)]
    one = ["--profile", "smoke", "-k", "router and unmodified and b1"]
    # the two runs side by side: each spends most of its time starting pytest
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = [subprocess.Popen(run + a, **pipes) for a in (one, ["--profile", "full-1"])]
    done, refused = map(finished, children)
    assert done.returncode == 0, done.stdout + done.stderr
    stem = tmp_path / "smoke"
    names = [b["name"] for b in json.loads(stem.with_suffix(".json").read_text())["benchmarks"]]
    assert names == ["test_decode[tiny-router-unmodified-cache1-b1]"]
    assert "| tiny | router | 1 | unmodified | 16/16 |" in stem.with_suffix(".md").read_text()
    assert str(stem.with_suffix(".md")) in done.stdout.splitlines()
    assert (
        refused.returncode != 0
        and "--profile full-1 needs a CUDA GPU" in refused.stdout + refused.stderr
    )
    assert not list(tmp_path.glob("*full-1*"))


def test_a_run_cut_short_keeps_the_cases_it_finished(tmp_path):
    """A run that dies mid-case (here at the second case's set-up, as a time limit's signal landing in CUDA work
    can) keeps, in --cases-json (conftest.py), every case that passed before: it is rewritten after each."""
    (tmp_path / "dies.py").write_text(
        "import os\n\n\ndef pytest_runtest_setup(item):\n    if 'seed' in item.name:\n        os._exit(3)\n"
    )
    cases_path = tmp_path / "cases.json"
    first, second = (
        "test_decode[tiny-router-unmodified-cache1-b1]",
        "test_decode[tiny-router-seed-cache0.25-b1]",
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "dies",
        f"benchmarks/test_latency.py::{first}",
        f"benchmarks/test_latency.py::{second}",
        "--benchmark-only",
        f"--cases-json={cases_path}",
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    )
    assert (
        subprocess.run(cmd, capture_output=True, env=env, check=False).returncode == 3
    )  # died at the second case
    finished = json.loads(cases_path.read_text())["benchmarks"]
    assert [b["name"] for b in finished] == [first]
    assert (
        finished[0]["extra_info"]["system"] == "unmodified" and finished[0]["stats"]["rounds"] == 2
    )


def test_prefill_floor_and_limit_ratio(tmp_path):
    """A prefill's floor is the resident prefill or its copies at the measured bandwidth, whichever is longer."""

    def case(system, cache, ms, **extra):
        info = dict(
            shape="s",
            routing="trace",
            system=system,
            cache=cache,
            experts=64,
            prompt=2048,
            ms_per_prefill=ms,
            tokens_per_s=2048 / ms * 1e3,
            device="gpu",
            dtype="bf16",
            first_token_agrees=True,
            **extra,
        )
        return {"extra_info": info}

    data = {
        "benchmarks": [
            case("unmodified", 64, 50.0),
            case("seed", 16, 100_000.0),
            case(
                "asyncmoe-eager", 16, 300.0, bytes_per_prefill=12e9, h2d_GB_per_s=50.0
            ),  # 240 ms of copies
            case(
                "asyncmoe-eager", 64, 45.0, h2d_GB_per_s=50.0
            ),  # resident: nothing moved, no floor
        ]
    }
    rows = {(r["system"], r["cache"]): r for r in report.prefill_rows(data)}
    cached = rows[("asyncmoe-eager", 16)]
    assert cached["floor_ms"] == pytest.approx(240.0) and cached["limit_ratio"] == pytest.approx(
        1.25
    )
    assert cached["speedup_vs_seed"] == pytest.approx(100_000 / 300)
    assert "floor_ms" not in rows[("asyncmoe-eager", 64)]
    # the hybrid's CPU read 3 GB at 25 GB/s beside the link's 9 GB at 50: 12 GB at 75 GB/s at best
    data["benchmarks"].append(
        case(
            "asyncmoe-eager-hybrid",
            16,
            200.0,
            bytes_per_prefill=9e9,
            h2d_GB_per_s=50.0,
            cpu_bytes_per_prefill=3e9,
            cpu_GB_per_s=25.0,
        )  # fmt: skip
    )
    hybrid = [r for r in report.prefill_rows(data) if r["system"] == "asyncmoe-eager-hybrid"][0]
    assert hybrid["floor_ms"] == pytest.approx(160.0) and hybrid["limit_ratio"] == pytest.approx(
        1.25
    )
    data["benchmarks"].pop()
    # a prompt that moved more than it had to (copies made ahead and not routed): the floor is what had to cross
    data["benchmarks"].append(
        case(
            "asyncmoe-eager-ahead",
            16,
            300.0,
            bytes_per_prefill=12e9,
            bytes_to_cross=10e9,
            h2d_GB_per_s=50.0,
        )  # fmt: skip
    )
    ahead = [r for r in report.prefill_rows(data) if r["system"] == "asyncmoe-eager-ahead"][0]
    assert ahead["floor_ms"] == pytest.approx(200.0) and ahead["limit_ratio"] == pytest.approx(1.5)
    data["benchmarks"].pop()
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps(data))
    assert report.write(path) == [tmp_path / "prefill.md"]  # no decode rows: no plots
    assert (
        "| s | trace | 2048 | asyncmoe-eager | 16/64 | 300.0 | 6827 | 12.00 | 50.0 | 240.0 | 1.25 |"
        in (tmp_path / "prefill.md").read_text()
    )


def decode_case(system, cache, ms, batch=1, **extra):
    """An OLMoE-shaped decode case as the suite writes it (batch 1 unless given), for the hand-checked tests."""
    info = dict(
        shape="olmoe-1b-7b",
        routing="trace",
        system=system,
        cache=cache,
        experts=64,
        batch=batch,
        steps=32,
        ms_per_token=ms,
        device="gpu",
        dtype="bf16",
        tokens_agree=33,
        host_bytes=0,
    )
    info.update(extra)
    return {"extra_info": info, "stats": {"min": ms * 32e-3, "max": ms * 32e-3}}


def test_targets_met_and_missed():
    """The targets for the cases a run has: each says met or missed, with the measured value."""
    case = decode_case

    copies = dict(
        bytes_per_token=1e9, belady_bytes_per_token=0.5e9, h2d_GB_per_s=50.0
    )  # Belady floor 10 ms
    data = {
        "benchmarks": [
            case("unmodified", 64, 4.0),
            case("accelerate", 16, 2000.0),
            case("seed", 16, 60.0),
            case(
                "asyncmoe-graph-prefetch", 16, 20.0, **copies
            ),  # 2.0x Belady: missed; 100x accelerate: met
            case("unmodified", 64, 8.0, batch=32),
            case("seed", 64, 40.0, batch=32),
            case("asyncmoe-graph", 64, 8.0, batch=32),
        ]
    }
    lines = report.targets(report.rows(data), [])
    assert (
        "- olmoe-1b-7b, trace, batch 1, 16/64, asyncmoe-graph-prefetch: limit ratio 2.00 against <= 1.25: **missed**; "
        "100.0x accelerate against >= 50x: met; 3.00x the seed, of at most 6.0x (the seed's time / Belady floor)"
    ) in lines
    assert (
        "- olmoe-1b-7b, trace, batch 32, 64/64, asyncmoe-graph: 5.00x the seed, faster: met"
        in lines
    )
    assert len([line for line in lines if line.startswith("- ")]) == 2
    alone = {
        "benchmarks": data["benchmarks"][3:4]
    }  # no resident model, accelerate or seed in the run
    assert report.targets(report.rows(alone), []) == []


def test_the_floor_counts_the_bytes_the_cpu_read_beside_the_links():
    """A decode case whose CPU computed misses: its floor shares the copies' and the CPU's bytes between
    the link and the CPU at their measured speeds; a CPU of unknown speed (cache=0 gives none) leaves
    its bytes out; the Belady floor shares the fewest bytes alike."""
    link = dict(bytes_per_token=0.5e9, belady_bytes_per_token=0.6e9, h2d_GB_per_s=50.0)
    data = {
        "benchmarks": [
            decode_case("unmodified", 64, 4.0),
            decode_case(
                "asyncmoe-graph-hybrid",
                16,
                30.0,
                cpu_bytes_per_token=1e9,
                cpu_GB_per_s=100.0,
                **link,
            ),  # fmt: skip
            decode_case("asyncmoe-graph", 16, 40.0, cpu_bytes_per_token=1e9, **link),
        ]
    }
    rows = {r["system"]: r for r in report.rows(data)}
    hybrid, unknown = rows["asyncmoe-graph-hybrid"], rows["asyncmoe-graph"]
    assert hybrid["floor_ms"] == pytest.approx(10.0)  # 1.5 GB at 150 GB/s
    assert hybrid["belady_floor_ms"] == pytest.approx(4.0)  # 0.6 GB at 150: the resident step
    assert unknown["floor_ms"] == pytest.approx(10.0)  # 0.5 GB at 50
    assert unknown["belady_floor_ms"] == pytest.approx(12.0)


def test_every_cache_compares_with_the_one_accelerate_run():
    """Accelerate has no cache of its own: the suite runs it once per case (test_profiles.py) and every cache's rows
    compare with it; the seed at the same cache; with every expert in a slot, nothing is offloaded to compare with."""
    case = decode_case

    data = {
        "benchmarks": [
            case("unmodified", 64, 4.0),
            case("accelerate", 16, 2000.0),
            case("seed", 16, 50.0),
            case("seed", 32, 25.0),
            case("asyncmoe-graph", 16, 20.0),
            case("asyncmoe-graph", 32, 10.0),
            case("seed", 64, 16.0),
            case("asyncmoe-graph", 64, 4.0),
        ]
    }
    got = {
        (r["system"], r["cache"]): (r.get("speedup_vs_accelerate"), r.get("speedup_vs_seed"))
        for r in report.rows(data)
    }
    assert got == {
        ("unmodified", 64): (None, None),
        ("accelerate", 16): (None, None),
        ("seed", 16): (40.0, None),
        ("seed", 32): (80.0, None),
        ("asyncmoe-graph", 16): (100.0, 2.5),
        ("asyncmoe-graph", 32): (200.0, 2.5),
        ("seed", 64): (None, None),
        ("asyncmoe-graph", 64): (None, 4.0),
    }  # all resident: nothing offloaded


def test_where_the_time_goes(tmp_path):
    """A batch-1 case's copies (bytes / the bandwidth beside it), compute (its format fully resident) and overlap, its
    time over no prefetch (the trace's row under an oracle), and the link's targets on them, worked out by hand."""

    def case(system, cache, ms, routing="trace", fmt="bfloat16", moved=None):
        copies = {} if moved is None else dict(bytes_per_token=moved, h2d_GB_per_s=50.0)
        return decode_case(system, cache, ms, routing=routing, format=fmt, **copies)

    data = {
        "benchmarks": [
            case("unmodified", 64, 4.0),
            case("asyncmoe-graph-fp8", 64, 3.0, fmt="fp8"),
            case("asyncmoe-graph", 16, 20.0, moved=0.5e9),  # 10 ms of copies
            case("asyncmoe-graph-prefetch", 16, 12.0, routing="oracle", moved=0.5e9),
            case("asyncmoe-graph-prefetch", 16, 20.5, routing="oracle-q0.7", moved=0.5e9),
            case("asyncmoe-graph", 16, 10.0, routing="router", moved=0.2e9),
            case("asyncmoe-graph-prefetch", 16, 10.1, routing="router", moved=0.2e9),
            case("asyncmoe-graph-prefetch-fp8", 16, 5.4, routing="oracle", fmt="fp8", moved=0.25e9),
        ]
    }
    table = report.rows(data)
    split = {(s["system"], s["routing"]): s for s in report.split_rows(table)}
    oracle = split[("asyncmoe-graph-prefetch", "oracle")]
    assert (oracle["copies_ms"], oracle["compute_ms"]) == pytest.approx((10.0, 4.0))
    assert oracle["overlap_ms"] == pytest.approx(2.0) and oracle[
        "over_no_prefetch"
    ] == pytest.approx(0.6)
    assert split[("asyncmoe-graph", "trace")]["overlap_ms"] == pytest.approx(-6.0)
    fp8 = split[("asyncmoe-graph-prefetch-fp8", "oracle")]
    assert (fp8["copies_ms"], fp8["compute_ms"]) == pytest.approx(
        (5.0, 3.0)
    ) and "over_no_prefetch" not in fp8
    lines = report.targets(table, [])
    prefix = "- olmoe-1b-7b, "
    assert (
        f"{prefix}oracle, batch 1, 16/64, asyncmoe-graph-prefetch: 1.20x its copies, 3.00x its compute, "
        "at most 1.10x / 1.05x: **missed**" in lines
    )
    assert (
        f"{prefix}oracle, batch 1, 16/64, asyncmoe-graph-prefetch-fp8: 1.08x its copies, 1.80x its compute, "
        "at most 1.10x / 1.05x: met" in lines
    )
    assert (
        f"{prefix}oracle-q0.7, batch 1, 16/64, asyncmoe-graph-prefetch: 1.025x no prefetch, at most 1.02x: "
        "**missed**" in lines
    )
    assert (
        f"{prefix}router, batch 1, 16/64, asyncmoe-graph-prefetch: 1.010x no prefetch, at most 1.02x: met"
        in lines
    )
    path = tmp_path / "link.json"
    path.write_text(json.dumps(data))
    md = report.write(path)[0].read_text()
    assert (
        "| olmoe-1b-7b | oracle | asyncmoe-graph-prefetch | 16/64 | 12.000 | 0.600 | 10.000 | 4.000 | 2.000 |"
        in md
    )
