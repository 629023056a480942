"""What a quantized expert format costs in quality, on the embedded demo model and its held-out text.

    python scripts/quality.py --out docs/results/quality.json        # the CPU, a few minutes

The held-out text is the demo model's validation split (scripts/train_demo_model.py: the standard library
files whose name hashes to 0 mod 50), read from the running Python's standard library. Every format runs
the same model in bf16 activations with every expert resident (`cache=64`): perplexity over the held-out
tokens, and the share of 256 greedy tokens after the demo prompt equal to bf16's (and the first that
differs: past it the two generations part, so the share mostly says where they part). The fp32 row runs the
same weights in float32, for scale: how far bf16 itself is from full precision.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import pathlib
import platform
import sys
import time

import torch
import transformers

import asyncmoe

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_demo_model import PROMPT, corpus_files, encode, evaluate, split  # noqa: E402

FORMATS = {
    "bf16": None,
    "fp32": None,
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "int4": "int4",
}  # fp32: bf16 against full precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument(
        "--tokens", type=int, default=0, help="held-out tokens to score (default: all of them)"
    )
    p.add_argument("--greedy", type=int, default=256, help="greedy tokens to compare with bf16's")
    p.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}"
    )
    args = p.parse_args()
    torch.manual_seed(0)
    path = asyncmoe.demo_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    _, val = split(corpus_files())
    data = encode(tokenizer, val)
    data = data[: args.tokens + 1] if args.tokens else data
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    rows, reference = [], None
    for name in args.formats.split(","):
        start = time.perf_counter()
        model = copy.deepcopy(base).float() if name == "fp32" else copy.deepcopy(base)
        if FORMATS[name] is not None:
            model = asyncmoe.compile(model, cache=64, quantize=FORMATS[name], device="cpu")
        loss = evaluate(model, data, seq=256, batch=8, device="cpu")
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=args.greedy,
                min_new_tokens=args.greedy,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )[0, ids.shape[1] :]
        reference = out if reference is None else reference
        same = (out == reference).float()
        differ = (out != reference).nonzero()
        rows.append(
            dict(
                format=name,
                perplexity=math.exp(loss),
                greedy_equal=same.mean().item(),
                first_difference=int(differ[0]) if differ.numel() else None,
                seconds=time.perf_counter() - start,
            )
        )
        print(rows[-1], flush=True)
    bf16 = next(r["perplexity"] for r in rows if r["format"] == "bf16")
    for r in rows:
        r["perplexity_vs_bf16"] = r["perplexity"] / bf16
    result = dict(
        command=" ".join(["python"] + sys.argv),
        tokens=data.numel() - 1,
        greedy_tokens=args.greedy,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        machine=platform.machine(),
        rows=rows,
    )
    print(f"{'format':<8} {'perplexity':>10} {'vs bf16':>8} {'greedy = bf16':>14}")
    for r in rows:
        print(
            f"{r['format']:<8} {r['perplexity']:>10.3f} {r['perplexity_vs_bf16']:>8.4f} {r['greedy_equal']:>14.1%}"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
