"""Decode latency at one model shape: the unmodified model against asyncmoe, eager and in a CUDA graph.

    python benchmarks/decode_step.py --shape olmoe-1b-7b --caches 64 32 16 --out decode_step.json

Systems, greedy decode of `--batch` sequences (1; several values: each case at each, one build), the same prompt (16
random tokens a sequence) for all:
  unmodified            the transformers model fully resident (a: CUDA graph; and eager)
  asyncmoe cache=C      asyncmoe with C slots per layer, with and without prefetch, graph and eager (and each of
                        `--policies`, the default policy unless given)
Per case: `--rounds` rounds of prefill + `--steps` decode steps; the figure is the median over rounds
of ms per decode step. Bytes moved per token come from asyncmoe's counters over the decode steps
only; the host->GPU bandwidth is measured in the same run (pinned copy_, 512 MB) and
floor = max(unmodified graph ms/token, bytes per token / bandwidth). `--time-stalls` also reports,
per token, how long the layers waited for their prefetch and for their own `ensure` (GPU clock;
the timing kernels add their own cost, so compare ms/token only between runs with the same flag).

Random weights (real shapes), routers widened (std 1) so tokens spread over experts: the numbers say
what the machinery costs, not how well a policy or predictor would do on real routing. With
`--replay TRACE` the asyncmoe models route by a recorded trace instead (MoE layer i by trace layer
i mod its layers; docs/traces.md), e.g. benchmarks/traces/demo_val.npz, the embedded model's routing
on held-out text (scripts/routing_stats.py). The gate predictor then scores by what it predicted when
the trace was recorded, if the trace has it (demo_val.npz does); else by the random router, which knows
nothing of the trace (as in the latency suite's synthetic traces; the prefetch gate then keeps it off).
`--replay trace`, `oracle` or `oracle-q0.8` routes as the latency suite's case of that name (harness.trace_for).
`--quantize fp8` (mxfp4, int4) keeps asyncmoe's experts in that format; the unmodified model stays bf16.
`--hybrid off on` runs each cached case with and without the CPU computing some misses (compile's `hybrid`), and
says how the step compares with what the hybrid's cost model predicts (resident + its misses' time); `--hybrid-costs`
gives that model's costs in place of compile's timing them.
`--compile` runs every row's steps (the unmodified model's too) through torch.compile: Decoder(compile=True).
`--prompt N` also times each case's prefill of one N-token prompt (eager, as the Decoder runs prompts), beside the
bytes it moved, the CPU's, and the floor: the unmodified model's prefill, or the bytes that had to cross (the routed
experts the slots lacked) and the CPU's over the link and the CPU at their measured speeds, whichever is longer.
`--caches 0` has the host's CPU compute every routed expert, once per `--cpu-threads` value; a cache may also be a
GPU-memory budget for every layer's slots (`--caches 0 8GiB`).
`--random-mxfp4` builds every asyncmoe model afresh with random MXFP4 experts made straight in host memory
(shapes.random_mxfp4_model), for shapes whose bf16 experts do not fit anywhere; there is then no unmodified row,
and a cache of every expert (128 here: all resident, in MXFP4 on the GPU) stands in for it:
    python benchmarks/decode_step.py --shape gpt-oss-120b --random-mxfp4 --replay trace --caches 128 0 8GiB
Every row also says the memory its case held: host RSS after compile and its peak over the build and the rounds,
the pinned host store, and the GPU's allocated bytes after compile and peak over the rounds (a bf16 model's
copies keep the unmodified model on the GPU beside them: it counts in theirs).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics

import torch
import transformers

import asyncmoe
from asyncmoe.cache.policies import DEFAULT_POLICY
from asyncmoe.integrations.replay import Replay
from asyncmoe.integrations.transformers import PROVIDER, find_experts
from asyncmoe.settings import parse_budget
from asyncmoe.trace import Trace

from harness import belady_hit_rate, cuda_ms, h2d_bandwidth, prompt, trace_for
from oracle import parse as parse_oracle
from report import transfer_ms
from shapes import SHAPES, random_model, random_mxfp4_model, routing_shape


def timed_round(model, dec, ids: torch.Tensor, steps: int, cached: bool) -> float:
    """One round: prefill, the counters reset (a cached model), then `steps` decode steps timed by CUDA events:
    ms per token."""
    dec.prefill(ids)
    if cached:
        asyncmoe.stats(model, reset=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    dec.decode(steps)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def is_cached(model) -> bool:
    return any(hasattr(m, "asyncmoe") and hasattr(m.asyncmoe, "cache") for m in model.modules())


def prefill_row(model, label: str, shape: str, n: int, rounds: int) -> dict:
    """`model`'s median ms over `rounds` eager prefills of one `n`-token prompt (`cuda_ms`, after one untimed),
    printed as one line; a cached model's bytes copied and the CPU's a prefill (the mean over its calls), and the
    CPU's speed alone (compile's)."""
    ids = prompt(shape, 1, n, seed=n)
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=n + 1, graph=False)
    cached = is_cached(model)
    if cached:
        asyncmoe.stats(model, reset=True)
    row = {
        "system": label,
        "prompt": n,
        "ms_per_prefill": cuda_ms(lambda: dec.prefill(ids), rounds),
    }
    if cached:
        t, calls = asyncmoe.stats(model).totals, rounds + 1
        row.update(
            bytes_per_prefill=t["bytes_h2d"] / calls,
            bytes_to_cross=t["miss_bytes"] / calls,
            cpu_bytes_per_prefill=t["cpu_bytes"] / calls,
            cpu_GB_per_s=t["cpu_alone_GB_per_s"],
        )
    print(
        f"{label:<72} prefill {n} tokens {row['ms_per_prefill']:9.1f} ms ({n / row['ms_per_prefill'] * 1e3:.0f} "
        "tokens/s)"
        + (
            f"  {row['bytes_per_prefill'] / 1e9:.2f} GB copied ({row['bytes_to_cross'] / 1e9:.2f} GB had to cross),"
            f" {row['cpu_bytes_per_prefill'] / 1e9:.2f} GB on the CPU"
            if cached
            else ""
        ),
        flush=True,
    )
    return row


def measure(
    model,
    label: str,
    graph: bool,
    steps: int,
    rounds: int,
    ids: torch.Tensor,
    compile: bool = False,
    trace: Trace | None = None,
) -> dict:
    """`model`'s median ms per decode step over `rounds` rounds (`timed_round`), printed as one line; for a cached
    model also the bytes it moved per token, its hit rate and its prefetch recall, and, routed by `trace`, the
    Belady bound's hit rate on the tokens its last round decoded. `compile`: the Decoder's."""
    dec = asyncmoe.Decoder(
        model, batch_size=ids.shape[0], max_length=ids.shape[1] + steps + 1, graph=graph,
        compile=compile, waves=True,  # a GPU-only batch over the slots: its waves, captured
    )  # fmt: skip
    per_round, moved = [], 0
    cached = is_cached(model)
    for _ in range(rounds):
        per_round.append(timed_round(model, dec, ids, steps, cached))
        if cached:
            moved += asyncmoe.stats(model).totals["bytes_h2d"]
    row = {
        "system": label,
        "graph": graph,
        "ms_per_token": statistics.median(per_round),
        "rounds": per_round,
    }
    if cached:
        s = asyncmoe.stats(model)
        row.update(
            bytes_per_token=moved / (rounds * steps),
            hit_rate=s.totals["hit_rate"],
            prefetch_recall=s.totals["prefetch_recall"],
            wasted_per_token=s.totals["wasted_bytes"] / steps,
        )
        replays = [m for m in model.modules() if isinstance(m, Replay)]
        if trace is not None and replays:
            slots, batch = s.layers[0].slots, ids.shape[0]
            row["belady_hit_rate"] = belady_hit_rate(trace, batch, slots, replays[0].routed, steps)
        if s.totals["cpu_misses"] or s.totals["cpu_experts"]:  # the last round's
            row.update(
                cpu_misses_per_token=s.totals["cpu_misses"] / steps,
                cpu_experts_per_token=s.totals["cpu_experts"] / steps,
                model_ms_per_token=s.totals["cost_ns"] / 1e6 / steps,
                cpu_wait_ms_per_token=(s.totals["cpu_wait_ns"] or 0) / 1e6 / steps,
            )
        if s.totals["stall_ns"] is not None:  # the last round's, on the GPU clock
            row.update(
                {
                    f"{k[:-3]}_ms_per_token": s.totals[k] / 1e6 / steps
                    for k in ("wait_ns", "ensure_ns", "stall_ns")
                },
                link_GB_per_s=s.totals["link_GB_per_s"],
            )
    print(
        f"{label:<72} {'graph' if graph else 'eager':<6} {row['ms_per_token']:8.3f} ms/token"
        + (
            f"  {row['bytes_per_token'] / 1e6:7.1f} MB/token  hit {100 * row['hit_rate']:5.1f}%"
            + (f" (Belady {100 * row['belady_hit_rate']:.1f}%)" if "belady_hit_rate" in row else "")
            + f"  prefetch recall {100 * row['prefetch_recall']:5.1f}%"
            if cached
            else ""
        )
        + (
            f"  stalls/token: wait {row['wait_ms_per_token']:.3f} ms, ensure {row['ensure_ms_per_token']:.3f} ms"
            + (
                f", the link {row['link_GB_per_s']:.1f} GB/s copying misses"
                if row["link_GB_per_s"]
                else ""
            )
            if "stall_ms_per_token" in row
            else ""
        )
        + (
            f"  cpu/token: {row['cpu_misses_per_token']:.1f} misses, GPU waited {row['cpu_wait_ms_per_token']:.3f} ms,"
            f" cost model {row['model_ms_per_token']:.3f} ms"
            if "cpu_misses_per_token" in row
            else ""
        ),
        flush=True,
    )
    return row


HYBRID = {"off": False, "on": True, "auto": None}


def cache_arg(text: str) -> int | str:
    """A `--caches` entry: slots per MoE layer, or a GPU-memory budget for all of them ("8GiB"), checked here so that
    a typo fails before a model is built."""
    if text.isdigit():
        return int(text)
    parse_budget(text)
    return text


def host_status(key: str) -> int:
    """Bytes of a /proc/self/status entry (VmRSS: resident now; VmHWM: the peak since `reset_host_peak`)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def reset_host_peak() -> None:
    """Start VmHWM again from the resident set now (Linux 4.0+); where refused, it stays the process's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def pinned_bytes(model) -> int:
    """Bytes of the host store the model's providers hold pinned (the cached layers' and cache=0's)."""
    total = 0
    for _, m in find_experts(model):
        provider = getattr(m, PROVIDER, None)
        holder = getattr(provider, "cache", provider)  # a cached layer's cache; cache=0's provider
        block = getattr(holder, "pinned_block", None)
        total += block.nbytes if block is not None else 0
    return total


