"""The `asyncmoe` command: `demo`, `generate` and `simulate` (`asyncmoe COMMAND --help`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import pathlib
import sys
import tempfile
import threading
import time
import warnings

import torch

from . import __version__
from .cache.policies import DEFAULT_POLICY, POLICIES
from .prefetch import Prefetch

PROMPT = "def fibonacci(n):\n"
# any one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PREFETCH = {"auto": None, "on": True, "off": False}  # --prefetch -> from_pretrained(prefetch=...)
# --quantize -> from_pretrained(quantize=...)
QUANTIZE = {
    "none": None,
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "int4": "int4",
    "dequantize": "dequantize",
}
# what asyncmoe raises for bad input, with a message written for the user: one line, no traceback
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, MemoryError)
PROGRESS_EVERY_S = {True: 0.2, False: 10.0}  # simulate's progress: on a terminal, in a log


class Parser(argparse.ArgumentParser):
    """argparse with every error on one line, `asyncmoe: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"asyncmoe: error: {message}; see `{self.prog} --help`\n")


def _at_least(low: int | float, kind=int):
    """An argparse type: a number of `kind` that is >= `low`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {low}, got {text!r}") from None
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


def _cache(text: str) -> int | str:
    """Slots per MoE layer (an int >= 1), a GPU-memory budget for all layers' slots ("6GiB",
    "512MiB"), or auto (the slots that fit in free GPU memory): the forms
    `asyncmoe.from_pretrained(cache=...)` takes."""
    if text.strip().lower() == "auto":
        return "auto"
    return _slots_or_budget(text, ", or auto")


def _simulated_cache(text: str) -> int | str:
    """`simulate --cache`: slots or a budget. Not auto: it sizes the cache from the free memory of
    the GPU a model runs on, and the simulator runs on the CPU with no model and no GPU."""
    if text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError(
            "auto sizes the cache from the free memory of the GPU a model runs on, and simulate "
            "runs on the CPU "
            "without one: give slots per MoE layer (16) or the GPU-memory budget you mean (6GiB)"
        )
    return _slots_or_budget(text, "")


def _slots_or_budget(text: str, auto: str) -> int | str:
    if text.strip().lstrip("+-").isdigit():
        return _at_least(1)(text)
    from .settings import parse_budget

    try:
        nbytes = parse_budget(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected slots per MoE layer (an int) or a GPU-memory budget such as 6GiB, 6GB or "
            f"512MiB{auto}; "
            f"got {text!r}"
        ) from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"a budget must be more than 0 bytes, got {text!r}")
    return text


def _policy(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; choose one of {', '.join(POLICIES)}"
        )
    return text


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0, got {text!r}; leave every sampling option out for "
            "greedy decoding"
        )
    return value


def _predictors(text: str) -> tuple[str, ...]:
    """`simulate --prefetch`: off, or simulable predictors joined by +."""
    from .trace.simulate import SIMULABLE

    if text.strip() == "off":
        return ()
    names = tuple(dict.fromkeys(p.strip() for p in text.split("+")))
    unknown = [n for n in names if n not in SIMULABLE]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected off, or predictors joined by + (of {', '.join(SIMULABLE)}), got {text!r}"
        )
    return names


def _writable(text: str) -> str:
    """A file to write at the end of a run, checked before the run: a missing or read-only folder
    would otherwise fail only after the whole generation."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is a folder; give the path of a file in it, such as {path / 'run.npz'}"
        )
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"no folder {folder} to write {path.name} into: create it first (mkdir -p {folder}) or "
            "give another path"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"{text} exists and cannot be overwritten: give another path"
        )
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write into folder {folder} ({e.strerror}): give a path in a folder you can "
            "write"
        ) from None
    return text


def _top_p(text: str) -> float:
    value = _at_least(0.0, float)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: off), got {text}")
    return value


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty: the model continues the prompt")
    return text


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device; use cpu")
    return device


def _checkpoint(text: str) -> str:
    """A local checkpoint directory with a tokenizer, checked before anything loads: transformers
    would take a missing directory for a hub id, and a missing tokenizer for one that encodes
    nothing."""
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"no checkpoint directory at {text} (a local directory with config.json, *.safetensors "
            "and a tokenizer)"
        )
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text} is not a transformers checkpoint: it has no config.json"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise argparse.ArgumentTypeError(
            f"{text} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): generate needs one to "
            "encode --prompt"
        )
    return text


def _trace_file(text: str) -> str:
    if not pathlib.Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"no trace file at {text} (an .npz written by `asyncmoe generate --record-trace`)"
        )
    return text


def _check_config(config, cache: int | str, tokens: int | None = None, prompt: int = 0) -> None:
    """What the options ask of the model, checked from its config before its weights load: slots
    below its top_k are an error; a prompt and `tokens` past its positions a warning, as
    transformers' generate gives (the Decoder then says it again once the model has loaded;
    `_said_once` keeps that quiet)."""
    from .integrations.transformers import top_k_of

    text = config.get_text_config()
    k = top_k_of(text)
    if isinstance(cache, int) and k is not None and cache < k:
        raise ValueError(
            f"--cache {cache} is below the model's top_k={k}: every token needs its {k} experts "
            "resident at once; "
            f"use --cache {k} or more"
        )
    positions = getattr(text, "max_position_embeddings", None)
    if tokens is not None and positions is not None and prompt + tokens > positions:
        fits = (
            f"--tokens {positions - prompt} stays within them"
            if prompt < positions
            else "shorten the prompt"
        )
        print(
            f"asyncmoe: warning: the prompt's {prompt} tokens and --tokens {tokens} run to "
            f"position {prompt + tokens}, "
            f"past the model's {positions} (config.max_position_embeddings): depending on the "
            "model, expect "
            f"exceptions, degenerate text or nothing at all past them; {fits}",
            file=sys.stderr,
        )


@contextlib.contextmanager
def _said_once():
    """The warning about positions past max_position_embeddings, already printed by `_check_config`,
    not again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*max_position_embeddings")
        yield


def _sampling(args) -> tuple[dict, str]:
    """`Decoder.generate`'s sampling keywords and a few words on them. Any of --temperature,
    --top-p, --top-k and
    --seed samples, at temperature 1 where --temperature is left out (transformers' default under
    do_sample);
    none of them decodes greedily. A sampling option that silently did nothing would be the
    surprise."""
    if all(getattr(args, name) is None for name in ("temperature", "top_p", "top_k", "seed")):
        return dict(do_sample=False), "greedy"
    keywords = dict(
        do_sample=True,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        top_k=args.top_k or 0,
        seed=args.seed,
    )
    words = [f"sampled at temperature {keywords['temperature']:g}"]
    words += [f"top-p {args.top_p:g}"] if args.top_p is not None else []
    words += [f"top-k {args.top_k}"] if args.top_k else []
    words += [f"seed {args.seed}"] if args.seed is not None else []
    return keywords, ", ".join(words)


def _check_load(args) -> str | None:
    """`demo` and `generate`: --cache auto sizes the slots from free GPU memory, which a CPU run
    does not have."""
    if args.cache == "auto" and args.device.type != "cuda":
        return (
            "--cache auto sizes the slots from the free memory of the GPU the model runs on, and "
            "it runs on "
            f"{args.device}: give slots per MoE layer (--cache 16) or a budget (--cache 6GiB)"
        )
    return None


def _check_simulate(args) -> str | None:
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


@contextlib.contextmanager
def _progress(compiling: bool, stream=None):
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


def _encode(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, L]
    if ids.shape[1] == 0:
        raise ValueError(
            f"--prompt {prompt!r} encodes to no tokens: give the model some text to continue"
        )
    return ids


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


def _prefetch_note(choice: str, on: bool, device: torch.device) -> str:
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


def demo(args) -> int:
    """The embedded model with a small expert cache, streamed, then timed next to the same model
    fully resident (and, where it prefetches, next to itself without prefetch)."""
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    # a bar for each of three loads, each done in a second, would bury the output
    logging.disable_progress_bar()
    try:
        with _said_once():
            return _demo(args)
    finally:
        if bars:
            logging.enable_progress_bar()


def _demo(args) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import asyncmoe

    device = args.device
    # bf16 on the GPU: transformers' fp32 grouped_mm copies from the host, so the resident fp32
    # model cannot be captured in a CUDA graph (docs/decisions.md#demo-dtype)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
    path = asyncmoe.demo_model_path()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"asyncmoe demo on {device} ({where}), {dtype}")
    print(
        f"model: the embedded demo model ({path}): OLMoE routing shape, 64 experts top-8, "
        "trained on Python's stdlib"
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = _encode(tokenizer, args.prompt).to(device)
    _check_config(AutoConfig.from_pretrained(path), args.cache, args.tokens, ids.shape[1])
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    experts = resident.config.num_experts
    prefetch = PREFETCH[args.prefetch]
    on = prefetch if prefetch is not None else device.type == "cuda"  # what asyncmoe's auto picks
    load = dict(
        cache=args.cache,
        dtype=dtype,
        device=device,
        policy=args.policy,
        quantize=QUANTIZE[args.quantize],
    )
    cached = asyncmoe.from_pretrained(path, **load, prefetch=prefetch)
    layers = asyncmoe.stats(cached).layers
    slots = layers[0].slots if layers else experts
    all_resident = not layers
    if all_resident:
        print(
            f"cache={args.cache} holds all {experts} experts: every MoE layer keeps them on "
            f"{device}, "
            "so asyncmoe has nothing to cache, prefetch or count"
        )
    else:
        print(_prefetch_note(args.prefetch, on, device))
    fmt = f", {args.quantize} experts" if args.quantize != "none" else ""

    print(f"\n--- asyncmoe, {slots}/{experts} experts cached{fmt}, greedy, streamed ---")
    text = ids[0].tolist()

    def show(tokens: list[int]) -> None:
        before = tokenizer.decode(text)
        text.append(tokens[0])
        print(tokenizer.decode(text)[len(before) :], end="", flush=True)

    print(tokenizer.decode(text), end="", flush=True)
    stream = asyncmoe.Decoder(cached, batch_size=1, max_length=ids.shape[1] + args.tokens)
    stream.generate(ids, args.tokens, callback=show)
    print("\n---\n")

    base, _ = _timed(resident, ids, args.tokens, cached=False)
    got, graphed = _timed(cached, ids, args.tokens, cached=True)
    s = asyncmoe.stats(cached)
    label = f"asyncmoe {slots}/{experts}{fmt}"
    runs = [
        (label if all_resident else f"{label}, {'prefetch' if on else 'no prefetch'}", got, s, on)
    ]
    if on and not all_resident:  # the same cache without prefetch: what prefetch gains or costs
        # its load line would repeat the first one's
        with contextlib.redirect_stdout(io.StringIO()):
            plain = asyncmoe.from_pretrained(path, **load, prefetch=False)
        bare, _ = _timed(plain, ids, args.tokens, cached=True)
        runs.append((f"{label}, no prefetch", bare, asyncmoe.stats(plain), False))

    recall = on and not all_resident  # a prefetch recall column only where something prefetches
    # the CPU decodes eagerly
    mode = f", {'CUDA graph' if graphed else 'eager'}" if device.type == "cuda" else ""
    print(
        f"{f'greedy, {args.tokens} tokens{mode}':<44} {'tokens/s':>9} {'ms/token':>9} "
        f"{'hit rate':>9}"
        + (f" {'prefetch recall':>16}" if recall else "")
        + f" {'MB moved/token':>15}"
    )
    resident_row = f"transformers, fully resident ({experts}/{experts})"
    print(
        f"{resident_row:<44} {base.tokens_per_s:>9.1f} {base.decode_ms_per_token:>9.2f} "
        f"{'-':>9}" + (f" {'-':>16}" if recall else "") + f" {'-':>15}"
    )
    for name, run, stats, prefetching in runs:
        t = stats.totals
        counted = bool(stats.layers)  # a fully resident model counts nothing
        hit = f"{t['hit_rate']:.1%}" if counted else "-"
        pf = f"{t['prefetch_recall']:.1%}" if counted and prefetching else "-"
        # the last timed run, prefill included
        moved = f"{t['bytes_h2d'] / run.new_tokens / 1e6:.2f}" if counted else "-"
        print(
            f"{name:<44} {run.tokens_per_s:>9.1f} {run.decode_ms_per_token:>9.2f} {hit:>9}"
            + (f" {pf:>16}" if recall else "")
            + f" {moved:>15}"
        )
    if recall:
        print(
            "prefetch recall: the share of routed experts found resident because a prefetch put "
            "them there"
        )
    agree = (got.tokens == base.tokens).cumprod(-1).sum().item() - ids.shape[1]
    # the same weights and arithmetic as the resident model
    exact = dtype == torch.float32 and args.quantize == "none"
    why = (
        f"{args.quantize} experts are rounded weights, so their tokens may part from the "
        "full-precision model's"
        if args.quantize != "none"
        else f"{dtype}: the two models' logits are close, not bit-equal, so a near-tie "
        "can go either way; in float32 they must all agree"
    )
    print(
        f"tokens equal to the resident model's: the first {agree} of "
        f"{got.new_tokens}" + ("" if exact else f" ({why})")
    )
    if s.layers:
        print(f"\n{s}")
    return 0 if agree == got.new_tokens or not exact else 1


def generate(args) -> int:
    """Any local transformers MoE checkpoint with a tokenizer: load with asyncmoe, stream a
    generation, print stats."""
    with _said_once():
        return _generate(args)


def _generate(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    import asyncmoe

    # the config and the tokenizer first: what the options ask of the model fails before its weights
    # load; local files only, never the hub
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    ids = _encode(tokenizer, args.prompt)
    _check_config(config, args.cache, args.tokens, ids.shape[1])
    sampling, how = _sampling(args)
    model = asyncmoe.from_pretrained(
        args.model,
        cache=args.cache,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        policy=args.policy,
        prefetch=PREFETCH[args.prefetch],
        quantize=QUANTIZE[args.quantize],
        local_files_only=True,
    )
    # recording hooks run in eager forwards only, so a recorded run decodes without the CUDA graph
    graph = None if not args.record_trace else False
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=ids.shape[1] + args.tokens, graph=graph)
    text = ids[0].tolist()

    # stream: print what the new token adds to the decoded text
    def show(tokens: list[int]) -> None:
        before = tokenizer.decode(text)
        text.append(tokens[0])
        print(tokenizer.decode(text)[len(before) :], end="", flush=True)

    print(tokenizer.decode(text), end="", flush=True)
    # with the gate's nominations: `asyncmoe simulate --prefetch gate` and a replay's gate predictor
    # need them
    with (
        asyncmoe.record(model, gate=True)
        if args.record_trace
        else contextlib.nullcontext() as recorder
    ):
        if recorder:
            recorder.new_sequence()
        out = dec.generate(
            ids, args.tokens, eos_token_id=tokenizer.eos_token_id, callback=show, **sampling
        )
    print(
        f"\n\n{out.new_tokens} tokens, {how}, prefill {out.prefill_ms:.1f} ms, "
        f"decode {out.decode_ms_per_token:.2f} ms/token (streamed: one host sync per token)"
    )
    if recorder:
        trace = recorder.trace
        written = trace.save(args.record_trace)
        print(f"routing trace of {trace.tokens} tokens x {trace.layers} MoE layers -> {written}")
    print(asyncmoe.stats(model))
    return 0


def simulate(args) -> int:
    """Replay a routing trace through the runtime's cache and predictor code on the CPU, beside the
    Belady bound. It says what it simulates before the work starts (torch.compile's first step can
    take a while), then how far it has got, on stderr: stdout keeps the table or the JSON."""
    from .trace import Trace
    from .trace.simulate import budget_slots, check
    from .trace.simulate import simulate as run

    torch.set_num_threads(1)
    trace = Trace.load(args.trace)
    expert_bytes = (trace.expert_bytes or 0) if args.expert_bytes is None else args.expert_bytes
    slots, sized = (
        (args.cache, None)
        if isinstance(args.cache, int)
        else budget_slots(trace, args.cache, expert_bytes)
    )
    budget = Prefetch.budget if args.budget is None else args.budget
    check(trace, slots, args.prefetch, budget, args.pace)
    say = [
        f"asyncmoe simulate: {args.trace}: {trace.tokens} tokens x {trace.layers} MoE layers, "
        f"top-{trace.top_k} of "
        f"{trace.num_experts} experts; cache {slots} slots per layer, policy {args.policy}, "
        f"prefetch {'+'.join(args.prefetch) or 'off'}"
    ]
    if sized:
        say.append(sized)
    if not args.no_compile:
        say.append(
            "compiling the simulator's step with torch.compile before the first token "
            "(--no-compile skips the "
            "wait; each token then runs slower)"
        )
    print("\n".join(say), file=sys.stderr, flush=True)
    with _progress(compiling=not args.no_compile) as progress:
        result = run(
            trace,
            slots,
            args.policy,
            args.prefetch,
            budget,
            expert_bytes,
            not args.no_compile,
            args.pace,
            progress=progress,
        )
    print(result.to_json() if args.json else result)
    return 0


def _parser() -> Parser:
    parser = Parser(
        prog="asyncmoe", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"asyncmoe {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not just its message"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    parser.commands = {}  # name -> its parser, for the checks that need several options (`main`)

    def command(name: str, help: str) -> Parser:
        parser.commands[name] = sub.add_parser(
            name,
            help=help,
            description=help,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        return parser.commands[name]

    tokens = _at_least(1)
    cache = (
        "GPU slots per MoE layer, a GPU-memory budget for all layers' slots (6GiB, 6GB, 512MiB), "
        "or auto (the slots "
        "that fit in the GPU memory free once the other weights are there)"
    )
    quantize = (
        "store the experts as block-wise fp8 (half of bf16's bytes per copy), mxfp4 or int4 (about "
        "a quarter); "
        "none: the checkpoint's own format (an fp8 or mxfp4 checkpoint's experts stay as stored)"
    )
    policy = f"eviction policy: {', '.join(POLICIES)} (docs/routing.md says how each does)"
    device = "where the model runs: auto (cuda when available, else cpu), cpu, cuda or cuda:N"
    prefetch = (
        "copy the next layer's predicted experts while a layer computes; auto: on where the model "
        "runs on a "
        "CUDA device, off on the CPU"
    )

    p = command(
        "demo", "run a MoE model with a small expert cache next to the fully resident model"
    )
    p.add_argument("--cache", type=_cache, default=16, help=cache + " (of 64 experts)")
    p.add_argument(
        "--quantize", default="none", choices=["none", "fp8", "mxfp4", "int4"], help=quantize
    )
    p.add_argument("--policy", type=_policy, default=DEFAULT_POLICY, help=policy)
    p.add_argument("--tokens", type=tokens, default=64, help="tokens to generate")
    p.add_argument(
        "--prompt",
        type=_prompt,
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
    p.add_argument("--device", type=_device, default="auto", help=device)
    p.add_argument("--prefetch", default="auto", choices=list(PREFETCH), help=prefetch)
    p.set_defaults(fn=demo, check=_check_load)

    g = command("generate", "generate from a local MoE checkpoint (config, safetensors, tokenizer)")
    required = dict(required=True, default=argparse.SUPPRESS)  # no "(default: None)" in the help
    g.add_argument("--model", type=_checkpoint, **required, help="local checkpoint directory")
    g.add_argument("--prompt", type=_prompt, **required, help="text the model continues")
    g.add_argument("--cache", type=_cache, default=16, help=cache)
    g.add_argument(
        "--quantize",
        default="none",
        choices=list(QUANTIZE),
        help=quantize + "; dequantize: an fp8 checkpoint's experts in --dtype",
    )
    g.add_argument(
        "--tokens",
        type=tokens,
        default=64,
        help="new tokens (fewer where the model emits its EOS token)",
    )
    g.add_argument("--policy", type=_policy, default=DEFAULT_POLICY, help=policy)
    g.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weights' dtype",
    )
    g.add_argument("--device", type=_device, default="auto", help=device)
    g.add_argument("--prefetch", default="auto", choices=list(PREFETCH), help=prefetch)
    sampling = g.add_argument_group(
        "sampling",
        "any of these samples, at temperature 1 (transformers' default under do_sample) where "
        "--temperature is left "
        "out; without any of them generate decodes greedily",
    )
    sampling.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        help="sampling temperature, finite and > 0; None: 1 where another sampling option is "
        "given, else greedy",
    )
    sampling.add_argument(
        "--top-p",
        type=_top_p,
        default=None,
        help="nucleus sampling: the smallest set of tokens with this probability mass, in (0, 1]; "
        "None: off",
    )
    sampling.add_argument(
        "--top-k",
        type=_at_least(0),
        default=None,
        help="sample among the k likeliest tokens; None or 0: off",
    )
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed; None: unseeded")
    g.add_argument(
        "--record-trace",
        type=_writable,
        default=None,
        help="write the routing of this run, and what the gate predictor "
        "predicted, to this .npz trace, at exactly this path (eager decode); None: no trace",
    )
    g.set_defaults(fn=generate, check=_check_load)

    s = command(
        "simulate",
        "replay a routing trace through the cache on the CPU; print hit rates and the Belady bound",
    )
    s.add_argument("trace", type=_trace_file, help=".npz routing trace (docs/traces.md)")
    s.add_argument(
        "--cache",
        type=_simulated_cache,
        default=16,
        help="slots per MoE layer, or a GPU-memory budget for all layers' slots (6GiB, 6GB, "
        "512MiB) divided by the "
        "trace's expert bytes (--expert-bytes); not auto, which sizes from a GPU's free memory",
    )
    s.add_argument("--policy", type=_policy, default=DEFAULT_POLICY, help=policy)
    s.add_argument(
        "--prefetch",
        type=_predictors,
        default="off",
        help="off, or predictors joined by +: temporal, transition, and gate "
        "where the trace recorded its nominations (asyncmoe.record(model, gate=True))",
    )
    s.add_argument(
        "--budget",
        type=_at_least(1),
        default=None,
        help=f"experts prefetched per layer per token, with --prefetch; None: {Prefetch.budget}, "
        "as asyncmoe.Prefetch",
    )
    s.add_argument(
        "--expert-bytes",
        type=_at_least(0),
        default=None,
        help="bytes of one expert, for bytes per token and a --cache budget; None: what the trace "
        "recorded (the "
        "recorded model's experts, in their stored format), else 0",
    )
    s.add_argument(
        "--pace",
        type=_at_least(1.0, float),
        nargs=2,
        metavar=("COPY_US", "WINDOW_US"),
        default=None,
        help="an expert's copy and the compute a prefetch hides behind, in us, as asyncmoe.stats "
        "prints them on the "
        "GPU: the prefetch gate then decides as it does there (with --prefetch); default: "
        "unmeasured, as on the CPU",
    )
    s.add_argument("--json", action="store_true", help="print the totals as one JSON object")
    s.add_argument(
        "--no-compile",
        action="store_true",
        help="skip torch.compile (slower; no compile wait on short traces)",
    )
    s.set_defaults(fn=simulate, check=_check_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input ends with one line on stderr and exit status 2 (`--debug`: its
    traceback). Every option is checked before anything loads."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = args.check(args) if hasattr(args, "check") else None
    if problem:
        parser.commands[args.command].error(problem)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        # one line, whatever the message's layout
        message = " ".join(str(e).split()) or type(e).__name__
        parser.exit(2, f"asyncmoe: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
