"""`asyncmoe simulate`: replay a routing trace through the runtime's cache and predictor code on the CPU,
beside the Belady bound. It says what it simulates before the work starts, then how far it has got,
on stderr: stdout keeps the table or the JSON."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import threading
import time

from ..choices import DEFAULT_POLICY, PREDICTORS, PREFETCH_BUDGET
from . import options

HELP = "replay a routing trace through the cache on the CPU; print hit rates and the Belady bound"
PROGRESS_EVERY_S = {True: 0.2, False: 10.0}  # on a terminal, in a log


def add_options(s) -> None:
    s.add_argument("trace", type=_trace_file, help=".npz routing trace (docs/traces.md)")
    s.add_argument(
        "--cache",
        type=_simulated_cache,
        default=16,
        help="slots per MoE layer, or a GPU-memory budget for all layers' slots (6GiB, 6GB, "
        "512MiB) divided by the "
        "trace's expert bytes (--expert-bytes); not auto, which sizes from a GPU's free memory",
    )
    s.add_argument(
        "--policy", type=options.policy, default=DEFAULT_POLICY, help=options.POLICY_HELP
    )
    s.add_argument(
        "--prefetch",
        type=_predictors,
        default="off",
        help="off, or predictors joined by +: temporal, transition, and gate "
        "where the trace recorded its nominations (asyncmoe.record(model, gate=True))",
    )
    s.add_argument(
        "--budget",
        type=options.at_least(1),
        default=None,
        help=f"experts prefetched per layer per token, with --prefetch; None: {PREFETCH_BUDGET}, "
        "as asyncmoe.Prefetch",
    )
    s.add_argument(
        "--expert-bytes",
        type=options.at_least(0),
        default=None,
        help="bytes of one expert, for bytes per token and a --cache budget; None: what the trace "
        "recorded (the "
        "recorded model's experts, in their stored format), else 0",
    )
    s.add_argument(
        "--pace",
        type=options.at_least(1.0, float),
        nargs=2,
        metavar=("COPY_US", "WINDOW_US"),
        default=None,
        help="an expert's copy and the compute a prefetch hides behind, in us, as asyncmoe.stats "
        "prints them on the "
        "GPU: the prefetch gate then decides as it does there (with --prefetch); default: "
        "unmeasured, as on the CPU",
    )
    s.add_argument(
        "--hybrid",
        type=options.at_least(0.001, float),
        nargs=4,
        metavar=("ROUND_TRIP_US", "PER_EXPERT_US", "PER_PAIR_US", "COPY_US"),
        default=None,
        help="split each call's misses between the link and the CPU by these costs, in us "
        "(asyncmoe.compile prints a model's in ns, hybrid=True); default: GPU-only",
    )
    s.add_argument(
        "--batch",
        type=options.at_least(1),
        default=1,
        help="tokens a decode step: consecutive tokens of the trace, each call of a step as a "
        "captured step serves it (every wave its shapes allow; with --hybrid, the CPU taking any "
        "excess over the slots)",
    )
    s.add_argument("--json", action="store_true", help="print the totals as one JSON object")
    s.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the simulator's step through torch.compile: a fixed wait (seconds a layer) for "
        "faster tokens; auto: on for traces long enough to win the wait back",
    )


def check(args) -> str | None:
    """Options that do nothing with --prefetch off are refused, not ignored."""
    idle = [
        name
        for name, value in (("--pace", args.pace), ("--budget", args.budget))
        if value is not None
    ]
    if not args.prefetch and idle:
        return (
            f"{' and '.join(idle)} {'set' if len(idle) > 1 else 'sets'} how the prefetch copies, "
            "and --prefetch is "
            "off: choose predictors (--prefetch gate, temporal or transition, joined by +) or "
            "leave "
            f"{' and '.join(idle)} out"
        )
    return None


def _simulated_cache(text: str) -> int | str:
    """`simulate --cache`: slots or a budget. Not auto: it sizes the cache from the free memory of
    the GPU a model runs on, and the simulator runs on the CPU with no model and no GPU."""
    if text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError(
            "auto sizes the cache from the free memory of the GPU a model runs on, and simulate "
            "runs on the CPU "
            "without one: give slots per MoE layer (16) or the GPU-memory budget you mean (6GiB)"
        )
    return options.slots_or_budget(text, "")


def _predictors(text: str) -> tuple[str, ...]:
    """`simulate --prefetch`: off, or simulable predictors joined by +."""
    if text.strip() == "off":
        return ()
    names = tuple(dict.fromkeys(p.strip() for p in text.split("+")))
    unknown = [n for n in names if n not in PREDICTORS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected off, or predictors joined by + (of {', '.join(PREDICTORS)}), got {text!r}"
        )
    return names


def _trace_file(text: str) -> str:
    if not pathlib.Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"no trace file at {text} (an .npz written by `asyncmoe generate --record-trace`)"
        )
    return text


@contextlib.contextmanager
def progress(compiling: bool, stream=None):
    """`simulate`'s progress callback: tokens done, rewritten in place on a terminal, a line now and
    then in a log, and always the last. While torch.compile works on the first token, a thread says
    how long it has been."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    every = PROGRESS_EVERY_S[tty]
    start = last = time.monotonic()
    first = threading.Event()
    width = 0  # of the line on a terminal, which the next one overwrites

    def say(line: str, end: bool = False) -> None:
        nonlocal width
        if tty:
            stream.write(f"\r{line:<{width}}" + ("\n" if end else ""))
            width = len(line)
        else:
            stream.write(line + "\n")
        stream.flush()

    def report(done: int, total: int) -> None:
        nonlocal last
        first.set()
        now = time.monotonic()
        if done < total and now - last < every:
            return
        last = now
        say(
            f"simulated {done}/{total} tokens ({done / total:.0%}, {now - start:.0f} s)",
            end=done == total,
        )

    def compiling_for() -> None:
        while not first.wait(every):
            say(f"compiling ({time.monotonic() - start:.0f} s)")

    waiting = threading.Thread(target=compiling_for, daemon=True) if compiling else None
    if waiting:
        waiting.start()
    try:
        yield report
    finally:
        first.set()
        if waiting:
            waiting.join()


