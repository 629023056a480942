"""The `asyncmoe` command."""

from asyncmoe.cli import main


def test_demo_runs_and_matches_the_resident_model(capsys):
    assert main(["demo", "--tokens", "6", "--cache", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tokens equal to the resident model's: the first 6 of 6" in out
    assert "hit%" in out and "tokens/s" in out


def test_generate_from_a_local_checkpoint(tmp_path, capsys):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from models import tiny

    words = ["[UNK]", "<eos>"] + [f"w{i}" for i in range(126)]  # every id the model can emit
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>").save_pretrained(tmp_path)
    original = tiny("qwen3_moe")
    original.save_pretrained(tmp_path, max_shard_size="100KB")

    argv = ["generate", "--model", str(tmp_path), "--prompt", "w1 w2 w3", "--tokens", "8", "--cache", "4",
            "--device", "cpu", "--dtype", "float32", "--record-trace", str(tmp_path / "run.npz")]
    assert main(argv) == 0
    from asyncmoe.trace import Trace

    trace = Trace.load(tmp_path / "run.npz")  # prompt (3 tokens) + 7 decode steps, 2 MoE layers, top-2
    assert trace.ids.shape == (10, 2, 2) and trace.starts.tolist() == [0]
    assert trace.gate_ids.shape == (10, 2, 2) and (trace.gate_ids[:, 0] == -1).all() and (trace.gate_ids[:, 1] >= 0).all()
    loaded, text, *rest = capsys.readouterr().out.split("\n")
    assert "routing trace of 10 tokens x 2 MoE layers" in "\n".join(rest)
    assert loaded.startswith("asyncmoe: experts of 2 of 2 MoE layers") and "8 tokens" in "\n".join(rest)
    ids = torch.tensor([[3, 4, 5]])  # w1 w2 w3
    want = original.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1)[0, 3:].tolist()
    if 1 in want:  # generation stops at <eos>
        want = want[: want.index(1) + 1]
    assert text.split() == ["w1", "w2", "w3"] + [words[t] for t in want if t != 1]
