"""`python -m asyncmoe`: the `asyncmoe` command."""

import sys

from .command import main

sys.exit(main())
