"""Run the latency suite and write its results: the raw JSON, a markdown table, and plots.

    python benchmarks/report.py --profile full-1     # one run of the full profile (GPU; full-2, full-3 likewise)
    python benchmarks/report.py --quick              # the quick profile, ~150 s on the H200
    python benchmarks/report.py --from-json out/full-1.json   # the table and plots of a run

Writes <profile>.json under `--out` (pytest-benchmark's JSON, every case's extra_info included, rewritten after each
finished case: a run cut short keeps them), <profile>.md and, with matplotlib
(`pip install -e ".[bench]"`), ...-ms.png (ms/token against cache size per system) and ...-hits.png (hit rate
per layer). Per case: median ms/token and its spread over rounds, tokens/s, hit rate, prefetch recall, MB moved
per token, the host->GPU bandwidth measured right after the case (GPU only), floor = max(resident ms/token, bytes moved
/ that bandwidth; where the CPU computed misses, the bytes it read too, over that bandwidth and the CPU's own at once:
`transfer_ms`), the Belady floor (the same with the fewest bytes any cache of that size must move on the trace),
limit ratio = time / Belady floor (trace routing) or time / floor, the speedups over accelerate and the seed, and
beside the latter the most any cache of that size could gain over the seed: the seed's time / the Belady floor.
Then where each batch-1 decode case's time goes: copies, compute and their overlap (`split_rows`). Below the
tables, the targets for the cases the run has, each met or missed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def compared_with(system: str) -> list[str]:
    """The systems a row's speedups are over: asyncmoe's over accelerate and the seed, the seed's over accelerate."""
    return {"unmodified": [], "accelerate": [], "seed": ["accelerate"]}.get(
        system, ["accelerate", "seed"]
    )


def baselines(row: dict, group: list[dict]) -> list[tuple[str, dict]]:
    """The (system, case) a row gets a speedup over, from its group: asyncmoe's over accelerate and the seed,
    the seed's over accelerate. Accelerate has no cache of its own, so the rows of every cache smaller than
    the experts compare with its one run (with every expert in a slot nothing is offloaded); the seed at the
    same cache."""
    found = [
        (
            base,
            next(
                (
                    d
                    for d in group
                    if d["system"] == base and (base == "accelerate" or d["cache"] == row["cache"])
                ),
                None,
            ),
        )
        for base in compared_with(row["system"])
        if base != "accelerate" or row["cache"] < row["experts"]
    ]
    return [(base, other) for base, other in found if other]


def rows(data: dict) -> list[dict]:
    """One row per decode case with the derived columns; groups share shape, routing and batch."""
    cases = [
        dict(
            b["extra_info"],
            spread_ms=(b["stats"]["max"] - b["stats"]["min"]) * 1e3 / b["extra_info"]["steps"],
        )
        for b in data["benchmarks"]
        if "steps" in b["extra_info"]
    ]
    out = []
    for c in cases:
        group = [
            d
            for d in cases
            if (d["shape"], d["routing"], d["batch"]) == (c["shape"], c["routing"], c["batch"])
        ]
        # the resident model computes the same whatever a trace's gate arrays say: its row under another routing
        # of the shape and batch serves where this routing has none (the link profile runs it once)
        same = sorted(
            (
                d
                for d in cases
                if (d["shape"], d["batch"], d["system"]) == (c["shape"], c["batch"], "unmodified")
            ),
            key=lambda d: d["routing"] != c["routing"],
        )
        resident = same[0]["ms_per_token"] if same else None
        c = dict(c, tokens_per_s=1e3 * c["batch"] / c["ms_per_token"])
        bw, cpu_bw = c.get("h2d_GB_per_s"), c.get("cpu_GB_per_s")
        if resident and bw and "bytes_per_token" in c:
            moved = transfer_ms(c["bytes_per_token"], bw, c.get("cpu_bytes_per_token", 0), cpu_bw)
            c["floor_ms"] = max(resident, moved)
            if "belady_bytes_per_token" in c:
                least = transfer_ms(c["belady_bytes_per_token"], bw, cpu_GB_per_s=cpu_bw)
                c["belady_floor_ms"] = max(resident, least)
            c["limit_ratio"] = c["ms_per_token"] / c.get("belady_floor_ms", c["floor_ms"])
        for base, other in baselines(c, group):
            c[f"speedup_vs_{base}"] = other["ms_per_token"] / c["ms_per_token"]
            if base == "seed" and "belady_floor_ms" in c:
                c["seed_over_belady"] = other["ms_per_token"] / c["belady_floor_ms"]
        out.append(c)
    return sorted(
        out, key=lambda r: (r["shape"], r["routing"], r["batch"], -r["cache"], r["system"])
    )


