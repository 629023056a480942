"""One layer's experts MLP at decode sizes from dense bf16 slots: the GEMV path against the grouped GEMM, to place
`experts.DENSE_GEMV_PAIRS_PER_SLOT`.

    python benchmarks/decode_experts.py --out decode_experts.json     # GPU

One wave of `--slots` slots of a shape's real expert matrices (`shapes.py`), `T` tokens each routed to top-k
distinct slots; each path's whole `routed_outputs` (the grouped path's sort and counts, the matmuls, the
activation) captured in a CUDA graph, as the Decoder runs it; median over `--reps` timings of 10 replays each.
The GEMV's outputs are checked against the grouped path's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import transformers

from asyncmoe import experts
from asyncmoe.integrations.transformers import find_experts

from shapes import config, routing_shape


def graph_ms(fn, reps: int, replays: int = 10) -> float:
    """`fn` captured in a CUDA graph: the median over `reps` of the mean time of `replays` back-to-back replays, ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS workspaces
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["olmoe-1b-7b", "deepseek-v2-lite"])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, C, rows = torch.device("cuda"), args.slots, []
    for shape in args.shapes:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config(shape), dtype=torch.bfloat16)
        _, m = find_experts(model)[0]  # its flags and callables; the matrices come from `weights`
        if m.is_transposed:
            raise SystemExit(f"{shape}: experts stored [in, out]; the GEMV takes [out, in] ones (_use_slot_gemv)")
        up, up_bias, down, down_bias = experts.layer_weight_names(m)  # biases: None where the layout has none
        g = torch.Generator(dev).manual_seed(0)
        weights = {
            n: torch.randn(C, *getattr(m, n).shape[1:], device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            for n in (up, up_bias, down, down_bias)
            if n is not None
        }
        grouped_args = (weights[up], weights.get(up_bias), weights[down], weights.get(down_bias))
        k = routing_shape(shape)[1]
        for T in args.tokens:
            x = torch.randn(T, model.config.hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
            slots = torch.stack([torch.randperm(C, device=dev, generator=g)[:k] for _ in range(T)])
            ways = {
                "gemv": functools.partial(experts._gemv, m, x, slots, weights, None),
                "grouped": functools.partial(experts._grouped, m, x, slots, *grouped_args),
            }
            want = ways["grouped"]().float()
            err = (ways["gemv"]().float() - want).abs().max().item() / want.pow(2).mean().sqrt().item()
            row = dict(shape=shape, slots=C, tokens=T, pairs_per_slot=T * k / C, gemv_rel_err=err)
            row.update({f"{way}_ms": graph_ms(fn, args.reps) for way, fn in ways.items()})
            rows.append(row)
            print(
                f"{shape:<17} T={T:<3} {T * k / C:5.2f} pairs/slot: gemv {row['gemv_ms']:.4f} ms, grouped "
                f"{row['grouped_ms']:.4f} ms ({row['gemv_ms'] / row['grouped_ms']:.2f}x); gemv rel. err {err:.1e}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
