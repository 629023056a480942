"""The Belady bound over a run's last steps (harness.belady_hit_rate): warmed by the tokens before them."""

import numpy as np

from asyncmoe.trace import Trace
from asyncmoe.trace.simulate import belady_misses

from harness import belady_hit_rate


def test_the_rows_before_from_row_warm_the_cache_and_count_no_misses():
    ids = np.array([[0, 1], [2, 3], [0, 1], [2, 3], [0, 4]])
    assert belady_misses(ids, 4) == 5  # four compulsory, then 4 in place of one
    assert belady_misses(ids, 4, from_row=2) == 1
    assert belady_misses(ids, 4, from_row=5) == 0


def test_the_bound_of_the_last_steps_is_warmed_by_the_tokens_before():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(40)]).reshape(
        40, 1, 2
    )  # one layer, top-2
    trace = Trace(ids, 8)
    cold = belady_hit_rate(
        trace, 1, 4, routed=10, steps=10
    )  # nothing before: four compulsory misses at least
    assert cold == 1 - belady_misses(ids[:10, 0], 4) / 20
    warm = belady_hit_rate(trace, 1, 4, routed=40, steps=10)
    assert warm == 1 - belady_misses(ids[:40, 0], 4, from_row=30) / 20
    # a batch of 2: each step's two tokens are one request of their experts
    batched = belady_hit_rate(trace, 2, 4, routed=40, steps=5)
    rows = [*ids[:30, 0].tolist(), *ids[30:, 0].reshape(5, 4).tolist()]
    rows = [r + [r[0]] * (len(rows[-1]) - len(r)) for r in rows]
    lookups = sum(len(set(r)) for r in ids[30:, 0].reshape(5, 4).tolist())
    assert batched == 1 - belady_misses(np.array(rows), 4, from_row=30) / lookups
