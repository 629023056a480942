"""Train the small MoE model asyncmoe embeds as its default: OLMoE's routing shape (64 experts, top-8).

    python scripts/train_demo_model.py --out asyncmoe/data/demo_model            # one GPU, a few minutes
    python scripts/train_demo_model.py --out /tmp/m --steps 5 --device cpu       # smoke run

Corpus: the `.py` files of the running Python's standard library (Python Software Foundation License
v2; present on every machine with Python, so training needs no download), without its `test`
packages. Files are split 98/2 into train/validation by a hash of their path. Tokenizer: byte-level
BPE with 4096 tokens, trained here with `tokenizers`. Model: transformers' OLMoE with 6 layers,
hidden 128, 64 experts of intermediate 96, top-8, untied embeddings (15.6 M parameters; 31 MB in bf16).

Writes the model in transformers format (config.json, model.safetensors, tokenizer files) plus
`training.json` (command, seed, corpus, losses, validation perplexity against a unigram baseline)
and `examples.json` (greedy and sampled generations from a code prompt, made on the CPU in fp32 from the
saved weights, so that any machine reproduces them; `--examples-only` remakes them in `--out`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PROMPT = "def fibonacci(n):\n"


def corpus_files() -> list[pathlib.Path]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3")
    return sorted(
        p for p in stdlib.rglob("*.py") if not set(p.relative_to(stdlib).parts[:-1]) & set(skip)
    )


def split(files: list[pathlib.Path]) -> tuple[list[str], list[str]]:
    train, val = [], []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        (
            val if int(hashlib.sha1(str(f.name).encode()).hexdigest(), 16) % 50 == 0 else train
        ).append(text)
    if not val:  # a tiny smoke corpus: still validate on something held out
        val.append(train.pop())
    return train, val


def train_tokenizer(texts: list[str], vocab: int) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for t in texts:
        ids.extend(tokenizer(t).input_ids + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab: int) -> transformers.OlmoeConfig:
    return transformers.OlmoeConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=1024,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, batch: int, device) -> float:
    n = (data.numel() - 1) // seq
    x = data[: n * seq].view(n, seq)
    y = data[1 : n * seq + 1].view(n, seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        logits = model(x[i : i + batch].to(device)).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y[i : i + batch].to(device).flatten(), reduction="sum"
        ).item()
        count += y[i : i + batch].numel()
    return total / count


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1  # add-one smoothing
    logp = (counts / counts.sum()).log()
    return -logp[val].mean().item()


def write_examples(model_dir: pathlib.Path) -> dict:
    """Greedy and sampled generations from PROMPT, on the CPU in fp32 from the saved weights: any machine
    reproduces them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy = model.generate(
        ids, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    sampled = model.generate(
        ids,
        max_new_tokens=64,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        pad_token_id=tokenizer.eos_token_id,
    )
    examples = {
        "prompt": PROMPT,
        "greedy": tokenizer.decode(greedy[0]),
        "sampled (T=0.8, top-p 0.95, seed 0)": tokenizer.decode(sampled[0]),
    }
    (model_dir / "examples.json").write_text(json.dumps(examples, indent=1))
    return examples


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--max-files", type=int, default=None, help="smoke runs: use only the first N files"
    )
    p.add_argument(
        "--examples-only",
        action="store_true",
        help="only remake examples.json of the model in --out",
    )
    args = p.parse_args()
    if args.examples_only:
        print(json.dumps(write_examples(pathlib.Path(args.out)), indent=1))
        return
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    files = corpus_files()[: args.max_files]
    train_texts, val_texts = split(files)
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train, val = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    print(
        f"corpus: {len(files)} files of Python {sys.version.split()[0]}'s stdlib; {train.numel()} train / "
        f"{val.numel()} validation tokens"
    )

    device = torch.device(args.device)
    model = transformers.OlmoeForCausalLM(model_config(len(tokenizer))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)
    schedule = lambda s: (
        min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    g = torch.Generator().manual_seed(args.seed)
    log = []
    for step in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([train[s : s + args.seq] for s in starts]).to(device)
        y = torch.stack([train[s + 1 : s + args.seq + 1] for s in starts]).to(device)
        with autocast:
            out_ = model(
                x
            )  # y is x shifted by one already: the loss is ours, the router load-balancing loss transformers'
            loss = torch.nn.functional.cross_entropy(out_.logits.float().flatten(0, 1), y.flatten())
            total = loss + model.config.router_aux_loss_coef * out_.aux_loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss.item(), "seconds": time.perf_counter() - start})
            print(
                f"step {step:5d} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )

    model.eval()
    val_loss = evaluate(model, val, args.seq, args.batch, device)
    base = unigram_loss(train, val, len(tokenizer))
    seconds = time.perf_counter() - start
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    examples = write_examples(out)
    report = {
        "command": " ".join(sys.argv),
        "seed": args.seed,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "corpus": f"{len(files)} .py files of Python {sys.version.split()[0]}'s standard library (PSF License v2), "
        "tests excluded",
        "train_tokens": train.numel(),
        "validation_tokens": val.numel(),
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_seen": args.steps * args.batch * args.seq,
        "seconds": seconds,
        "validation_loss": val_loss,
        "validation_perplexity": math.exp(val_loss),
        "unigram_loss": base,
        "unigram_perplexity": math.exp(base),
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(report, indent=1))
    print(
        f"validation perplexity {math.exp(val_loss):.2f} vs unigram {math.exp(base):.2f}; {seconds:.0f} s; "
        f"model in {out}"
    )
    print(examples["greedy"])


if __name__ == "__main__":
    main()
