"""The `asyncmoe` command's entry point: it says what a long command is about to do before the imports that
take seconds (torch, transformers), then runs it (cli.py)."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"] and not {"-h", "--help"} & set(argv):
        print(
            "asyncmoe simulate: loading torch, then checking the options",
            file=sys.stderr,
            flush=True,
        )
    from .cli import main as run

    return run(argv)
