"""`asyncmoe generate`: any local transformers MoE checkpoint with a tokenizer, loaded with asyncmoe, a
generation streamed, its stats printed; optionally its routing recorded to a trace."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import tempfile

from ..choices import DEFAULT_POLICY
from . import options
from .model import check_config, encode, said_once, stream

HELP = "generate from a local MoE checkpoint (config, safetensors, tokenizer)"
# any one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def add_options(g) -> None:
    required = dict(required=True, default=argparse.SUPPRESS)  # no "(default: None)" in the help
    g.add_argument("--model", type=_checkpoint, **required, help="local checkpoint directory")
    g.add_argument("--prompt", type=options.prompt, **required, help="text the model continues")
    g.add_argument("--cache", type=options.cache, default=16, help=options.CACHE_HELP)
    g.add_argument(
        "--quantize",
        default="none",
        choices=list(options.QUANTIZE),
        help=options.QUANTIZE_HELP + "; dequantize: an fp8 checkpoint's experts in --dtype",
    )
    g.add_argument(
        "--tokens",
        type=options.at_least(1),
        default=64,
        help="new tokens (fewer where the model emits its EOS token)",
    )
    g.add_argument(
        "--policy", type=options.policy, default=DEFAULT_POLICY, help=options.POLICY_HELP
    )
    g.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weights' dtype",
    )
    g.add_argument("--device", type=options.device, default="auto", help=options.DEVICE_HELP)
    g.add_argument(
        "--prefetch", default="auto", choices=list(options.PREFETCH), help=options.PREFETCH_HELP
    )
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
        type=options.at_least(0),
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


check = options.check_load


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


def _top_p(text: str) -> float:
    value = options.at_least(0.0, float)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: off), got {text}")
    return value


def sampling(args) -> tuple[dict, str]:
    """`Decoder.generate`'s sampling keywords and a few words on them. Any of --temperature,
    --top-p, --top-k and --seed samples, at temperature 1 where --temperature is left out
    (transformers' default under do_sample); none of them decodes greedily. A sampling option that
    silently did nothing would be the surprise."""
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


def run(args) -> int:
    with said_once():
        return _generate(args)


def _generate(args) -> int:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    import asyncmoe

    # the config and the tokenizer first: what the options ask of the model fails before its weights
    # load; local files only, never the hub
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    ids = encode(tokenizer, args.prompt)
    check_config(config, args.cache, args.tokens, ids.shape[1])
    keywords, how = sampling(args)
    model = asyncmoe.from_pretrained(
        args.model,
        cache=args.cache,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        policy=args.policy,
        prefetch=options.PREFETCH[args.prefetch],
        quantize=options.QUANTIZE[args.quantize],
        local_files_only=True,
    )
    # recording hooks run in eager forwards only, so a recorded run decodes without the CUDA graph
    graph = None if not args.record_trace else False
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=ids.shape[1] + args.tokens, graph=graph)
    show = stream(tokenizer, ids)
    # with the gate's nominations: `asyncmoe simulate --prefetch gate` and a replay's gate predictor
    # need them
    recording = asyncmoe.record(model, gate=True) if args.record_trace else contextlib.nullcontext()
    with recording as recorder:
        if recorder:
            recorder.new_sequence()
        out = dec.generate(
            ids, args.tokens, eos_token_id=tokenizer.eos_token_id, callback=show, **keywords
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
