"""Quantized checkpoints read by asyncmoe itself, their routed experts kept quantized: fine-grained
FP8 (DeepSeek-V3/R1, Kimi-K2, the Qwen3 FP8 releases) and MXFP4 (GPT-OSS).

transformers runs such checkpoints with expert kernels fetched from a model hub and elsewhere
dequantizes
them on load; asyncmoe keeps the experts as the files store them. The model is built from its config
with
its parameters on the meta device (buffers such as rotary tables are computed as usual), then every
tensor
of the checkpoint is read once:
- routed experts stored per expert (`experts.{i}.{gate,up,down}_proj.weight` with
  `weight_scale_inv`, as
  DeepSeek-V3 and Qwen3 ship them; `w1/w3/w2` as Mixtral's) are stacked into the experts module's
  fused
  tensors [E, N, K] with their scales, gate before up; experts already fused (`gate_up_proj`, or
  GPT-OSS's
  `gate_up_proj_blocks` with `gate_up_proj_scales`) are taken as they are; kept quantized, or
  dequantized
  with `keep=False`;
- every other fp8 weight is dequantized to the compute dtype with its scales (they are a small
  share);
- the rest is cast to the dtype of the parameter it fills.
Checkpoint names are mapped to the model's by transformers' own renaming rules for the family.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from ..formats import FP8, SCALE, Format, Fp8, Mxfp4, dequantize_fp8, scale_shape
from .transformers import find_experts

PER_EXPERT = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight(?P<scale>_scale_inv)?$"
)
# per-expert projection -> (fused tensor of a gated experts module, its part: gate rows first, then
# up)
GATED = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w2": ("down_proj", 0),
}
UNGATED = {
    "up_proj": ("up_proj", 0),
    "w1": ("up_proj", 0),
    "down_proj": ("down_proj", 0),
    "w2": ("down_proj", 0),
}


BLOCKS = "_blocks"  # GPT-OSS's packed 4-bit weights: [E, N, K/32, 16]


def checkpoint_format(path: pathlib.Path) -> Format | None:
    """The checkpoint's expert format where asyncmoe reads it itself (fine-grained fp8, mxfp4); None
    otherwise."""
    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    if quant and quant.get("quant_method") == "mxfp4":
        return Mxfp4()
    if not quant or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(
            f"{path}: its fp8 quantization_config has weight_block_size={block!r}; asyncmoe keeps "
            "block-wise fp8 "
            "(two block sizes, as transformers' fine-grained FP8 stores them)"
        )
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"{path}: static fp8 activation scales are not supported (activation_scheme must be "
            "'dynamic')"
        )
    return Fp8((int(block[0]), int(block[1])))


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (allocated and freed one at a
    time) and their buffers as usual, so that buffers computed at construction, such as rotary
    tables, are real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class _Experts:
    """One experts module's fused tensors, filled expert by expert and part by part from the
    files."""

    def __init__(self, module: nn.Module, fmt: Format, keep: bool, dtype: torch.dtype):
        self.module, self.fmt, self.keep, self.dtype = module, fmt, keep, dtype
        self.block = fmt.block if isinstance(fmt, Fp8) else None
        self.parts = GATED if module.has_gate else UNGATED
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: set[tuple[str, int, int, bool]] = set()

    def put(
        self,
        proj: str,
        expert: int,
        is_scale: bool,
        value: torch.Tensor,
        weight: torch.Tensor | None,
    ):
        if proj not in self.parts:
            raise ValueError(
                f"unexpected expert projection {proj!r} for {type(self.module).__name__}"
            )
        name, part = self.parts[proj]
        full = getattr(self.module, name)  # the meta parameter: [E, N, K]
        rows = full.shape[1] // (2 if name == "gate_up_proj" else 1)  # this part's rows
        if self.block is None:
            raise ValueError(
                f"per-expert {proj} tensors in a {self.fmt.name} checkpoint: asyncmoe reads "
                f"{self.fmt.name} "
                "experts fused, as GPT-OSS ships them"
            )
        if name == "gate_up_proj" and rows % self.block[0]:
            raise ValueError(
                f"gate and up projections of {rows} rows do not split into fp8 blocks of "
                f"{self.block[0]} rows: "
                "asyncmoe fuses them block-aligned; load with quantize='dequantize'"
            )
        if self.keep:
            target = name + SCALE if is_scale else name
            shape = scale_shape(full.shape, self.block) if is_scale else full.shape
            dtype = torch.float32 if is_scale else FP8
            lo = part * (rows // self.block[0] if is_scale else rows)
            value = value.float() if is_scale else value
        elif is_scale:
            return  # dequantized with its weight
        else:
            target, shape, dtype, lo = name, full.shape, self.dtype, part * rows
            if value.dtype == FP8:
                value = dequantize_fp8(value, weight, self.block, self.dtype)
        if target not in self.tensors:
            self.tensors[target] = torch.empty(shape, dtype=dtype)
        self.tensors[target][expert, lo : lo + value.shape[0]].copy_(value)
        self.filled.add((target, expert, part, is_scale))

    def finish(self, path_name: str) -> None:
        E = (
            self.module.gate_up_proj.shape[0]
            if self.module.has_gate
            else self.module.up_proj.shape[0]
        )
        for target in self.tensors:
            parts = {p for n, p in self.parts.values() if n == target.removesuffix(SCALE)}
            missing = [
                e
                for e in range(E)
                for p in parts
                if (target, e, p, target.endswith(SCALE)) not in self.filled
            ]
            if missing:
                raise ValueError(
                    f"the checkpoint lacks {target} of {len(missing)} experts of {path_name}"
                )
        for target, t in self.tensors.items():
            self.module._parameters[target] = nn.Parameter(t, requires_grad=False)


def load_quantized(
    path: pathlib.Path, files: list[pathlib.Path], dtype: torch.dtype, fmt: Format, keep: bool
):
    """The model of the quantized checkpoint at `path` on the CPU: routed experts in `fmt` (`keep`)
    or in `dtype`, everything else in `dtype` (or its parameter's own dtype, where transformers
    keeps one in fp32)."""
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = {name: _Experts(m, fmt, keep, dtype) for name, m in find_experts(model)}
    block = fmt.block if isinstance(fmt, Fp8) else None
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    meta = model.state_dict()

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], model.base_model_prefix, meta)[0]

    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(file, "pt")) for file in files}
        # a scale may sit in another shard
        where = {key: file for file, f in opened.items() for key in f.keys()}
        for key, file in sorted(where.items()):
            if key.endswith(fmt.suffix):
                continue  # read with its weight
            base = key.removesuffix(BLOCKS)
            value = opened[file].get_tensor(key)
            scale = (
                opened[where[base + fmt.suffix]].get_tensor(base + fmt.suffix)
                if base + fmt.suffix in where
                else None
            )
            target = rename(base)
            match = PER_EXPERT.match(target)
            if match and match["module"] in experts:
                layer, expert = experts[match["module"]], int(match["expert"])
                layer.put(match["proj"], expert, False, value, scale)
                if scale is not None:
                    layer.put(match["proj"], expert, True, scale, None)
                continue
            module_name, _, leaf = target.rpartition(".")
            if module_name in experts and leaf in ("gate_up_proj", "up_proj", "down_proj"):
                _set_fused(experts[module_name], leaf, value, scale, file)
                continue
            if value.dtype == FP8:
                if scale is None:
                    raise ValueError(
                        f"{file.name}: fp8 tensor {key} has no {key + SCALE} in the checkpoint"
                    )
                value = dequantize_fp8(value, scale, block, dtype)
            _set(model, target, value, file)
    for name, layer in experts.items():
        layer.finish(name)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} of the model's tensors ({', '.join(missing[:4])}, ...)"
        )
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _set_fused(
    layer: _Experts, leaf: str, value: torch.Tensor, scale: torch.Tensor | None, file
) -> None:
    """An experts tensor the checkpoint stores fused: [E, N, K] fp8 with `<leaf>_scale_inv`, or
    GPT-OSS's 4-bit `<leaf>_blocks` [E, N, K/32, 16] with `<leaf>_scales` [E, N, K/32]."""
    fmt, module = layer.fmt, layer.module
    if isinstance(fmt, Fp8) and value.dtype != FP8 or scale is None:  # a dense tensor
        module._parameters[leaf] = nn.Parameter(value.to(layer.dtype), requires_grad=False)
        return
    if not isinstance(fmt, Fp8):
        if value.dim() != 4:
            raise ValueError(
                f"{file.name}: {leaf}{BLOCKS} must be [E, N, K/32, 16], got {tuple(value.shape)}"
            )
        value = value.flatten(2)  # [E, N, K/2]
    else:
        scale = scale.float()
    if layer.keep:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        module._parameters[leaf + fmt.suffix] = nn.Parameter(scale, requires_grad=False)
    else:
        dense = fmt.dequantize([value, scale], layer.dtype, module.is_transposed)
        module._parameters[leaf] = nn.Parameter(dense, requires_grad=False)