TARGET_SHAPES = ("olmoe-1b-7b", "deepseek-v2-lite")


def ok(met: bool) -> str:
    return "met" if met else "**missed**"


def targets(table: list[dict], prefill: list[dict]) -> list[str]:
    """The targets, for the cases this run has: on the OLMoE and DeepSeek-V2-Lite shapes with trace routing,
    at batch 1 and cache 25% within 1.25x the Belady floor and >= 50x faster than accelerate; at batch 32
    and for a 2048-token prompt, faster than the seed at the same cache."""

    out = []
    for r in table:
        if (
            r["shape"] not in TARGET_SHAPES
            or r["routing"] != "trace"
            or not r["system"].startswith("asyncmoe")
        ):
            continue
        case = (
            f"{r['shape']}, trace, batch {r['batch']}, {r['cache']}/{r['experts']}, {r['system']}"
        )
        if (
            r["batch"] == 1
            and r["cache"] * 4 == r["experts"]
            and r["system"] == "asyncmoe-graph-prefetch"
        ):
            parts = (
                [
                    f"limit ratio {r['limit_ratio']:.2f} against <= 1.25: {ok(r['limit_ratio'] <= 1.25)}"
                ]
                if "limit_ratio" in r
                else []
            )
            if "speedup_vs_accelerate" in r:
                acc = r["speedup_vs_accelerate"]
                parts.append(f"{acc:.1f}x accelerate against >= 50x: {ok(acc >= 50)}")
            if "speedup_vs_seed" in r:
                most = (
                    f", of at most {r['seed_over_belady']:.1f}x (the seed's time / Belady floor)"
                    if "seed_over_belady" in r
                    else ""
                )
                parts.append(f"{r['speedup_vs_seed']:.2f}x the seed{most}")
            if (
                parts
            ):  # a run without the resident model, accelerate or the seed has nothing to compare
                out.append(f"- {case}: " + "; ".join(parts))
        elif r["batch"] == 32 and "speedup_vs_seed" in r:
            ratio = f"; limit ratio {r['limit_ratio']:.2f}" if "limit_ratio" in r else ""
            out.append(
                f"- {case}: {r['speedup_vs_seed']:.2f}x the seed, faster: {ok(r['speedup_vs_seed'] > 1)}{ratio}"
            )
    for r in prefill:
        if (
            r["shape"] in TARGET_SHAPES
            and r["routing"] == "trace"
            and r["prompt"] == 2048
            and r["system"].startswith("asyncmoe")
            and "speedup_vs_seed" in r
        ):
            ratio = f"; limit ratio {r['limit_ratio']:.2f}" if "limit_ratio" in r else ""
            out.append(
                f"- {r['shape']}, trace, prompt 2048, {r['cache']}/{r['experts']}, {r['system']}: "
                f"{r['speedup_vs_seed']:.1f}x the seed, faster: {ok(r['speedup_vs_seed'] > 1)}{ratio}"
            )
    out += format_targets(table, prefill)
    out += split_targets(split_rows(table))
    return ["", "Targets for the cases of this run:", "", *out] if out else []


FORMAT_TARGETS = {
    "fp8": 0.55,
    "mxfp4": 0.35,
    "int4": 0.35,
}  # at most this times bf16's time at equal GPU memory
FORMATS = tuple(FORMAT_TARGETS)


