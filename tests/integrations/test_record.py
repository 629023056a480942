"""Recording routing into a trace (integrations/record.py): the ids and weights every layer routed by, sequence
starts, and with gate=True what the gate predictor scores."""

import numpy as np
import pytest
import torch
import transformers

import asyncmoe
from asyncmoe.integrations.transformers import find_experts, find_router
from asyncmoe.prefetch import predictors
from asyncmoe.trace import Trace

from models import tiny


def test_record_gate_is_the_gate_predictors_view():
    """Recorded with gate=True, layer l's gate arrays are what the runtime's gate predictor scores from layer
    l-1's MoE input: each token's top-k experts of layer l's router, with their probabilities."""
    model = tiny("olmoe")
    inputs = []
    first, second = [m for _, m in find_experts(model)]
    first.register_forward_pre_hook(
        lambda m, a, kw: inputs.append(a[0] if a else kw["hidden_states"]), with_kwargs=True
    )
    with torch.no_grad(), asyncmoe.record(model, gate=True) as rec:
        model(torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2)))
    trace = rec.trace
    assert (trace.gate_ids[:, 0] == -1).all()
    weight, bias = find_router(model, *find_experts(model)[1])
    want = torch.zeros(trace.num_experts)
    with torch.no_grad():
        predictors.gate_scores(inputs[0], weight, bias, trace.top_k, want, use_kernel=False)
    got = torch.zeros(12, trace.num_experts).scatter_(
        1, torch.as_tensor(trace.gate_ids[:, 1]), torch.as_tensor(trace.gate_probs[:, 1])
    )
    torch.testing.assert_close(got.mean(0), want)


@torch.no_grad()
def test_record_takes_what_the_routers_chose_call_by_call():
    """Tokens of a call in row-major order (batch, then position), calls one after the other; `new_sequence`
    marks where each sequence starts; recording stops with the block."""
    model = tiny("qwen3_moe")
    routed = []
    for _, m in find_experts(model):
        m.register_forward_pre_hook(
            lambda m, a, kw: routed.append(a[1] if len(a) > 1 else kw["top_k_index"]),
            with_kwargs=True,
        )
    with asyncmoe.record(model) as rec:
        rec.new_sequence()
        model(torch.randint(0, 128, (2, 3)))
        rec.new_sequence()
        model(torch.randint(0, 128, (1, 4)))
    model(torch.randint(0, 128, (1, 2)))  # after the block: not recorded
    trace = rec.trace
    assert (
        trace.ids.shape == (10, 2, 2)
        and trace.weights.shape == (10, 2, 2)
        and list(trace.starts) == [0, 6]
    )
    for layer in range(2):
        assert np.array_equal(
            trace.ids[:, layer], torch.cat([routed[layer], routed[2 + layer]]).numpy()
        )
    assert trace.gate_ids is None


def test_nothing_recorded():
    with asyncmoe.record(tiny("olmoe")) as rec:
        pass
    with pytest.raises(ValueError, match="nothing was recorded: run the model inside `with record"):
        _ = rec.trace


@pytest.mark.parametrize("bad", ["x", 1, None])
def test_record_gate_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=f"gate must be True or False, got {bad!r}"):
        asyncmoe.record(tiny("olmoe"), gate=bad)


def test_a_model_without_moe_layers_cannot_be_recorded():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM has no MoE layer to record; supported: the \d+ families",
    ):
        asyncmoe.record(transformers.LlamaForCausalLM(config))


def test_a_trace_records_the_experts_stored_bytes(tmp_path):
    """The recorded model's expert bytes in its stored format, which `simulate` takes for bytes per token."""
    from asyncmoe.trace.simulate import simulate

    model = asyncmoe.compile(tiny("olmoe"), cache=4, quantize="fp8", device="cpu")
    with asyncmoe.record(model) as r:
        model(torch.randint(3, 128, (1, 12)))
    r.trace.save(tmp_path / "t.npz")
    trace = Trace.load(tmp_path / "t.npz")
    fp8 = asyncmoe.stats(model).layers[0].expert_bytes
    assert trace.expert_bytes == fp8
    result = simulate(trace, 4, compiled=False)
    assert result.totals["bytes_per_token"] == pytest.approx(
        result.totals["misses_per_token"] * fp8
    )
