"""The `asyncmoe` command: one module a command (`demo`, `generate`, `simulate`), each with its options
beside it, and `options.py` for the options they share. Parsing imports no torch (seconds), so
--version and --help answer at once; each command imports what it runs."""

from __future__ import annotations

import argparse

from .. import __version__
from . import demo, generate, simulate
from .options import Parser

DESCRIPTION = (
    "The `asyncmoe` command: `demo`, `generate` and `simulate` (`asyncmoe COMMAND --help`)."
)
COMMANDS = {"demo": demo, "generate": generate, "simulate": simulate}
# what asyncmoe raises for bad input, with a message written for the user: one line, no traceback
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, MemoryError)


def parser() -> Parser:
    """The command line; `parser.commands` maps each command to its own parser, for the checks that
    need several options (`main`)."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    top = Parser(prog="asyncmoe", description=DESCRIPTION, formatter_class=formatter)
    top.add_argument("--version", action="version", version=f"asyncmoe {__version__}")
    top.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not just its message"
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    top.commands = {}
    for name, command in COMMANDS.items():
        p = sub.add_parser(
            name, help=command.HELP, description=command.HELP, formatter_class=formatter
        )
        command.add_options(p)
        top.commands[name] = p
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input ends with one line on stderr and exit status 2 (`--debug`: its
    traceback). Every option is checked before anything loads."""
    top = parser()
    args = top.parse_args(argv)
    command = COMMANDS[args.command]
    problem = command.check(args)
    if problem:
        top.commands[args.command].error(problem)
    try:
        return command.run(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        # one line, whatever the message's layout
        message = " ".join(str(e).split()) or type(e).__name__
        top.exit(2, f"asyncmoe: error: {message}\n")
