"""The `asyncmoe` command."""

from __future__ import annotations

import argparse
import sys

import torch

PROMPT = "def fibonacci(n):\n"


def _timed(model, ids, new_tokens: int, cached: bool, repeats: int = 3):
    """Median-speed greedy generation (after a warm-up that also captures the CUDA graph on a GPU)."""
    import asyncmoe

    dec = asyncmoe.Decoder(model, batch_size=ids.shape[0], max_length=ids.shape[1] + new_tokens)
    dec.generate(ids, 2)
    runs = []
    for _ in range(repeats):
        if cached:
            asyncmoe.stats(model, reset=True)  # the stats then describe the last run
        runs.append(dec.generate(ids, new_tokens))
    return sorted(runs, key=lambda r: r.decode_ms_per_token)[repeats // 2], dec.graphed


def demo(args) -> int:
    """The embedded model with a small expert cache, streamed, then timed next to the same model fully resident
    and with prefetch off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import asyncmoe

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # bf16 on the GPU: transformers' fp32 grouped_mm copies from the host, so the resident fp32 model
    # cannot be captured in a CUDA graph (seen on the H200 with transformers 5.17)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    path = asyncmoe.demo_model_path()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"asyncmoe demo on {device} ({where}), {dtype}")
    print(f"model: the embedded demo model ({path}): OLMoE routing shape, 64 experts top-8, trained on Python's stdlib")
    tokenizer = AutoTokenizer.from_pretrained(path)
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    cached = asyncmoe.from_pretrained(path, cache=args.cache, dtype=dtype, device=device, policy=args.policy)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)

    print(f"\n--- asyncmoe, cache={args.cache}/64, greedy, streamed ---")
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
    plain = asyncmoe.from_pretrained(path, cache=args.cache, dtype=dtype, device=device, policy=args.policy, prefetch=False)
    bare, _ = _timed(plain, ids, args.tokens, cached=True)
    mode = "CUDA graph" if graphed else "eager"
    print(f"{'greedy, ' + str(args.tokens) + ' tokens, ' + mode:<34} {'tokens/s':>9} {'ms/token':>9} {'hit rate':>9} "
          f"{'prefetch recall':>16} {'MB moved/token':>15}")
    print(f"{'fully resident (64/64)':<34} {base.tokens_per_s:>9.1f} {base.decode_ms_per_token:>9.2f} {'-':>9} {'-':>16} {'-':>15}")
    for label, run, totals in [("", got, s.totals), (", no prefetch", bare, asyncmoe.stats(plain).totals)]:
        moved = totals["bytes_h2d"] / run.new_tokens  # the last timed run, prefill included
        print(f"{f'asyncmoe cache={args.cache}/64{label}':<34} {run.tokens_per_s:>9.1f} {run.decode_ms_per_token:>9.2f} "
              f"{totals['hit_rate']:>9.1%} {totals['prefetch_recall']:>16.1%} {moved / 1e6:>15.2f}")
    agree = (got.tokens == base.tokens).cumprod(-1).sum().item() - ids.shape[1]
    print(f"tokens equal to the resident model's: the first {agree} of {got.new_tokens}"
          + ("" if dtype == torch.float32 else f" ({dtype}: the two models' logits are close, not bit-equal, so a near-tie "
             "can go either way; in float32 they must all agree)") + "\n")
    print(s)
    return 0 if agree == got.new_tokens or dtype != torch.float32 else 1


def generate(args) -> int:
    """Any local transformers MoE checkpoint with a tokenizer: load with asyncmoe, stream a generation, print stats."""
    import contextlib

    import asyncmoe
    from transformers import AutoTokenizer

    model = asyncmoe.from_pretrained(
        args.model, cache=args.cache, dtype=getattr(torch, args.dtype), device=args.device, policy=args.policy
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    # recording hooks run in eager forwards only, so a recorded run decodes without the CUDA graph
    dec = asyncmoe.Decoder(model, batch_size=1, max_length=ids.shape[1] + args.tokens, graph=None if not args.record_trace else False)
    text = ids[0].tolist()

    def show(tokens: list[int]) -> None:  # stream: print what the new token adds to the decoded text
        before = tokenizer.decode(text)
        text.append(tokens[0])
        print(tokenizer.decode(text)[len(before) :], end="", flush=True)

    print(tokenizer.decode(text), end="", flush=True)
    # with the gate's nominations: `asyncmoe simulate --prefetch gate` and a replay's gate predictor need them
    with asyncmoe.record(model, gate=True) if args.record_trace else contextlib.nullcontext() as recorder:
        if recorder:
            recorder.new_sequence()
        out = dec.generate(
            ids, args.tokens, do_sample=args.temperature > 0, temperature=max(args.temperature, 1e-5), top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, eos_token_id=tokenizer.eos_token_id, callback=show,
        )
    print(f"\n\n{out.new_tokens} tokens, prefill {out.prefill_ms:.1f} ms, decode {out.decode_ms_per_token:.2f} ms/token "
          "(streamed: one host sync per token)")
    if recorder:
        recorder.trace.save(args.record_trace)
        print(f"routing trace of {recorder.trace.tokens} tokens x {recorder.trace.layers} MoE layers -> {args.record_trace}")
    print(asyncmoe.stats(model))
    return 0


def simulate(args) -> int:
    """Replay a routing trace through the runtime's cache and predictor code on the CPU, beside the Belady bound."""
    from .predict.predictors import Prefetch
    from .trace import Trace
    from .trace.simulate import simulate as run

    torch.set_num_threads(1)
    prefetch = tuple(p for p in args.prefetch.split("+") if p and p != "off")
    budget = Prefetch.budget if args.budget is None else args.budget
    result = run(Trace.load(args.trace), args.cache, args.policy, prefetch, budget, args.expert_bytes, not args.no_compile)
    print(result.to_json() if args.json else result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run a MoE model with a small expert cache next to the fully resident model")
    p.add_argument("--cache", type=int, default=16, help="GPU slots per MoE layer (of 64 experts)")
    p.add_argument("--policy", default="lfru", help="lru, lfu, lfru or fifo")
    p.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on the GPU, float32 on the CPU (where tokens must equal the resident model's)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.set_defaults(fn=demo)
    g = sub.add_parser("generate", help="generate from a local MoE checkpoint (config, safetensors, tokenizer)")
    g.add_argument("--model", required=True, help="checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--cache", type=int, default=16, help="GPU slots per MoE layer")
    g.add_argument("--tokens", type=int, default=64, help="new tokens")
    g.add_argument("--policy", default="lfru", help="lru, lfu, lfru or fifo")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--record-trace", default=None, help="write the routing of this run, and what the gate predictor "
                   "predicted, to an .npz trace (eager decode)")
    g.set_defaults(fn=generate)
    s = sub.add_parser("simulate", help="replay a routing trace through the cache on the CPU; print hit rates and the Belady bound")
    s.add_argument("trace", help=".npz routing trace (docs/traces.md)")
    s.add_argument("--cache", type=int, default=16, help="slots per MoE layer")
    s.add_argument("--policy", default="lfru", help="lru, lfu, lfru or fifo")
    s.add_argument("--prefetch", default="off", help="off, or predictors joined by +: temporal, transition, and gate "
                   "where the trace recorded its nominations (asyncmoe.record(model, gate=True))")
    s.add_argument("--budget", type=int, default=None, help="experts prefetched per layer per token (default: asyncmoe.Prefetch's)")
    s.add_argument("--expert-bytes", type=int, default=0, help="bytes of one expert, for bytes per token")
    s.add_argument("--json", action="store_true", help="print the totals as one JSON object")
    s.add_argument("--no-compile", action="store_true", help="skip torch.compile (slower; no compile wait on short traces)")
    s.set_defaults(fn=simulate)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
