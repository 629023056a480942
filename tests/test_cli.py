"""The `asyncmoe` command."""

import pathlib
import subprocess
import sys
import warnings

import pytest

import asyncmoe
from asyncmoe import cli
from asyncmoe.cli import generate, main, model

ROOT = pathlib.Path(__file__).parent.parent
BARS = (
    "Loading weights",
    "experts to host memory",
)  # transformers' loading bar, asyncmoe's install bar


def asyncmoe_rows(out: str) -> dict[str, list[str]]:
    """The demo table's asyncmoe rows: label -> cells."""
    return {
        line[:44].strip(): line[44:].split()
        for line in out.splitlines()
        if line.startswith("asyncmoe ") and "/64" in line[:44]
    }


def test_demo_runs_and_matches_the_resident_model(capsys):
    assert main(["demo", "--tokens", "6", "--cache", "8", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "tokens equal to the resident model's: the first 6 of 6" in out
    assert "hit%" in out and "tokens/s" in out
    # the CPU default: prefetch off, said why; no comparison without prefetch, no column or mode of the GPU
    assert "prefetch: off (on the CPU" in out
    rows = asyncmoe_rows(out)
    assert (
        list(rows) == ["asyncmoe 8/64, no prefetch"]
        and len(rows["asyncmoe 8/64, no prefetch"]) == 4
    )
    assert "prefetch recall" not in out and "pf-recall%" not in out and "nothing prefetched" in out
    assert "CUDA graph" not in out and "eager" not in out and "nan" not in out
    assert sum(err.count(bar) for bar in BARS) <= 1 and sum(out.count(bar) for bar in BARS) == 0


def test_demo_with_prefetch_on_the_cpu_compares_without_it(capsys):
    assert (
        main(["demo", "--tokens", "2", "--cache", "8", "--device", "cpu", "--prefetch", "on"]) == 0
    )
    out = capsys.readouterr().out
    assert "prefetch: on (--prefetch on" in out
    rows = asyncmoe_rows(out)
    assert list(rows) == ["asyncmoe 8/64, prefetch", "asyncmoe 8/64, no prefetch"]
    on, off = rows.values()  # tokens/s, ms/token, hit rate, prefetch recall, MB moved/token
    assert on[3].endswith("%") and off[3] == "-" and off[2].endswith("%")
    assert (
        "prefetch recall: the share of routed experts found resident because a prefetch put them there"
        in out
    )
    assert "pf-recall%: routed experts found resident because a prefetch put them there" in out
    assert "pf-hit" not in out and "nan" not in out and out.count("asyncmoe: experts of") == 1


def test_demo_with_every_expert_resident_counts_nothing(capsys):
    assert main(["demo", "--tokens", "1", "--cache", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "cache=64 holds all 64 experts: every MoE layer keeps them" in out
    assert asyncmoe_rows(out)["asyncmoe 64/64"][2:] == ["-", "-"]  # hit rate, MB moved/token
    assert "prefetch:" not in out and "hit%" not in out


def test_generate_from_a_local_checkpoint(tmp_path, capsys):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from models import tiny

    words = ["[UNK]", "<eos>"] + [f"w{i}" for i in range(126)]  # every id the model can emit
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>"
    ).save_pretrained(tmp_path)
    original = tiny("qwen3_moe")
    original.save_pretrained(tmp_path, max_shard_size="100KB")

    argv = [
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "w1 w2 w3",
        "--tokens",
        "8",
        "--cache",
        "4",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--record-trace",
        str(tmp_path / "run.trace"),  # written at exactly this path, not run.trace.npz
    ]
    assert main(argv) == 0
    from asyncmoe.trace import Trace

    assert not (tmp_path / "run.trace.npz").exists()
    trace = Trace.load(
        tmp_path / "run.trace"
    )  # prompt (3 tokens) + 7 decode steps, 2 MoE layers, top-2
    assert trace.ids.shape == (10, 2, 2) and trace.starts.tolist() == [0]
    assert trace.gate_ids.shape == (10, 2, 2)
    assert (trace.gate_ids[:, 0] == -1).all() and (trace.gate_ids[:, 1] >= 0).all()
    loaded, text, *rest = capsys.readouterr().out.split("\n")
    assert f"routing trace of 10 tokens x 2 MoE layers -> {tmp_path / 'run.trace'}\n" in "\n".join(
        rest
    )
    assert loaded.startswith(
        "asyncmoe: experts of 2 of 2 MoE layers"
    ) and "8 tokens, greedy," in "\n".join(rest)
    ids = torch.tensor([[3, 4, 5]])  # w1 w2 w3
    want = original.generate(
        ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1
    )[0, 3:].tolist()
    if 1 in want:  # generation stops at <eos>
        want = want[: want.index(1) + 1]
    assert text.split() == ["w1", "w2", "w3"] + [words[t] for t in want if t != 1]


def test_python_m_asyncmoe_prints_the_version():
    run = subprocess.run(
        [sys.executable, "-m", "asyncmoe", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stdout) == (0, f"asyncmoe {asyncmoe.__version__}\n")


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["demo", "--help"], ["generate", "--help"], ["simulate", "--help"]],
)
def test_version_and_help_answer_without_importing_torch(argv):
    """torch takes seconds to import: the command parses with none of it, each command imports what it runs."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "asyncmoe", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert run.returncode == 0 and "asyncmoe.cli" in imported, run.stderr[-2000:]
    assert not {"torch", "transformers", "numpy"} & imported


def test_the_commands_choices_are_the_librarys():
    """`choices.py` holds what --help shows without importing the modules that implement it."""
    from asyncmoe import choices
    from asyncmoe.cache.policies import POLICIES
    from asyncmoe.cache.state import SOURCES

    assert choices.POLICIES == tuple(POLICIES) and choices.PREDICTORS == SOURCES
    assert asyncmoe.Prefetch().budget == choices.PREFETCH_BUDGET


def help_blocks(text: str) -> dict[str, str]:
    """Each option's entry in a --help text, by its first option string."""
    blocks, name = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif name and line.startswith("   "):
            blocks[name] += " " + line.strip()
        else:
            name = None
    return blocks


@pytest.mark.parametrize("command", ["demo", "generate", "simulate"])
def test_help_shows_every_default(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    blocks = help_blocks(capsys.readouterr().out)
    required = {"--model", "--prompt"} if command == "generate" else set()  # no default to show
    assert {"--cache", "--policy", "-h"} <= set(blocks) and required <= set(blocks)
    for name, block in blocks.items():
        if name != "-h":
            assert ("default" in block) == (name not in required), block


def user_error(argv: list[str], capsys) -> str:
    """The one line of a user error; the exit status must be 2, with no traceback."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("asyncmoe: error: ")
    return line


@pytest.mark.parametrize(
    "argv, says",
    [
        (["nosuch"], "invalid choice: 'nosuch'"),
        ([], "required: COMMAND"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
        (["demo", "--tokens", "-5"], "argument --tokens: must be >= 1, got -5"),
        (["demo", "--tokens", "many"], "argument --tokens: expected a number >= 1, got 'many'"),
        (["demo", "--cache", "0"], "argument --cache: must be >= 1, got 0"),
        (["demo", "--cache", "-3"], "argument --cache: must be >= 1, got -3"),
        (["demo", "--prompt", ""], "argument --prompt: must not be empty"),
        (["demo", "--device", "gpu0"], "argument --device: 'gpu0' is not a device"),
        (["demo", "--prefetch", "yes"], "argument --prefetch: invalid choice: 'yes'"),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", ""],
            "argument --prompt: must not be empty",
        ),
        (
            ["generate", "--model", "{tmp}/typo", "--prompt", "hi"],
            "argument --model: no checkpoint directory at {tmp}/typo",
        ),
        (["generate", "--model", "{tmp}", "--prompt", "hi"], "it has no config.json"),
        (
            ["generate", "--model", "{tmp}/no-tokenizer", "--prompt", "hi"],
            "no-tokenizer has no tokenizer",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--temperature", "-1"],
            "argument --temperature: must be a finite number > 0, got '-1'; leave every sampling option out for greedy",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--temperature", "inf"],
            "argument --temperature: must be a finite number > 0, got 'inf'",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--temperature", "nan"],
            "argument --temperature: must be a finite number > 0, got 'nan'",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--temperature", "0"],
            "argument --temperature: must be a finite number > 0, got '0'",
        ),
        (
            [
                "generate",
                "--model",
                "{tmp}/ck",
                "--prompt",
                "hi",
                "--record-trace",
                "{tmp}/no/such/run.npz",
            ],
            "argument --record-trace: no folder {tmp}/no/such to write run.npz into: create it first",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--record-trace", "{tmp}/ck"],
            "argument --record-trace: {tmp}/ck is a folder; give the path of a file in it, such as {tmp}/ck/run.npz",
        ),
        (
            ["demo", "--policy", "bogus"],
            "argument --policy: unknown policy 'bogus'; choose one of lru, fifo",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--policy", "bogus"],
            "unknown policy 'bogus'",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--policy", "LRU"],
            "argument --policy: unknown policy 'LRU'",
        ),
        (
            ["demo", "--cache", "0GiB"],
            "argument --cache: a budget must be more than 0 bytes, got '0GiB'",
        ),
        (
            ["demo", "--cache", "auto", "--device", "cpu"],
            "--cache auto sizes the slots from the free memory of the GPU the model runs on, and it runs on cpu: "
            "give slots per MoE layer (--cache 16) or a budget (--cache 6GiB); see `asyncmoe demo --help`",
        ),
        (
            [
                "generate",
                "--model",
                "{tmp}/ck",
                "--prompt",
                "hi",
                "--cache",
                "auto",
                "--device",
                "cpu",
            ],
            "--cache auto sizes the slots from the free memory of the GPU the model runs on, and it runs on cpu",
        ),
        (
            ["demo", "--cache", "lots"],
            "argument --cache: expected slots per MoE layer (an int) or a GPU-memory budget such as 6GiB, 6GB or "
            "512MiB, or auto; got 'lots'",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--top-p", "0"],
            "argument --top-p: must be in (0, 1]",
        ),
        (
            ["generate", "--model", "{tmp}/ck", "--prompt", "hi", "--tokens", "0"],
            "argument --tokens: must be >= 1, got 0",
        ),
        (["simulate", "{tmp}/missing.npz"], "argument trace: no trace file at {tmp}/missing.npz"),
        (["simulate", "{tmp}/garbage.npz"], "{tmp}/garbage.npz"),
        (
            ["simulate", "{tmp}/garbage.npz", "--cache", "0"],
            "argument --cache: must be >= 1, got 0",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--pace", "0", "210"],
            "argument --pace: must be >= 1.0, got 0",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--cache", "auto"],
            "argument --cache: auto sizes the cache from the free memory of the GPU a model runs on, and simulate "
            "runs on the CPU without one: give slots per MoE layer (16) or the GPU-memory budget you mean (6GiB)",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--pace", "254", "210"],
            "--pace sets how the prefetch copies, and --prefetch is off: choose predictors (--prefetch gate, "
            "temporal or transition, joined by +) or leave --pace out; see `asyncmoe simulate --help`",
        ),
        (
            [
                "simulate",
                "{tmp}/garbage.npz",
                "--prefetch",
                "off",
                "--budget",
                "2",
                "--pace",
                "254",
                "210",
            ],
            "--pace and --budget set how the prefetch copies, and --prefetch is off",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--prefetch", "temporal", "--budget", "0"],
            "argument --budget: must be >= 1",
        ),
        (
            ["simulate", "{tmp}/garbage.npz", "--prefetch", "gate+oracle"],
            "argument --prefetch: expected off, or predictors joined by + (of gate, temporal, transition), got "
            "'gate+oracle'",
        ),
    ],
)
def test_user_errors_are_one_line_with_status_2(argv, says, tmp_path, capsys, monkeypatch):
    (tmp_path / "garbage.npz").write_text("not a trace\n")
    for checkpoint, files in [
        ("ck", ("config.json", "tokenizer.json")),
        ("no-tokenizer", ("config.json",)),
    ]:
        (tmp_path / checkpoint).mkdir()
        for name in files:  # what the parse-time check looks for; nothing loads them
            (tmp_path / checkpoint / name).write_text("{}")
    if argv != [
        "simulate",
        "{tmp}/garbage.npz",
    ]:  # Trace.load finds a garbage trace out; the rest fail at parse time
        for command in cli.COMMANDS.values():
            monkeypatch.setattr(command, "run", lambda args: pytest.fail("ran past a user error"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert says.format(tmp=tmp_path) in user_error(argv, capsys)


@pytest.mark.parametrize("error", [ValueError, TypeError, FileNotFoundError, MemoryError])
def test_api_errors_are_one_line_and_a_traceback_with_debug(error, capsys, monkeypatch):
    def refuse():
        raise error("the embedded demo model is missing:\n  reinstall asyncmoe")

    monkeypatch.setattr(asyncmoe, "demo_model_path", refuse)
    line = user_error(["demo", "--device", "cpu"], capsys)
    assert line == "asyncmoe: error: the embedded demo model is missing: reinstall asyncmoe"
    with pytest.raises(error, match="demo model is missing"):
        main(["--debug", "demo", "--device", "cpu"])


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken():
        raise RuntimeError("an internal error")

    monkeypatch.setattr(asyncmoe, "demo_model_path", broken)
    with pytest.raises(RuntimeError, match="an internal error"):
        main(["demo", "--device", "cpu"])


@pytest.mark.parametrize("quantize", ["int4", "mxfp4"])
def test_demo_with_4_bit_experts(quantize, capsys):
    assert (
        main(["demo", "--tokens", "3", "--cache", "16", "--quantize", quantize, "--device", "cpu"])
        == 0
    )
    assert f"16/64 experts cached, {quantize} experts" in capsys.readouterr().out


def test_demo_with_fp8_experts_and_a_budget(capsys):
    assert (
        main(["demo", "--tokens", "4", "--cache", "3MiB", "--quantize", "fp8", "--device", "cpu"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "cache='3MiB' gives 14 slots per MoE layer" in out
        and "14/64 experts cached, fp8 experts" in out
    )
    assert "tokens equal to the resident model's" in out


def test_a_bad_budget_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--cache", "6 gigs"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "expected slots per MoE layer (an int) or a GPU-memory budget" in err
    )


def parsed(argv: list[str]):
    return cli.parser().parse_args(argv)


@pytest.mark.parametrize("command", ["demo", "generate", "simulate"])
@pytest.mark.parametrize(
    "text, value", [("12", 12), ("6GiB", "6GiB"), ("512MiB", "512MiB"), ("auto", "auto")]
)
def test_cache_takes_slots_a_budget_or_auto(command, text, value, tmp_path, capsys):
    """demo and generate pass auto on to from_pretrained; simulate, on the CPU, has no GPU memory to size it from."""
    (tmp_path / "t.npz").write_text("")  # parsing looks for the file only
    argv = {
        "demo": ["demo"],
        "generate": ["generate", "--model", str(asyncmoe.demo_model_path()), "--prompt", "x"],
        "simulate": ["simulate", str(tmp_path / "t.npz")],
    }[command]
    if command == "simulate" and value == "auto":
        assert "argument --cache: auto sizes the cache" in user_error(
            [*argv, "--cache", text], capsys
        )
    else:
        assert parsed([*argv, "--cache", text]).cache == value


GENERATE = ["generate", "--model", str(asyncmoe.demo_model_path()), "--prompt", "x"]


@pytest.mark.parametrize(
    "options, keywords, words",
    [
        ([], dict(do_sample=False), "greedy"),
        (
            ["--top-k", "5", "--seed", "3"],
            dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=5, seed=3),
            "sampled at temperature 1, top-k 5, seed 3",
        ),
        (
            ["--seed", "3"],
            dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, seed=3),
            "sampled at temperature 1, seed 3",
        ),
        (
            ["--temperature", "0.7", "--top-p", "0.9"],
            dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, seed=None),
            "sampled at temperature 0.7, top-p 0.9",
        ),
    ],
)
def test_a_sampling_option_samples(options, keywords, words, capsys):
    """`--top-k 5 --seed 3` once decoded greedily without a word: any sampling option now samples, at transformers'
    temperature 1 where --temperature is left out, and --help says so."""
    assert generate.sampling(parsed([*GENERATE, *options])) == (keywords, words)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "sampling:\n  any of these samples, at temperature 1" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_slots_below_the_models_top_k_fail_before_it_loads(command, capsys, monkeypatch):
    import transformers

    def loads(*args, **kwargs):
        pytest.fail("the model loaded")

    monkeypatch.setattr(asyncmoe, "from_pretrained", loads)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loads)
    argv = ["demo"] if command == "demo" else GENERATE
    line = user_error([*argv, "--cache", "4", "--device", "cpu"], capsys)
    assert line == (
        "asyncmoe: error: --cache 4 is below the model's top_k=8: every token needs its 8 experts resident at once; "
        "use --cache 8 or more"
    )


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_a_length_past_the_models_positions_warns_before_it_loads(command, capsys, monkeypatch):
    """As transformers' generate warns: the demo model has 1024 positions, and past them it degenerates."""
    import transformers

    def stop(*args, **kwargs):
        raise ValueError("stopped where the model loads")

    monkeypatch.setattr(asyncmoe, "from_pretrained", stop)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", stop)
    argv = ["demo", "--prompt", "x"] if command == "demo" else GENERATE
    for tokens, warned in (("1023", False), ("2000", True)):
        with pytest.raises(SystemExit):
            main([*argv, "--tokens", tokens, "--device", "cpu"])
        *warning, error = capsys.readouterr().err.splitlines()
        assert error == "asyncmoe: error: stopped where the model loads" and bool(warning) == warned
    (warning,) = warning
    assert warning == (
        "asyncmoe: warning: the prompt's 1 tokens and --tokens 2000 run to position 2001, past the model's 1024 "
        "(config.max_position_embeddings): depending on the model, expect exceptions, degenerate text or nothing at "
        "all past them; --tokens 1023 stays within them"
    )


def test_the_decoders_own_warning_on_positions_is_not_said_twice():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with model.said_once():
            warnings.warn(
                "max_length=2001 is past the model's max_position_embeddings=1024: ...",
                stacklevel=1,
            )
            warnings.warn("something else", stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else"]
