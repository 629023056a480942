"""The `asyncmoe` command."""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def _olmoe_shaped(device: torch.device, dtype: torch.dtype):
    """A small random-weight model with OLMoE's routing shape (64 experts, top-8)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = OlmoeForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # random routers send every token to the same experts; spread them as trained ones do
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    return model


def _decode(model, ids, new_tokens: int, label: str) -> torch.Tensor:
    import asyncmoe

    dec = asyncmoe.Decoder(model, batch_size=ids.shape[0], max_length=ids.shape[1] + new_tokens)
    dec.generate(ids, 2)  # warm-up (and, on the GPU, the graph capture)
    out = dec.generate(ids, new_tokens)
    mode = "CUDA graph" if dec.graphed else "eager"
    print(f"  {label:<28} {out.tokens_per_s:8.1f} tokens/s  ({mode}, {out.decode_ms_per_token:.2f} ms/token)", flush=True)
    return out.tokens


def demo(args) -> int:
    import asyncmoe

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"asyncmoe demo on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {dtype}")
    print("model: random-weight, OLMoE routing shape (64 experts, top-8), 4 MoE layers")
    resident = _olmoe_shaped(device, dtype)
    cached = asyncmoe.compile(copy.deepcopy(resident), cache=args.cache, policy=args.policy)
    ids = torch.randint(1, 1024, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)

    print(f"generating {args.tokens} tokens, greedy:")
    expected = _decode(resident, ids, args.tokens, "fully resident (64/64)")
    got = _decode(cached, ids, args.tokens, f"asyncmoe cache={args.cache}/64")
    same = torch.equal(got, expected)
    print(f"  same tokens as the resident model: {same}")
    print(asyncmoe.stats(cached))
    return 0 if same else 1


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
    with asyncmoe.record(model) if args.record_trace else contextlib.nullcontext() as recorder:
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
    from .trace import Trace
    from .trace.simulate import simulate as run

    torch.set_num_threads(1)
    prefetch = tuple(p for p in args.prefetch.split("+") if p and p != "off")
    result = run(Trace.load(args.trace), args.cache, args.policy, prefetch, args.budget, args.expert_bytes, not args.no_compile)
    print(result.to_json() if args.json else result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run a MoE model with a small expert cache next to the fully resident model")
    p.add_argument("--cache", type=int, default=16, help="GPU slots per MoE layer (of 64 experts)")
    p.add_argument("--policy", default="lfru", help="lru, lfu, lfru or fifo")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate")
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
    g.add_argument("--record-trace", default=None, help="write the routing of this run to an .npz trace (eager decode)")
    g.set_defaults(fn=generate)
    s = sub.add_parser("simulate", help="replay a routing trace through the cache on the CPU; print hit rates and the Belady bound")
    s.add_argument("trace", help=".npz routing trace (docs/traces.md)")
    s.add_argument("--cache", type=int, default=16, help="slots per MoE layer")
    s.add_argument("--policy", default="lfru", help="lru, lfu, lfru or fifo")
    s.add_argument("--prefetch", default="off", help="off, temporal, transition or temporal+transition (gate needs hidden states)")
    s.add_argument("--budget", type=int, default=None, help="experts prefetched per layer per token (default: top-k)")
    s.add_argument("--expert-bytes", type=int, default=0, help="bytes of one expert, for bytes per token")
    s.add_argument("--json", action="store_true", help="print the totals as one JSON object")
    s.add_argument("--no-compile", action="store_true", help="skip torch.compile (slower; no compile wait on short traces)")
    s.set_defaults(fn=simulate)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
