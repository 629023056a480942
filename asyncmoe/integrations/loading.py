"""Loading a checkpoint straight into an asyncmoe model, its experts never on the GPU.

Checks first, from the files alone (config, shards, dtype, host memory from the safetensors
headers); then transformers loads the checkpoint onto the CPU with its own weight conversions, and
`install` moves each layer's experts into pinned host memory, freeing the CPU tensors as it goes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from ..cache.host import check_host_memory, human_bytes
from ..formats import QUANTIZE_METHODS, parse_quantize
from ..providers import CachedProvider, CpuProvider
from ..settings import Settings
from .install import SUPPORTED_DTYPES, install
from .quantized_checkpoint import checkpoint_format, load_quantized
from .transformers import PROVIDER, find_experts


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a local checkpoint; every shard its index lists must be there."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a transformers checkpoint: it has no config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} is missing {len(missing)} of the {len(shards)} shards its {index.name} "
                "lists "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): download the "
                "checkpoint again"
            )
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{path} has no *.safetensors weights (asyncmoe loads safetensors checkpoints)"
        )
    return files


def checkpoint_bytes(
    files: list[pathlib.Path], dtype: torch.dtype, keep_quantized: bool = False
) -> int:
    """Bytes the checkpoint's tensors take in `dtype` (fp8 and packed 4-bit ones as stored with
    `keep_quantized`), from the safetensors headers alone."""
    total = 0
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                for key in st.keys():
                    tensor = st.get_slice(key)
                    quantized = tensor.get_dtype().startswith("F8") or tensor.get_dtype() == "U8"
                    size = 1 if keep_quantized and quantized else dtype.itemsize
                    total += torch.Size(tensor.get_shape()).numel() * size
        except (OSError, SafetensorError) as e:
            raise ValueError(
                f"{f} is not a readable safetensors file ({e}): download or save it again"
            ) from None
    return total


def looks_local(path) -> bool:
    """Whether `path` names a directory on this machine rather than a hub id ("org/name"): a path
    object, or a string that is absolute, starts with `.` or `~`, or has more than one `/`."""
    if isinstance(path, os.PathLike):
        return True
    text = str(path)
    return (
        text.startswith(("/", ".", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
    )


SAFETENSORS_FLOATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}
DTYPES = "float32, bfloat16 or float16 (a torch.dtype or its name), or 'auto'"


def checkpoint_dtype(path: pathlib.Path) -> torch.dtype:
    """The dtype transformers' `dtype="auto"` loads a local checkpoint in: its config's, else its
    first floating-point tensor's."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    if name is not None:
        return getattr(torch, name)
    for f in checkpoint_files(path):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                dtype = SAFETENSORS_FLOATS.get(st.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    return torch.get_default_dtype()


def parse_dtype(dtype, local: pathlib.Path | None) -> torch.dtype | str:
    """`dtype` as transformers' `from_pretrained` takes it: a torch.dtype, its name ("bfloat16"), or
    "auto", the checkpoint's own, found here for a local checkpoint (`checkpoint_dtype`) and left
    to transformers for a hub id (`install` checks the experts it loads)."""
    given = dtype
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={given!r} is not a torch dtype: give {DTYPES}")
    elif dtype == "auto":
        if local is None:
            return "auto"
        dtype = checkpoint_dtype(local)
    if dtype not in SUPPORTED_DTYPES:
        found = f" (the checkpoint's {dtype})" if given == "auto" else ""
        raise TypeError(
            f"dtype={given!r}{found}: asyncmoe runs experts in "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}; give {DTYPES}"
        )
    return dtype


def load(path, settings: Settings, dtype: torch.dtype | str, **kwargs) -> nn.Module:
    """Load a checkpoint onto the CPU, then install asyncmoe on `device`: with transformers (its own
    weight conversions), or for fine-grained fp8 experts with asyncmoe's own reader
    (`fp8_checkpoint`), which keeps them fp8. The experts go from the loaded CPU tensors to pinned
    host memory layer by layer and never to the GPU."""
    quantize = settings.quantize
    if quantize not in (None, "dequantize", *QUANTIZE_METHODS):
        raise ValueError(
            f"quantize={quantize!r}: choose None (the checkpoint's own format), "
            f"{', '.join(map(repr, QUANTIZE_METHODS))} or 'dequantize'"
        )
    local = pathlib.Path(path).expanduser()
    if looks_local(path) and not local.exists():
        raise FileNotFoundError(f"no checkpoint directory at {str(path)!r}: check the path")
    dtype = parse_dtype(dtype, local if (local / "config.json").is_file() else None)
    stored = checkpoint_format(local) if (local / "config.json").is_file() else None
    if quantize == "dequantize" and stored is None:
        raise ValueError(
            f"quantize='dequantize' reads quantized checkpoints (fp8, mxfp4) in {dtype}; {path} is "
            "not "
            "one: leave quantize=None"
        )
    if stored is not None:
        if quantize not in (None, "dequantize", stored.name):
            raise ValueError(
                f"{path} stores its experts in {stored.name}: quantize={quantize!r} would "
                "re-quantize them; "
                f"leave quantize=None to keep {stored.name}, or 'dequantize'"
            )
        kwargs.pop("local_files_only", None)  # asyncmoe reads the local files itself
        if kwargs:
            raise ValueError(
                f"a {stored.name} checkpoint is read by asyncmoe itself, which takes no "
                f"{', '.join(kwargs)}"
            )
        files = checkpoint_files(local)
        keep = quantize != "dequantize"
        check_host_memory(checkpoint_bytes(files, dtype, keep_quantized=keep), f"loading {path}")
        model = load_quantized(local, files, dtype, stored, keep)
        quantize = stored if keep else None
    else:
        if local.exists():
            check_host_memory(
                checkpoint_bytes(checkpoint_files(local), dtype), f"loading {path} in {dtype}"
            )
        model = AutoModelForCausalLM.from_pretrained(
            local if local.exists() else path, dtype=dtype, **kwargs
        )
    model = install(model, dataclasses.replace(settings, quantize=quantize))
    providers = [getattr(m, PROVIDER) for _, m in find_experts(model)]
    if all(isinstance(p, CpuProvider) for p in providers):
        print(
            f"asyncmoe: every routed expert of {len(providers)} MoE layers computed on the CPU from "
            f"host memory; the rest of the model on {settings.device}"
        )
        return model
    cached = [p for p in providers if isinstance(p, CachedProvider)]
    blocks = [p.cache.pinned_block for p in cached]
    where = (
        f"pinned host memory: {human_bytes(sum(b.nbytes for b in blocks if b))}"
        if any(blocks)
        else "host memory"
    )
    slots = f"{cached[0].cache.num_slots} slots per layer" if cached else "every expert resident"
    fmt = f" ({parse_quantize(quantize).name})" if quantize is not None else ""
    print(
        f"asyncmoe: experts{fmt} of {len(cached)} of {len(providers)} MoE layers in {where}; "
        f"{slots} on "
        f"{settings.device}"
    )
    return model
