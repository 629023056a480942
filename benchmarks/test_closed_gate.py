"""closed_gate.py's variants take out exactly what they name, pass every other copy through, and leave the package
as it was."""

import torch
from closed_gate import patched

import asyncmoe.ops as ops
from asyncmoe.cache import algorithm
from asyncmoe.predict import predictors


def test_patched_takes_out_what_it_names_and_restores():
    before = (predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in)
    x, weight, out = torch.randn(1, 8), torch.randn(4, 8), torch.zeros(4)
    hosts, slots = [torch.arange(12.0).view(3, 4)], [torch.zeros(2, 4)]
    copies = (torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([1]))  # expert 2 -> slot 1, one copy
    with patched(no_gate=True):
        predictors.gate_scores(x, weight, None, 2, out)
        assert not out.any()  # nothing nominated
        assert ops.predict_and_plan is before[1]
    with patched(no_gate=True, no_plan=True):
        assert ops.predict_and_plan() == ()
        algorithm.copy_in(hosts, slots, ())  # the prefetch's: nothing to copy
        algorithm.copy_in(hosts, slots, copies)  # a miss's: copied as ever
    assert torch.equal(slots[0][1], hosts[0][2]) and not slots[0][0].any()
    assert (predictors.gate_scores, ops.predict_and_plan, algorithm.copy_in) == before
    predictors.gate_scores(x, weight, None, 2, out)
    assert out.sum() > 0