def memory_after_build(model) -> dict:
    return dict(
        host_rss_bytes=host_status("VmRSS"),
        pinned_bytes=pinned_bytes(model),
        gpu_bytes=torch.cuda.memory_allocated(),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument(
        "--caches",
        type=cache_arg,
        nargs="+",
        default=[64, 32, 16],
        help="slots per MoE layer (0: every routed expert on the CPU) or GPU-memory budgets (8GiB)",
    )
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1],
        help="sequences decoded together; several: each case at each, from one build",
    )
    p.add_argument(
        "--prompt",
        type=int,
        default=None,
        help="also time each case's prefill of one prompt of this many tokens",
    )
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--eager-steps", type=int, default=16)
    p.add_argument("--eager-rounds", type=int, default=3)
    p.add_argument(
        "--replay",
        default=None,
        help="route asyncmoe models by this .npz trace (docs/traces.md), or as a latency-suite routing: trace, "
        "oracle, oracle-q0.8 (the shape's trace, its gate arrays the oracle's)",
    )
    p.add_argument(
        "--quantize",
        choices=["fp8", "mxfp4", "int4"],
        default=None,
        help="asyncmoe's experts' format",
    )
    p.add_argument(
        "--random-mxfp4",
        action="store_true",
        help="build each asyncmoe model afresh with random MXFP4 experts made in host memory, never in bf16 "
        "(shapes.random_mxfp4_model: gpt-oss-120b); no unmodified row",
    )
    p.add_argument("--no-eager", action="store_true", help="graph rows only")
    p.add_argument(
        "--compile",
        action="store_true",
        help="every row's steps through torch.compile (Decoder(compile=True)), the unmodified model's too",
    )
    p.add_argument(
        "--prefetch-only", action="store_true", help="cached rows with prefetch only, none without"
    )
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[asyncmoe.Prefetch.budget],
        help="prefetch budgets to try",
    )
    p.add_argument(
        "--copy-programs",
        type=int,
        nargs="+",
        default=[32],
        help="prefetch copy grid caps (0: full grid)",
    )
    p.add_argument(
        "--sources",
        nargs="+",
        default=None,
        help="prefetch predictor sets to try, each joined by + (default: Prefetch()'s)",
    )
    p.add_argument(
        "--policies", nargs="+", default=[DEFAULT_POLICY], help="eviction policies to try"
    )
    p.add_argument(
        "--time-stalls",
        action="store_true",
        help="time each layer's waits on the GPU clock (adds kernels)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        nargs="+",
        default=[None],
        help="cache=0 (every routed expert on the CPU): the CPU executor's thread counts to try",
    )
    p.add_argument(
        "--hybrid",
        choices=sorted(HYBRID),
        nargs="+",
        default=["off"],
        help="cached rows: the CPU computing some misses (on), none (off), or as compile's default decides (auto)",
    )
    p.add_argument(
        "--hybrid-costs",
        type=int,
        nargs=4,
        metavar=("ROUND_TRIP", "PER_EXPERT", "PER_PAIR", "COPY"),
        default=None,
        help="hybrid rows: split by these costs in ns (asyncmoe.HybridCosts) instead of timing them at compile",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.random_mxfp4 and args.quantize not in (None, "mxfp4"):
        p.error(f"--random-mxfp4 makes mxfp4 experts; --quantize {args.quantize} re-quantizes")
    quantize = "mxfp4" if args.random_mxfp4 else args.quantize

    replay = args.replay
    if replay == "trace" or (replay and parse_oracle(replay) is not None):
        replay = trace_for(args.shape, replay)
    trace = Trace.load(replay) if isinstance(replay, str) else replay
    bandwidth = h2d_bandwidth()
    print(f"pinned host->GPU copy_: {bandwidth:.1f} GB/s", flush=True)
    reset_host_peak()
    base = None if args.random_mxfp4 else random_model(args.shape, torch.bfloat16, "cuda")
    experts = routing_shape(args.shape)[0]

    timings = [(True, args.steps, args.rounds)]
    if not args.no_eager:
        timings.append((False, args.eager_steps, args.eager_rounds))

    def run(model, label, memory):
        out = []
        for batch in args.batch:
            ids = prompt(args.shape, batch, seed=0)
            name = label + (f" batch={batch}" if len(args.batch) > 1 else "")
            for graph, steps, rounds in timings:
                torch.cuda.reset_peak_memory_stats()
                row = measure(model, name, graph, steps, rounds, ids, args.compile, trace)
                peaks = dict(
                    host_peak_bytes=host_status("VmHWM"),
                    gpu_peak_bytes=torch.cuda.max_memory_allocated(),
                )
                out.append({**row, "batch": batch, **memory, **peaks})
        if args.prompt:
            prefills.append(prefill_row(model, label, args.shape, args.prompt, args.rounds))
        r = out[0]
        print(
            f"{'':<72} host {r['host_rss_bytes'] / 1e9:.1f} GB (peak {r['host_peak_bytes'] / 1e9:.1f}),"
            f" pinned {r['pinned_bytes'] / 1e9:.1f} GB; GPU {r['gpu_bytes'] / 1e9:.1f} GB"
            f" (peak {max(x['gpu_peak_bytes'] for x in out) / 1e9:.1f})",
            flush=True,
        )
        return out

    prefills = []  # `--prompt`'s rows, one a case
    rows = [] if base is None else run(base, "unmodified", memory_after_build(base))
    # each batch's resident step (graph), and the resident prefill
    resident_ms = {r["batch"]: r["ms_per_token"] for r in rows if r["graph"]}
    resident_prefill = prefills[0]["ms_per_prefill"] if prefills else None
    source_sets = args.sources or ["+".join(asyncmoe.Prefetch().sources)]
    for cache in args.caches:
        # slots, fewer than the experts
        cached = cache != 0 and not (isinstance(cache, int) and cache >= experts)
        plans = (
            [
                asyncmoe.Prefetch(sources=tuple(s.split("+")), budget=b, copy_programs=c or None)
                for s in source_sets
                for b in args.budgets
                for c in args.copy_programs
            ]
            if cached
            else []
        )
        cases = [
            (policy, plan, None, hybrid)
            for policy in args.policies
            for plan in plans + ([] if args.prefetch_only and plans else [None])
            for hybrid in (args.hybrid if cached else ["off"])
        ]
        if cache == 0:  # every routed expert on the CPU: no policy, no prefetch
            cases = [(DEFAULT_POLICY, None, threads, "off") for threads in args.cpu_threads]
        for policy, plan, threads, hybrid in cases:
            reset_host_peak()
            model = asyncmoe.compile(
                copy.deepcopy(base)
                if base is not None
                else random_mxfp4_model(args.shape, torch.bfloat16, "cuda"),
                cache=cache,
                policy=policy,
                device="cuda",
                prefetch=plan or False,
                quantize=quantize,
                replay=replay,
                time_stalls=args.time_stalls and cached,
                cpu_threads=threads,
                hybrid=HYBRID[hybrid] if cached else None,
                hybrid_costs=asyncmoe.HybridCosts(*args.hybrid_costs)
                if args.hybrid_costs and cached and hybrid != "off"
                else None,
            )
            label = (
                f"asyncmoe cache={cache}"
                + (f" cpu_threads={threads or 'default'}" if cache == 0 else "")
                + (f" hybrid={hybrid}" if cached and hybrid != "off" else "")
                + (f" {policy}" if len(args.policies) > 1 and cache else "")
                + (
                    f" prefetch {'+'.join(plan.sources)} budget={plan.budget} programs={plan.copy_programs or 'all'}"
                    if plan
                    else (" no prefetch" if cached else "")
                )
            )
            new = run(model, label, memory_after_build(model))
            rows += new
            # a random model's resident twin: every expert in its slots
            if not resident_ms and not cached and cache != 0:
                resident_ms = {r["batch"]: r["ms_per_token"] for r in new if r["graph"]}
                resident_prefill = prefills[-1]["ms_per_prefill"] if prefills else None
            del model
            gc.collect()  # transformers models hold cycles: the next case's host store must not meet this one's
            torch.cuda.empty_cache()
    for r in rows:
        resident = resident_ms.get(r["batch"])
        if "bytes_per_token" in r:
            r["floor_ms"] = max(resident or 0.0, r["bytes_per_token"] / (bandwidth * 1e9) * 1e3)
            # no unmodified row and nothing copied: no floor to compare with
            r["limit_ratio"] = r["ms_per_token"] / r["floor_ms"] if r["floor_ms"] else float("nan")
        # the step as the hybrid's cost model predicts it
        if "model_ms_per_token" in r and resident:
            r["predicted_ms"] = resident + r["model_ms_per_token"]
    print(
        f"\n{'system':<72} {'mode':<6} {'batch':>5} {'ms/step':>9} {'tokens/s':>9} {'MB/step':>9} {'floor ms':>9}"
        f" {'ratio':>6} {'vs resident':>11}"
    )
    for r in rows:
        extra = (
            f"{r['bytes_per_token'] / 1e6:>9.1f} {r['floor_ms']:>9.3f} {r['limit_ratio']:>6.2f}"
            if "floor_ms" in r
            else f"{'':>9} {'':>9} {'':>6}"
        )
        resident = resident_ms.get(r["batch"])
        vs = f"{r['ms_per_token'] / resident:>10.3f}x" if resident else ""
        print(
            f"{r['system']:<72} {'graph' if r['graph'] else 'eager':<6} {r['batch']:>5} {r['ms_per_token']:>9.3f}"
            f" {r['batch'] / r['ms_per_token'] * 1e3:>9.1f} {extra} {vs}"
        )
    for r in prefills:
        if "bytes_per_prefill" in r and resident_prefill:
            moved = transfer_ms(
                r["bytes_to_cross"], bandwidth, r["cpu_bytes_per_prefill"], r["cpu_GB_per_s"]
            )
            r["floor_ms"] = max(resident_prefill, moved)
            print(
                f"{r['system']}: prefill of {r['prompt']} tokens {r['ms_per_prefill']:.1f} ms, floor"
                f" {r['floor_ms']:.1f} ms (the resident prefill, or what had to cross over the link and the CPU's),"
                f" {r['ms_per_prefill'] / r['floor_ms']:.2f}x"
            )
    for r in rows:
        if "predicted_ms" in r:
            print(
                f"{r['system']} ({'graph' if r['graph'] else 'eager'}): the cost model predicts {r['predicted_ms']:.3f}"
                f" ms/token (resident + its misses' time), measured {r['ms_per_token'] / r['predicted_ms']:.2f}x that"
            )
    result = {
        "shape": args.shape,
        "random_mxfp4": args.random_mxfp4,
        "compile": args.compile,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "h2d_GB_per_s": bandwidth,
        "steps": args.steps,
        "rounds": args.rounds,
        "replay": args.replay,
        "batch": args.batch,
        "time_stalls": args.time_stalls,
        "rows": rows,
        "prefills": prefills,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
