"""Greedy decoding compared step for step: what the CPU executor's and the hybrid's tests assert of a model."""

from __future__ import annotations

import torch

import asyncmoe

STEPS = 64
GREEDY = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0)


def prompt(device="cpu") -> torch.Tensor:
    return torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0)).to(device)


def assert_same_greedy(ours, theirs, ids, graph: bool = False) -> None:
    """64 greedy tokens of `ours` equal `theirs`'s, under generate and the Decoder (and its graph)."""
    want = theirs.generate(ids, **GREEDY)
    assert torch.equal(ours.generate(ids, **GREEDY), want)
    assert torch.equal(asyncmoe.Decoder(ours, 1, 80, graph=False).generate(ids, STEPS).tokens, want)
    if graph:
        assert torch.equal(
            asyncmoe.Decoder(ours, 1, 80, graph=True).generate(ids, STEPS).tokens, want
        )
