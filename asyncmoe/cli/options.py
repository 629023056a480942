"""The options more than one command takes: argparse types that check a value where it is parsed, with
one-line errors, and their help. Nothing here imports torch at import time: --help answers before it
loads."""

from __future__ import annotations

import argparse

from ..choices import POLICIES

# --prefetch -> from_pretrained(prefetch=...)
PREFETCH = {"auto": None, "on": True, "off": False}
# --quantize -> from_pretrained(quantize=...)
QUANTIZE = {
    "none": None,
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "int4": "int4",
    "dequantize": "dequantize",
}

CACHE_HELP = (
    "GPU slots per MoE layer, a GPU-memory budget for all layers' slots (6GiB, 6GB, 512MiB), "
    "or auto (the slots "
    "that fit in the GPU memory free once the other weights are there)"
)
QUANTIZE_HELP = (
    "store the experts as block-wise fp8 (half of bf16's bytes per copy), mxfp4 or int4 (about "
    "a quarter); "
    "none: the checkpoint's own format (an fp8 or mxfp4 checkpoint's experts stay as stored)"
)
POLICY_HELP = f"eviction policy: {', '.join(POLICIES)} (docs/routing.md says how each does)"
DEVICE_HELP = "where the model runs: auto (cuda when available, else cpu), cpu, cuda or cuda:N"
PREFETCH_HELP = (
    "copy the next layer's predicted experts while a layer computes; auto: on where the model "
    "runs on a "
    "CUDA device, off on the CPU"
)


class Parser(argparse.ArgumentParser):
    """argparse with every error on one line, `asyncmoe: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"asyncmoe: error: {message}; see `{self.prog} --help`\n")


def at_least(low: int | float, kind=int):
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


def cache(text: str) -> int | str:
    """Slots per MoE layer (an int >= 1), a GPU-memory budget for all layers' slots ("6GiB",
    "512MiB"), or auto (the slots that fit in free GPU memory): the forms
    `asyncmoe.from_pretrained(cache=...)` takes."""
    if text.strip().lower() == "auto":
        return "auto"
    return slots_or_budget(text, ", or auto")


def slots_or_budget(text: str, auto: str) -> int | str:
    if text.strip().lstrip("+-").isdigit():
        return at_least(1)(text)
    from ..settings import parse_budget

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


def policy(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; choose one of {', '.join(POLICIES)}"
        )
    return text


def prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty: the model continues the prompt")
    return text


def device(text: str):
    """A torch.device: auto, cpu, cuda or cuda:N."""
    import torch

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


def check_load(args) -> str | None:
    """`demo` and `generate`: --cache auto sizes the slots from free GPU memory, which a CPU run
    does not have."""
    if args.cache == "auto" and args.device.type != "cuda":
        return (
            "--cache auto sizes the slots from the free memory of the GPU the model runs on, and "
            "it runs on "
            f"{args.device}: give slots per MoE layer (--cache 16) or a budget (--cache 6GiB)"
        )
    return None