def format_targets(table: list[dict], prefill: list[dict]) -> list[str]:
    """Quantized experts against bf16 in the same run: decode at the GPU memory of the same bf16 slots within
    FORMAT_TARGETS of bf16's time; fully resident no slower than the unmodified bf16 model; a prompt at the same
    slots within 1.3x bf16's."""

    def base(r):
        return r["system"].removesuffix("-" + r["format"])

    out = []
    for r in table:
        if r.get("format") not in FORMAT_TARGETS or r["shape"].startswith("tiny"):
            continue
        group = [
            d
            for d in table
            if (d["shape"], d["routing"], d["batch"]) == (r["shape"], r["routing"], r["batch"])
        ]
        case = f"{r['shape']}, {r['routing']}, batch {r['batch']}, {r['system']} {r['cache']}/{r['experts']}"
        if r["cache"] >= r["experts"]:
            other = next((d for d in group if d["system"] == "unmodified"), None)
            if other:
                ratio = r["ms_per_token"] / other["ms_per_token"]
                out.append(
                    f"- {case}: {ratio:.2f}x the unmodified bf16 model, at most 1.00: {ok(ratio <= 1.0)}"
                )
            continue
        bf16 = r.get("memory_of_bf16_slots")
        other = next(
            (
                d
                for d in group
                if d["system"] == base(r) and d["cache"] == bf16 and "memory_of_bf16_slots" not in d
            ),
            None,
        )
        if other:
            ratio, most = r["ms_per_token"] / other["ms_per_token"], FORMAT_TARGETS[r["format"]]
            out.append(
                f"- {case}: {ratio:.2f}x bf16's time at the GPU memory of its {bf16} slots, at most {most}: "
                f"{ok(ratio <= most)}"
            )
    for r in prefill:
        if r.get("format") not in FORMAT_TARGETS or r["shape"].startswith("tiny"):
            continue
        key = (r["shape"], r["routing"], r["prompt"], base(r), r["cache"])
        other = next(
            (
                d
                for d in prefill
                if (d["shape"], d["routing"], d["prompt"], d["system"], d["cache"]) == key
            ),
            None,
        )
        if other:
            ratio = r["ms_per_prefill"] / other["ms_per_prefill"]
            out.append(
                f"- {r['shape']}, {r['routing']}, prompt {r['prompt']}, {r['system']} {r['cache']}/{r['experts']}: "
                f"{ratio:.2f}x bf16's at the same slots, at most 1.3: {ok(ratio <= 1.3)}"
            )
    return out


def split_rows(table: list[dict]) -> list[dict]:
    """Where a batch-1 decode case's time goes: its copies (bytes moved / the bandwidth measured beside it), its
    compute (the same format fully resident: the unmodified model in bf16, asyncmoe's graph for a quantized format)
    and their overlap = compute + copies - time (negative: time beyond both). A prefetching case also gets its time
    over the graph's without prefetch at the same cache in the same run; under an oracle's gate arrays that is the
    trace's, since they change only what prefetch nominates."""

    def find(**want):
        return next((d for d in table if all(d.get(k) == v for k, v in want.items())), None)

    out = []
    for r in table:
        if (
            r["batch"] != 1
            or not r["system"].startswith("asyncmoe")
            or not r.get("bytes_per_token")
        ):
            continue
        fmt = r.get("format")
        resident = (
            dict(system=f"asyncmoe-graph-{fmt}", cache=r["experts"])
            if fmt in FORMATS
            else {"system": "unmodified"}
        )
        compute = find(shape=r["shape"], batch=1, **resident)
        if not compute or not r.get("h2d_GB_per_s"):
            continue
        s = dict(
            r,
            copies_ms=r["bytes_per_token"] / (r["h2d_GB_per_s"] * 1e6),
            compute_ms=compute["ms_per_token"],
        )
        s["overlap_ms"] = s["compute_ms"] + s["copies_ms"] - r["ms_per_token"]
        if "-prefetch" in r["system"]:
            routing = "trace" if r["routing"].startswith("oracle") else r["routing"]
            none = find(
                shape=r["shape"],
                routing=routing,
                batch=1,
                cache=r["cache"],
                system=r["system"].replace("-prefetch", ""),
            )
            if none:
                s["over_no_prefetch"] = r["ms_per_token"] / none["ms_per_token"]
        out.append(s)
    return out


def split_targets(split: list[dict]) -> list[str]:
    """With every prediction right (`oracle`), time within 1.10x the copies or 1.05x the compute; with noisy ones
    (`oracle-q*`) or where nothing predicts the routing (`router`), prefetch at most 1.02x no prefetch."""
    out = []
    for s in split:
        case = (
            f"- {s['shape']}, {s['routing']}, batch 1, {s['cache']}/{s['experts']}, {s['system']}: "
        )
        if s["routing"] == "oracle":
            copies, compute = (
                s["ms_per_token"] / s["copies_ms"],
                s["ms_per_token"] / s["compute_ms"],
            )
            met = copies <= 1.10 or compute <= 1.05
            out.append(
                case
                + f"{copies:.2f}x its copies, {compute:.2f}x its compute, at most 1.10x / 1.05x: {ok(met)}"
            )
        elif "over_no_prefetch" in s and (
            s["routing"].startswith("oracle-q") or s["routing"] == "router"
        ):
            x = s["over_no_prefetch"]
            out.append(case + f"{x:.3f}x no prefetch, at most 1.02x: {ok(x <= 1.02)}")
    return out


def transfer_ms(
    link_bytes: float, link_GB_per_s: float, cpu_bytes: float = 0, cpu_GB_per_s: float | None = None
) -> float:
    """The least time the experts' bytes take: over the link at its measured speed, or, where the CPU
    computes misses and its speed is known, over the link and the CPU reading at once, the bytes
    shared between them as best they can be (an unknown speed leaves the CPU's bytes out)."""
    if not cpu_GB_per_s:
        return link_bytes / (link_GB_per_s * 1e6)
    return (link_bytes + cpu_bytes) / ((link_GB_per_s + cpu_GB_per_s) * 1e6)


