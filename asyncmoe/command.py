"""The `asyncmoe` command's entry point (pyproject's [project.scripts]); the command is asyncmoe/cli/."""

from .cli import main

__all__ = ["main"]
