"""`asyncmoe demo`: the embedded model with a small expert cache, streamed, then timed next to the same
model fully resident (and, where it prefetches, next to itself without prefetch), its tokens checked
against the resident model's."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from ..choices import DEFAULT_POLICY
from . import options
from .model import check_config, encode, said_once, stream

HELP = "run a MoE model with a small expert cache next to the fully resident model"
PROMPT = "def fibonacci(n):\n"
LABEL = 44  # the table's first column


def add_options(p) -> None:
    p.add_argument(
        "--cache", type=options.cache, default=16, help=options.CACHE_HELP + " (of 64 experts)"
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "fp8", "mxfp4", "int4"],
        help=options.QUANTIZE_HELP,
    )
    p.add_argument(
        "--policy", type=options.policy, default=DEFAULT_POLICY, help=options.POLICY_HELP
    )
    p.add_argument("--tokens", type=options.at_least(1), default=64, help="tokens to generate")
    p.add_argument(
        "--prompt",
        type=options.prompt,
        default=PROMPT,
        help="text the model continues (default: %(default)r)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bfloat16 on the GPU, float32 on the CPU (where tokens must equal the resident "
        "model's)",
    )
    p.add_argument("--device", type=options.device, default="auto", help=options.DEVICE_HELP)
    p.add_argument(
        "--prefetch", default="auto", choices=list(options.PREFETCH), help=options.PREFETCH_HELP
    )


check = options.check_load


def run(args) -> int:
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    # a bar for each of three loads, each done in a second, would bury the output
    logging.disable_progress_bar()
    try:
        with said_once():
            return _demo(args)
    finally:
        if bars:
            logging.enable_progress_bar()


@dataclass(frozen=True)
class Models:
    """What `_load` gives the demo: the prompt, the resident model and the cached one."""

    tokenizer: object
    ids: object  # [1, L] on the device
    resident: object
    cached: object
    experts: int
    slots: int  # the cached model's, per MoE layer (every expert where all are resident)
    all_resident: bool  # the slots hold every expert: nothing to cache, prefetch or count
    on: bool  # the cached model's prefetch setting, auto resolved
    load: dict  # from_pretrained's keywords but prefetch, for the comparison without it


def _demo(args) -> int:
    import torch

    # bf16 on the GPU: transformers' fp32 grouped_mm copies from the host, so the resident fp32
    # model cannot be captured in a CUDA graph (docs/decisions.md#demo-dtype)
    auto = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
    m = _load(args, dtype)
    fmt = f", {args.quantize} experts" if args.quantize != "none" else ""
    print(f"\n--- asyncmoe, {m.slots}/{m.experts} experts cached{fmt}, greedy, streamed ---")
    _stream(m, args.tokens)
    print("\n---\n")
    base, runs, graphed = _time(m, args.tokens, f"asyncmoe {m.slots}/{m.experts}{fmt}")
    mode = f", {'CUDA graph' if graphed else 'eager'}" if args.device.type == "cuda" else ""
    recall = m.on and not m.all_resident  # a prefetch recall column only where something prefetches
    for line in _table(base, runs, f"greedy, {args.tokens} tokens{mode}", recall, m.experts):
        print(line)
    got, stats = runs[0][1], runs[0][2]
    exact = dtype == torch.float32 and args.quantize == "none"
    code = _agreement(got, base, m.ids.shape[1], exact, args.quantize, dtype)
    if stats.layers:
        print(f"\n{stats}")
    return code


def _load(args, dtype) -> Models:
    """The tokenizer, the prompt, the resident model and the cached one, each line it prints saying
    what was loaded and how."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import asyncmoe

    device = args.device
    path = asyncmoe.demo_model_path()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"asyncmoe demo on {device} ({where}), {dtype}")
    print(
        f"model: the embedded demo model ({path}): OLMoE routing shape, 64 experts top-8, "
        "trained on Python's stdlib"
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = encode(tokenizer, args.prompt).to(device)
    check_config(AutoConfig.from_pretrained(path), args.cache, args.tokens, ids.shape[1])
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    experts = resident.config.num_experts
    prefetch = options.PREFETCH[args.prefetch]
    on = prefetch if prefetch is not None else device.type == "cuda"  # what asyncmoe's auto picks
    load = dict(
        cache=args.cache,
        dtype=dtype,
        device=device,
        policy=args.policy,
        quantize=options.QUANTIZE[args.quantize],
    )
    cached = asyncmoe.from_pretrained(path, **load, prefetch=prefetch)
    layers = asyncmoe.stats(cached).layers
    if not layers:
        print(
            f"cache={args.cache} holds all {experts} experts: every MoE layer keeps them on "
            f"{device}, "
            "so asyncmoe has nothing to cache, prefetch or count"
        )
    else:
        print(_prefetch_note(args.prefetch, on, device))
    slots = layers[0].slots if layers else experts
    return Models(tokenizer, ids, resident, cached, experts, slots, not layers, on, load)


def _prefetch_note(choice: str, on: bool, device) -> str:
    """One line: whether the demo prefetches, and why."""
    if choice == "auto" and on:
        return (
            "prefetch: on (a CUDA side stream copies the next layer's predicted experts while this "
            "one computes; "
            "--prefetch off to compare)"
        )
    if choice == "auto":
        return (
            "prefetch: off (on the CPU nothing runs beside the copies, so prefetch can only cost; "
            "--prefetch on to try it)"
        )
    if on and device.type != "cuda":
        return "prefetch: on (--prefetch on; on the CPU its copies run in line with the compute, not beside it)"
    return f"prefetch: {choice} (--prefetch {choice})"


def _stream(m: Models, tokens: int) -> None:
    """The cached model's greedy tokens, printed as they come (one host sync a token)."""
    import asyncmoe

    show = stream(m.tokenizer, m.ids)
    decoder = asyncmoe.Decoder(m.cached, batch_size=1, max_length=m.ids.shape[1] + tokens)
    decoder.generate(m.ids, tokens, callback=show)


def _time(m: Models, tokens: int, label: str):
    """The resident model's timed run, and the cached model's (name, run, stats, prefetching), then,
    where it prefetches, the same cache's without prefetch: what prefetch gains or costs; and
    whether the cached model decoded through a CUDA graph."""
    import asyncmoe

    base, _ = _timed(m.resident, m.ids, tokens, cached=False)
    got, graphed = _timed(m.cached, m.ids, tokens, cached=True)
    name = label if m.all_resident else f"{label}, {'prefetch' if m.on else 'no prefetch'}"
    runs = [(name, got, asyncmoe.stats(m.cached), m.on)]
    if m.on and not m.all_resident:
        # its load line would repeat the first one's
        with contextlib.redirect_stdout(io.StringIO()):
            plain = asyncmoe.from_pretrained(asyncmoe.demo_model_path(), **m.load, prefetch=False)
        bare, _ = _timed(plain, m.ids, tokens, cached=True)
        runs.append((f"{label}, no prefetch", bare, asyncmoe.stats(plain), False))
    return base, runs, graphed


def _timed(model, ids, new_tokens: int, cached: bool, repeats: int = 3):
    """Median-speed greedy generation (after a warm-up that also captures the CUDA graph on a
    GPU)."""
    import asyncmoe

    dec = asyncmoe.Decoder(
        model, batch_size=ids.shape[0], max_length=ids.shape[1] + max(new_tokens, 2)
    )
    dec.generate(ids, 2)
    runs = []
    for _ in range(repeats):
        if cached:
            asyncmoe.stats(model, reset=True)  # the stats then describe the last run
        runs.append(dec.generate(ids, new_tokens))
    return sorted(runs, key=lambda r: r.decode_ms_per_token)[repeats // 2], dec.graphed


def _table(base, runs, title: str, recall: bool, experts: int) -> list[str]:
    """The timed runs beside the resident model's: speed, hit rate, prefetch recall (a column only
    where something prefetches) and the bytes each token moved."""

    def line(name, tokens_per_s, ms, hit, pf, moved) -> str:
        cells = f"{name:<{LABEL}} {tokens_per_s:>9} {ms:>9} {hit:>9}"
        return cells + (f" {pf:>16}" if recall else "") + f" {moved:>15}"

    def speed(run) -> tuple[str, str]:
        return f"{run.tokens_per_s:.1f}", f"{run.decode_ms_per_token:.2f}"

    lines = [line(title, "tokens/s", "ms/token", "hit rate", "prefetch recall", "MB moved/token")]
    resident = f"transformers, fully resident ({experts}/{experts})"
    lines.append(line(resident, *speed(base), "-", "-", "-"))
    for name, run, stats, prefetching in runs:
        t = stats.totals
        counted = bool(stats.layers)  # a fully resident model counts nothing
        hit = f"{t['hit_rate']:.1%}" if counted else "-"
        pf = f"{t['prefetch_recall']:.1%}" if counted and prefetching else "-"
        # the last timed run, prefill included
        moved = f"{t['bytes_h2d'] / run.new_tokens / 1e6:.2f}" if counted else "-"
        lines.append(line(name, *speed(run), hit, pf, moved))
    if recall:
        lines.append(
            "prefetch recall: the share of routed experts found resident because a prefetch put "
            "them there"
        )
    return lines


def _agreement(got, base, prompt: int, exact: bool, quantize: str, dtype) -> int:
    """Prints how many of the cached model's tokens equal the resident model's; 1 where they must
    all agree (float32, unquantized) and do not, else 0."""
    agree = (got.tokens == base.tokens).cumprod(-1).sum().item() - prompt
    why = (
        f"{quantize} experts are rounded weights, so their tokens may part from the "
        "full-precision model's"
        if quantize != "none"
        else f"{dtype}: the two models' logits are close, not bit-equal, so a near-tie "
        "can go either way; in float32 they must all agree"
    )
    print(
        f"tokens equal to the resident model's: the first {agree} of "
        f"{got.new_tokens}" + ("" if exact else f" ({why})")
    )
    return 0 if agree == got.new_tokens or not exact else 1