def run(args) -> int:
    if "torch" not in sys.modules:  # seconds, with nothing said yet
        print("asyncmoe simulate: loading torch", file=sys.stderr, flush=True)
    import torch

    from ..trace import Trace
    from ..trace import simulate as simulator

    torch.set_num_threads(1)
    trace = Trace.load(args.trace)
    expert_bytes = (trace.expert_bytes or 0) if args.expert_bytes is None else args.expert_bytes
    slots, sized = (
        (args.cache, None)
        if isinstance(args.cache, int)
        else simulator.budget_slots(trace, args.cache, expert_bytes)
    )
    budget = PREFETCH_BUDGET if args.budget is None else args.budget
    simulator.check(trace, slots, args.prefetch, budget, args.pace, args.hybrid, args.batch)
    compiled = {"on": True, "off": False, "auto": simulator.compiles(trace)}[args.compile]
    say = [
        f"asyncmoe simulate: {args.trace}: {trace.tokens} tokens x {trace.layers} MoE layers, "
        f"top-{trace.top_k} of "
        f"{trace.num_experts} experts; cache {slots} slots per layer, policy {args.policy}, "
        f"prefetch {'+'.join(args.prefetch) or 'off'}"
        + (", misses split with the CPU" if args.hybrid else "")
        + (f", {args.batch} tokens a step" if args.batch > 1 else "")
    ]
    if sized:
        say.append(sized)
    if compiled:
        seconds = simulator.compile_seconds(trace, args.prefetch)
        say.append(
            f"compiling the simulator step (about {seconds:.0f} s); --compile off skips the wait, "
            "each token then runs slower"
        )
    print("\n".join(say), file=sys.stderr, flush=True)
    with progress(compiling=compiled) as report:
        result = simulator.simulate(
            trace,
            slots,
            args.policy,
            args.prefetch,
            budget,
            expert_bytes,
            compiled,
            args.pace,
            progress=report,
            hybrid_us=args.hybrid,
            batch=args.batch,
        )
    print(result.to_json() if args.json else result)
    return 0
