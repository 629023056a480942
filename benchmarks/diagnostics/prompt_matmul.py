"""A quantized layer's expert matmul two ways, to place each path's range (`experts.GEMV_PAIRS_PER_SLOT`): the
decode GEMV (each pair reads its expert) and every slot dequantized to bf16 in one launch
(`asyncmoe/compute/dequantize.py`) then the dense grouped GEMM.

    python benchmarks/diagnostics/prompt_matmul.py --out prompt_matmul.json     # GPU

One wave of a layer: `--slots` slots (16; GPT-OSS-20B 8) of real expert shapes (`shapes.py`), each routed by
`rows` (token, expert) pairs, for both projections; median of `--reps` CUDA-event timings after a warm-up.
Every variant's output is checked against the dense path's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from asyncmoe.compute import experts, ops
from asyncmoe.formats import parse_quantize
from asyncmoe.integrations.transformers import find_experts

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the suite's helpers, in ../
from harness import cuda_ms
from shapes import SHAPES, config

SHAPES_RUN = {
    "olmoe-1b-7b": 16,
    "deepseek-v2-lite": 16,
    "gpt-oss-20b": 8,
}  # shape: slots of one wave


def projections(shape: str) -> list[tuple[str, torch.Size, bool]]:
    """(name, [E, R, Q] as the module stores it, transposed) of the shape's two expert matrices (meta device)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(shape), dtype=torch.bfloat16)
    _, m = find_experts(model)[0]
    names = ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")
    return [(n, getattr(m, n).shape, m.is_transposed) for n in names]


def variants(x, w, scales, offs, fmt, transposed: bool) -> dict:
    """The ways to compute one projection of a wave whose rows are sorted by slot, `offs` their ends."""
    slot_of_row = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device), right=True)

    def dense():
        dq = experts._dequantized(fmt, w, scales, x.dtype, transposed)  # the module's layout
        return experts._grouped_mm(x, dq if transposed else dq.transpose(-2, -1), offs=offs)

    def gemv():
        if fmt.name == "fp8":
            return ops.fp8_matmul(x, w, scales, slot_of_row, fmt.block, transposed)
        return torch.ops.asyncmoe.gemv4(x, w, scales, slot_of_row, fmt.name)

    return {"dequantize+grouped_mm": dense, "gemv": gemv}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(SHAPES_RUN), choices=list(SHAPES))
    p.add_argument("--formats", nargs="+", default=["fp8", "mxfp4", "int4"])
    p.add_argument(
        "--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="pairs per slot"
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    out = []
    for shape in args.shapes:
        C = SHAPES_RUN.get(shape, 16)
        for name, (_, R, Q), transposed in projections(shape):
            for fmt in map(parse_quantize, args.formats):
                w, scales = fmt.quantize(
                    torch.randn(C, R, Q, device=dev, dtype=dtype) * 0.02, transposed
                )
                K = R if transposed else Q
                for per_slot in args.rows:
                    x = torch.randn(C * per_slot, K, device=dev, dtype=dtype)
                    offs = torch.full((C,), per_slot, device=dev).cumsum(0).to(torch.int32)
                    ways = variants(x, w, scales, offs, fmt, transposed)
                    want = ways["dequantize+grouped_mm"]().float()
                    row = dict(
                        shape=shape,
                        projection=name,
                        format=fmt.name,
                        slots=C,
                        rows_per_slot=per_slot,
                        K=K,
                    )
                    for way, fn in ways.items():
                        row[f"{way}_rel_err"] = (fn().float() - want).abs().max().item() / want.pow(
                            2
                        ).mean().sqrt().item()
                        row[f"{way}_ms"] = cuda_ms(fn, args.reps)
                    out.append(row)
                    times = "  ".join(f"{way} {row[f'{way}_ms']:.3f} ms" for way in ways)
                    print(
                        f"{shape:<17} {name:<12} {fmt.name:<5} {per_slot:>4} rows/slot: {times}",
                        flush=True,
                    )
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
