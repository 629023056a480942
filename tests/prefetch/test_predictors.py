"""The cross-layer predictors (predict/predictors.py): each predicts what it should, `combine` ranks the gate
first, the transition counts learn, and bad `Prefetch` settings are refused."""

import pytest
import torch

import asyncmoe
from asyncmoe.cache.state import GATE, SOURCES, TEMPORAL, TRANSITION
from asyncmoe.prefetch import predictors
from asyncmoe.prefetch.predictors import (
    TRANSITION_DECAY,
    combine,
    gate_scores,
    gate_top,
    observe,
    observe_reference,
    temporal_scores,
    top_scores,
    transition_scores,
)


def test_the_source_bits_are_the_caches():
    from asyncmoe.cache import state

    assert (GATE, TEMPORAL, TRANSITION, SOURCES) == (
        state.GATE,
        state.TEMPORAL,
        state.TRANSITION,
        state.SOURCES,
    )
    assert [1 << i for i in range(len(SOURCES))] == [GATE, TEMPORAL, TRANSITION]


def test_gate_scores_follow_the_router():
    weight = torch.eye(4) * 10  # token i prefers expert i
    x = torch.eye(4)[[1, 1, 3]]
    s = torch.full((4,), -1.0)
    gate_scores(x, weight, None, 1, s)
    assert s.argmax() == 1 and s[3] > 0 and s[0] == 0 and s[2] == 0


def test_gate_scores_are_the_mean_of_each_tokens_top_probabilities():
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(5, 8, generator=g),
        torch.randn(6, 8, generator=g),
        torch.randn(6, generator=g),
    )
    out = torch.zeros(6)
    gate_scores(x, weight, bias, 2, out)
    probs = (x @ weight.T + bias).softmax(-1)
    top = probs.topk(2, dim=-1)
    want = torch.zeros(5, 6).scatter_(1, top.indices, top.values).mean(0)
    torch.testing.assert_close(out, want)
    picked = gate_top(x, weight, bias, 2)
    torch.testing.assert_close(top_scores(picked.indices, picked.values, 6).mean(0), want)
    assert top_scores(torch.tensor([[-1, 2]]), torch.tensor([[0.7, 0.2]]), 4)[
        0
    ].tolist() == pytest.approx([0, 0, 0.2, 0])


def test_transition_scores_learn_a_mapping():
    transitions = torch.zeros(4, 6)
    for _ in range(10):  # expert 0 before -> 5 here; 2 -> 3
        observe(
            torch.tensor([True, False, True, False]),
            torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.bool),
            transitions,
        )
    before = torch.tensor([True, False, False, False])
    observe(before, torch.tensor([0, 0, 0, 0, 0, 1], dtype=torch.bool), transitions)
    s = transition_scores(before, transitions, keep=1)
    assert s.argmax() == 5 and (s > 0).sum() == 1


def test_observe_decays_then_adds_the_pairs():
    transitions = torch.full((2, 3), 4.0)
    observe_reference(torch.tensor([True, False]), torch.tensor([False, True, True]), transitions)
    want = torch.tensor(
        [[4 * TRANSITION_DECAY, 4 * TRANSITION_DECAY + 1, 4 * TRANSITION_DECAY + 1]]
        + [[4 * TRANSITION_DECAY] * 3]
    )
    torch.testing.assert_close(transitions, want)
    again = torch.full((2, 3), 4.0)
    observe(
        torch.tensor([True, False]), torch.tensor([False, True, True]), again
    )  # the CPU: the reference
    assert torch.equal(again, transitions)


def test_temporal_scores_are_last_calls_routing():
    assert temporal_scores(torch.tensor([True, False, True])).tolist() == [1.0, 0.0, 1.0]


def test_combine_ranks_the_gate_first_and_drops_weak_support():
    gate = (GATE, torch.tensor([0.5, 0, 0, 0]))
    temporal = (TEMPORAL, temporal_scores(torch.tensor([True, False, True, False])))
    transition = (TRANSITION, torch.tensor([0.0, 0.0, 0.4, 0.2]))
    scores, sources = combine([gate, temporal, transition])
    # expert 0: the gate's (1 + 0.5); 2: temporal and transition agree (mean 0.7); 3: mean 0.1 < MIN_SUPPORT
    assert scores.tolist() == pytest.approx([1.5, 0, 0.7, 0])
    assert sources.tolist() == [GATE | TEMPORAL, 0, TEMPORAL | TRANSITION, 0]
    scores, sources = combine([temporal])
    assert scores.tolist() == [1, 0, 1, 0] and sources.tolist() == [TEMPORAL, 0, TEMPORAL, 0]


@pytest.mark.parametrize(
    "bad",
    [
        dict(sources=("oracle",)),
        dict(sources=()),
        dict(depth=0),
        dict(depth=2),
        dict(budget=0),
        dict(copy_programs=0),
    ],
)
def test_bad_prefetch_settings(bad):
    with pytest.raises(ValueError, match="prefetch"):
        asyncmoe.Prefetch(**bad)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("budget", 1.5),
        ("budget", True),
        ("depth", "2"),
        ("per_token", 0),
        ("per_token", 2.0),
        ("copy_programs", 1.5),
    ],
)
def test_prefetch_counts_must_be_ints(name, bad):
    """Checked where the settings are built, not by the custom op's schema on the first forward."""
    with pytest.raises(ValueError, match=f"prefetch {name} must be an int >= 1 .*got {bad!r}"):
        asyncmoe.Prefetch(**{name: bad})


def test_prefetch_sources_are_a_sequence_of_names():
    with pytest.raises(
        TypeError, match=r"sources must be a tuple .* got 'gate'.*sources=\('gate',\)"
    ):
        asyncmoe.Prefetch(sources="gate")
    assert asyncmoe.Prefetch(sources=["gate", "temporal"]).sources == ("gate", "temporal")


def test_default_prefetch_settings():
    p = asyncmoe.Prefetch()
    assert (p.sources, p.depth, p.budget, p.per_token) == (("gate",), 1, 2, None)
    assert asyncmoe.Prefetch is predictors.Prefetch
    asyncmoe.Prefetch(
        sources=("temporal",), depth=2
    )  # deeper needs a predictor that sees past the next layer
