"""The names and defaults that the `asyncmoe` command's --help shows, in a module that imports nothing: the
command answers --help and --version before torch loads (seconds). The modules that implement them take them
from here, and tests/test_cli.py checks that the policies' names match their classes'."""

POLICIES = ("lru", "fifo", "lfu", "lfru", "markov")  # cache/policies.py, one class each
# the fewest copies on every trace measured (docs/decisions.md#default-policy)
DEFAULT_POLICY = "markov"
PREDICTORS = (
    "gate",
    "temporal",
    "transition",
)  # what the simulator replays (`asyncmoe simulate --prefetch`)
PREFETCH_BUDGET = 2  # `Prefetch.budget`: docs/decisions.md#prefetch-budget