def put_fused_experts(
    module: nn.Module, fmt: Format, tensors: dict[str, torch.Tensor], source: str = "tensors"
) -> None:
    """Fill an experts module whose parameters are on the meta device with `tensors`, named and laid out
    as a checkpoint stores the module's tensors fused (GPT-OSS's `gate_up_proj_blocks` [E, N, K/32, 16]
    with `gate_up_proj_scales` [E, N, K/32]; fp8 `down_proj` with `down_proj_scale_inv`; dense biases),
    kept quantized as `load_quantized` keeps them. For tensors made in memory a layer at a time, such as
    the random experts of a model too large to write as a checkpoint; `source` names them in errors."""
    meta = {name: p.shape for name, p in module.named_parameters(recurse=False)}
    dtype = next(p.dtype for p in module.parameters(recurse=False) if p.is_floating_point())
    layer, file = _Experts(module, fmt, keep=True, dtype=dtype), pathlib.PurePath(source)
    for key, value in tensors.items():
        base = key.removesuffix(BLOCKS)
        if key.endswith(fmt.suffix) and key.removesuffix(fmt.suffix) in meta:
            continue  # taken with its weight
        if base not in ("gate_up_proj", "up_proj", "down_proj"):
            _set(module, key, value, file)
            continue
        if base + fmt.suffix not in tensors:
            raise ValueError(f"{source}: {key} has no {base + fmt.suffix} beside it")
        _set_fused(layer, base, value, tensors[base + fmt.suffix], file)
        want = fmt.stored(base, meta[base], module.is_transposed)
        got = [(n, module._parameters[n].shape, module._parameters[n].dtype) for n, _, _ in want]
        if got != want:
            raise ValueError(f"{source}: {key} gives {got}; {fmt.name} stores this module's {want}")


def _set(model: nn.Module, target: str, value: torch.Tensor, file: pathlib.Path) -> None:
    """Fill the parameter or persistent buffer `target` of `model`, in its own dtype."""
    module_name, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(
            f"{file.name}: tensor {target} matches no module of {type(model).__name__}"
        ) from None
    if leaf in module._parameters:
        old = module._parameters[leaf]
        if tuple(old.shape) != tuple(value.shape):
            raise ValueError(
                f"{file.name}: {target} has shape {tuple(value.shape)}, the model "
                f"{tuple(old.shape)}"
            )
        module._parameters[leaf] = nn.Parameter(value.to(old.dtype), requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value.to(module._buffers[leaf].dtype)
    else:
        raise ValueError(
            f"{file.name}: tensor {target} matches no parameter of {type(model).__name__}"
        )