def prefill_rows(data: dict) -> list[dict]:
    """One row per prefill case, with the speedups over accelerate and the seed at the same cache size, and
    floor = max(resident prefill ms, `transfer_ms` of the bytes that had to cross, the routed experts the slots
    lacked (the bytes moved where a result predates that count), and the CPU's) with limit ratio = ms / floor
    where known. The least any cache of this size must move is what the slots lacked when the prompt came: no
    Belady column."""
    cases = [b["extra_info"] for b in data["benchmarks"] if "prompt" in b["extra_info"]]
    out = []
    for c in cases:
        group = [
            d
            for d in cases
            if (d["shape"], d["routing"], d["prompt"]) == (c["shape"], c["routing"], c["prompt"])
        ]
        c = dict(c)
        for base, other in baselines(c, group):
            c[f"speedup_vs_{base}"] = other["ms_per_prefill"] / c["ms_per_prefill"]
        resident = next(
            (
                d["ms_per_prefill"]
                for d in cases
                if d["system"] == "unmodified"
                and (d["shape"], d["routing"], d["prompt"])
                == (c["shape"], c["routing"], c["prompt"])
            ),
            None,
        )
        if resident and "bytes_per_prefill" in c and c.get("h2d_GB_per_s"):
            moved = transfer_ms(
                c.get("bytes_to_cross", c["bytes_per_prefill"]), c["h2d_GB_per_s"],
                c.get("cpu_bytes_per_prefill", 0), c.get("cpu_GB_per_s"),
            )  # fmt: skip
            c["floor_ms"] = max(resident, moved)
            c["limit_ratio"] = c["ms_per_prefill"] / c["floor_ms"]
        out.append(c)
    return sorted(
        out, key=lambda r: (r["shape"], r["routing"], r["prompt"], -r["cache"], r["system"])
    )


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def markdown(table: list[dict], data: dict) -> str:
    def f(r, key, fmt):
        return format(r[key], fmt) if key in r else ""

    machine = data.get("machine_info", {}).get("node", "")
    prefill = prefill_rows(data)
    first = (table or prefill or [{}])[0]
    lines = [f"Device: {first.get('device', '?')} ({machine}); dtype {first.get('dtype', '?')}."]
    head = [
        "shape",
        "routing",
        "batch",
        "system",
        "cache",
        "ms/token",
        "spread",
        "tokens/s",
        "hit",
        "recall",
        "MB/token",
        "H2D GB/s",
        "floor ms",
        "Belady floor ms",
        "limit ratio",
        "x accelerate",
        "x seed",
        "x seed at most",
        "peak GPU GiB",
        "host GiB",
        "tokens agree",
    ]
    rows = [
        [
            r["shape"],
            r["routing"],
            str(r["batch"]),
            r["system"],
            f"{r['cache']}/{r['experts']}",
            f(r, "ms_per_token", ".3f"),
            f(r, "spread_ms", ".3f"),
            f(r, "tokens_per_s", ".1f"),
            f(r, "hit_rate", ".1%"),
            f(r, "prefetch_recall", ".1%"),
            format(r["bytes_per_token"] / 1e6, ".1f") if "bytes_per_token" in r else "",
            f(r, "h2d_GB_per_s", ".1f"),
            f(r, "floor_ms", ".3f"),
            f(r, "belady_floor_ms", ".3f"),
            f(r, "limit_ratio", ".2f"),
            f(r, "speedup_vs_accelerate", ".1f"),
            f(r, "speedup_vs_seed", ".2f"),
            f(r, "seed_over_belady", ".2f"),
            format(r["peak_gpu_bytes"] / 2**30, ".2f") if "peak_gpu_bytes" in r else "",
            format(r["host_bytes"] / 2**30, ".3f"),
            f"{r['tokens_agree']}/{r['steps'] + 1}",
        ]
        for r in table
    ]
    if table:
        lines += ["", *md_table(head, rows)]
    if prefill:
        head = [
            "shape",
            "routing",
            "prompt",
            "system",
            "cache",
            "ms",
            "tokens/s",
            "GB moved",
            "H2D GB/s",
            "floor ms",
            "limit ratio",
            "x accelerate",
            "x seed",
            "first token agrees",
        ]
        rows = [
            [
                r["shape"],
                r["routing"],
                str(r["prompt"]),
                r["system"]
                + (f", {r['tokens_per_call']} tokens/call" if "tokens_per_call" in r else ""),
                f"{r['cache']}/{r['experts']}",
                f(r, "ms_per_prefill", ".1f"),
                f(r, "tokens_per_s", ".0f"),
                format(r["bytes_per_prefill"] / 1e9, ".2f") if "bytes_per_prefill" in r else "",
                f(r, "h2d_GB_per_s", ".1f"),
                f(r, "floor_ms", ".1f"),
                f(r, "limit_ratio", ".2f"),
                f(r, "speedup_vs_accelerate", ".1f"),
                f(r, "speedup_vs_seed", ".2f"),
                str(r["first_token_agrees"]),
            ]
            for r in prefill
        ]
        lines += ["", "Prefill, batch 1:", "", *md_table(head, rows)]
    split = split_rows(table)
    if split:
        head = [
            "shape",
            "routing",
            "system",
            "cache",
            "ms/token",
            "x no prefetch",
            "copies ms",
            "compute ms",
            "overlap ms",
        ]
        rows = [
            [
                s["shape"],
                s["routing"],
                s["system"],
                f"{s['cache']}/{s['experts']}",
                f(s, "ms_per_token", ".3f"),
                f(s, "over_no_prefetch", ".3f"),
                f(s, "copies_ms", ".3f"),
                f(s, "compute_ms", ".3f"),
                f(s, "overlap_ms", ".3f"),
            ]
            for s in split
        ]
        lines += ["", "Where the time goes, batch 1:", "", *md_table(head, rows)]
    return "\n".join(lines + targets(table, prefill)) + "\n"


