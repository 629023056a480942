"""Decode latency at one model shape: the unmodified model against asyncmoe, eager and in a CUDA graph.

    python benchmarks/decode_step.py --shape olmoe-1b-7b --caches 64 32 16 --out decode_step.json

Systems, batch-1 greedy decode, the same prompt (16 random tokens) for all:
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
`--caches 0` has the host's CPU compute every routed expert, once per `--cpu-threads` value.
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

from harness import h2d_bandwidth, prompt, trace_for
from oracle import parse as parse_oracle
from shapes import SHAPES, random_model, routing_shape


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


def measure(model, label: str, graph: bool, steps: int, rounds: int, ids: torch.Tensor) -> dict:
    """`model`'s median ms per decode step over `rounds` rounds (`timed_round`), printed as one line; for a cached
    model also the bytes it moved per token, its hit rate and its prefetch recall."""
    dec = asyncmoe.Decoder(
        model, batch_size=ids.shape[0], max_length=ids.shape[1] + steps + 1, graph=graph
    )
    per_round, moved = [], 0
    cached = any(hasattr(m, "asyncmoe") and hasattr(m.asyncmoe, "cache") for m in model.modules())
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
        if s.totals["stall_ns"] is not None:  # the last round's, on the GPU clock
            row.update(
                {
                    f"{k[:-3]}_ms_per_token": s.totals[k] / 1e6 / steps
                    for k in ("wait_ns", "ensure_ns", "stall_ns")
                }
            )
    print(
        f"{label:<72} {'graph' if graph else 'eager':<6} {row['ms_per_token']:8.3f} ms/token"
        + (
            f"  {row['bytes_per_token'] / 1e6:7.1f} MB/token  hit {100 * row['hit_rate']:5.1f}%"
            f"  prefetch recall {100 * row['prefetch_recall']:5.1f}%"
            if cached
            else ""
        )
        + (
            f"  stalls/token: wait {row['wait_ms_per_token']:.3f} ms, ensure {row['ensure_ms_per_token']:.3f} ms"
            if "stall_ms_per_token" in row
            else ""
        ),
        flush=True,
    )
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    p.add_argument("--caches", type=int, nargs="+", default=[64, 32, 16])
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
    p.add_argument("--no-eager", action="store_true", help="graph rows only")
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
    p.add_argument("--out", default=None)
    args = p.parse_args()

    replay = args.replay
    if replay == "trace" or (replay and parse_oracle(replay) is not None):
        replay = trace_for(args.shape, replay)
    bandwidth = h2d_bandwidth()
    print(f"pinned host->GPU copy_: {bandwidth:.1f} GB/s", flush=True)
    base = random_model(args.shape, torch.bfloat16, "cuda")
    experts = routing_shape(args.shape)[0]
    ids = prompt(args.shape, 1, seed=0)

    def run(model, label):
        out = [measure(model, label, True, args.steps, args.rounds, ids)]
        if not args.no_eager:
            out.append(measure(model, label, False, args.eager_steps, args.eager_rounds, ids))
        return out

    rows = run(base, "unmodified")
    resident_ms = rows[0]["ms_per_token"]
    source_sets = args.sources or ["+".join(asyncmoe.Prefetch().sources)]
    for cache in args.caches:
        plans = (
            [
                asyncmoe.Prefetch(sources=tuple(s.split("+")), budget=b, copy_programs=c or None)
                for s in source_sets
                for b in args.budgets
                for c in args.copy_programs
            ]
            if 0 < cache < experts
            else []
        )
        cases = [(policy, plan, None) for policy in args.policies for plan in plans + [None]]
        if cache == 0:  # every routed expert on the CPU: no policy, no prefetch
            cases = [(DEFAULT_POLICY, None, threads) for threads in args.cpu_threads]
        for policy, plan, threads in cases:
            model = asyncmoe.compile(
                copy.deepcopy(base),
                cache=cache,
                policy=policy,
                prefetch=plan or False,
                quantize=args.quantize,
                replay=replay,
                time_stalls=args.time_stalls and 0 < cache < experts,
                cpu_threads=threads,
            )
            label = (
                f"asyncmoe cache={cache}"
                + (f" cpu_threads={threads or 'default'}" if cache == 0 else "")
                + (f" {policy}" if len(args.policies) > 1 and cache else "")
                + (
                    f" prefetch {'+'.join(plan.sources)} budget={plan.budget} programs={plan.copy_programs or 'all'}"
                    if plan
                    else (" no prefetch" if 0 < cache < experts else "")
                )
            )
            rows += run(model, label)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    for r in rows:
        if "bytes_per_token" in r:
            r["floor_ms"] = max(resident_ms, r["bytes_per_token"] / (bandwidth * 1e9) * 1e3)
            r["limit_ratio"] = r["ms_per_token"] / r["floor_ms"]
    print(
        f"\n{'system':<72} {'mode':<6} {'ms/token':>9} {'MB/token':>9} {'floor ms':>9} {'ratio':>6} {'vs resident':>11}"
    )
    for r in rows:
        extra = (
            f"{r['bytes_per_token'] / 1e6:>9.1f} {r['floor_ms']:>9.3f} {r['limit_ratio']:>6.2f}"
            if "floor_ms" in r
            else f"{'':>9} {'':>9} {'':>6}"
        )
        print(
            f"{r['system']:<72} {'graph' if r['graph'] else 'eager':<6} {r['ms_per_token']:>9.3f} {extra} "
            f"{r['ms_per_token'] / resident_ms:>10.3f}x"
        )
    result = {
        "shape": args.shape,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "h2d_GB_per_s": bandwidth,
        "steps": args.steps,
        "rounds": args.rounds,
        "replay": args.replay,
        "time_stalls": args.time_stalls,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
