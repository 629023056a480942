"""`python -m asyncmoe`: the `asyncmoe` command."""

import sys

from .cli import main

sys.exit(main())
