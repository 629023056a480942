"""Next-token choice inside a captured graph: fixed shapes, device RNG, no host sync.

Dims: B batch, V vocabulary.
"""

from __future__ import annotations

import numbers

import torch


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """The ranges transformers' sampling warpers accept, with top_p 0 left out (it would keep no
    token)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not temperature > 0
    ):
        raise ValueError(
            f"temperature must be a number > 0 when do_sample=True, got {temperature!r}; "
            "for greedy decoding use do_sample=False"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(
            f"top_k must be an int >= 0 when do_sample=True (0: every token), got {top_k!r}"
        )
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(
            "top_p must be a number in (0, 1] when do_sample=True (1.0: every token), got "
            f"{top_p!r}; "
            "for the single most likely token use do_sample=False"
        )


def sample(
    logits: torch.Tensor,  # [B, V]
    do_sample: bool,
    top_k: int,  # 0: off; an int because it sets a shape
    temperature: torch.Tensor,  # [1]; a tensor so a captured graph serves any value
    top_p: torch.Tensor,  # [1]; 1.0: off
) -> torch.Tensor:  # [B]
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        # top_k > V keeps all, as transformers
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # nucleus: keep the smallest prefix (by probability) whose mass reaches top_p; the top token
    # always stays
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    logits = torch.full_like(logits, float("-inf")).scatter(
        -1, order, sorted_logits.masked_fill(drop, float("-inf"))
    )
    # Gumbel-max in its exponential form: argmax(p / q), q ~ Exp(1), draws from p with one RNG call
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
