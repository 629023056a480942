"""The compute-stream predictor kernels against their plain-torch references: under TRITON_INTERPRET=1 on the CPU, on cuda for real."""

import pytest
import torch

from asyncmoe.cache.expert_cache import observe
from asyncmoe.predict.predictors import gate_scores
from test_cache_step import devices


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, per_token, bias", [(1, 64, 8, False), (3, 8, 2, True), (20, 60, 6, False), (64, 128, 8, True)])
def test_gate_kernel_matches_reference(device, dtype, T, E, per_token, bias):
    g = torch.Generator().manual_seed(T * E)
    H = 96
    x = torch.randn(T, H, generator=g).to(device, dtype)
    weight = torch.randn(E, H, generator=g).to(device, dtype) / H**0.5 * 4  # spread probabilities, few near-ties
    b = torch.randn(E, generator=g).to(device, dtype) if bias else None
    want = gate_scores(x, weight, b, per_token, use_kernel=False)
    got = gate_scores(x, weight, b, per_token, use_kernel=True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert torch.equal(got > 0, want > 0)  # the same nominations
    else:  # logits 1 bf16 ulp apart can swap a token's k-th and (k+1)-th expert: a share of at most 1/k over T tokens
        torch.testing.assert_close(got, want, atol=1 / (per_token * T), rtol=2e-2)
        torch.testing.assert_close(got.sum(), want.sum(), atol=0, rtol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("E_before, E", [(4, 6), (64, 64)])
def test_observe_kernel_matches_reference(device, E_before, E):
    g = torch.Generator().manual_seed(E)
    want = torch.rand(E_before, E, generator=g).to(device) * 5
    got = want.clone()
    for _ in range(3):
        before = (torch.rand(E_before, generator=g) < 0.3).to(device)
        routed = (torch.rand(E, generator=g) < 0.3).to(device)
        observe(before, routed, want, use_kernel=False)
        observe(before, routed, got, use_kernel=True)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)  # a fused multiply-add may round once where torch rounds twice