def plots(table: list[dict], stem: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["shape"], r["routing"], r["batch"]) for r in table})
    if not groups:  # a prefill-only run: its table says it all
        return []
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (shape, routing, batch) in zip(axes[0], groups, strict=True):
        for system in sorted({r["system"] for r in table}):
            pts = sorted(
                (r["cache"] / r["experts"], r["ms_per_token"])
                for r in table
                if (r["shape"], r["routing"], r["batch"], r["system"])
                == (shape, routing, batch, system)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.set(
            title=f"{shape}, {routing} routing, batch {batch}",
            xlabel="cache / experts",
            ylabel="ms/token",
            yscale="log",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    ms = stem.with_name(stem.name + "-ms.png")
    fig.savefig(ms, dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in table:
        if "hit_rate_per_layer" in r and r["system"].startswith("asyncmoe"):
            ax.plot(
                r["hit_rate_per_layer"],
                label=f"{r['shape']} {r['routing']} {r['system']} {r['cache']}/{r['experts']} b{r['batch']}",
            )
    ax.set(xlabel="MoE layer", ylabel="hit rate", ylim=(0, 1))
    ax.legend(fontsize=6)
    fig.tight_layout()
    hits = stem.with_name(stem.name + "-hits.png")
    fig.savefig(hits, dpi=120)
    return [ms, hits]


def write(json_path: pathlib.Path) -> list[pathlib.Path]:
    data = json.loads(json_path.read_text())
    table = rows(data)
    stem = json_path.with_suffix("")
    md = stem.with_suffix(".md")
    md.write_text(markdown(table, data))
    try:
        return [md, *plots(table, stem)]
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return [md]


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--profile",
        help="the profile: smoke, quick, full-1, -2, -3, full (the default), link, link-fp8, formats-1, formats-2, "
        "cpu or hybrid",
    )
    p.add_argument("--quick", action="store_true", help="--profile quick")
    p.add_argument(
        "--out", default="docs/results", help="the folder the JSON, table and plots go to"
    )
    p.add_argument("-k", default=None, help="only the profile's cases that pytest -k selects")
    p.add_argument(
        "--from-json",
        type=pathlib.Path,
        help="run nothing: write the table and plots of this run's JSON",
    )
    args = p.parse_args()
    if args.from_json:
        for path in write(args.from_json):
            print(path)
        return
    if args.quick and args.profile not in (None, "quick"):
        p.error(f"--quick is --profile quick: drop one of --quick and --profile {args.profile}")
    name = "quick" if args.quick else args.profile or "full"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = (
        out / f"{name}.json"
    )  # named by kind: the latest result of each kind replaces the last
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(HERE / "test_latency.py"),
        "--benchmark-only",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--profile={name}",
        f"--cases-json={json_path.resolve()}",
    ]
    code = subprocess.run(cmd + (["-k", args.k] if args.k else []), check=False).returncode
    if json_path.exists():  # every case that finished, whether or not the run did
        for path in write(json_path):
            print(path)
    sys.exit(code)


if __name__ == "__main__":
    main()
