"""Next-token choice inside a captured graph: fixed shapes, device RNG, no host sync.

Dims: B batch, V vocabulary.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..settings import check_bool

# each sampling knob: its type, what it must be, and the values sampling accepts
KNOBS = {
    "temperature": (numbers.Real, "a number > 0 and finite", lambda t: 0 < t < math.inf),
    "top_k": (numbers.Integral, "an int >= 0 (0: every token)", lambda k: k >= 0),
    "top_p": (numbers.Real, "a number in (0, 1] (1.0: every token)", lambda p: 0 < p <= 1),
}


def check_sampling(do_sample: bool, temperature: float, top_k: int, top_p: float) -> None:
    """`do_sample` a bool and the knobs numbers whatever the mode; when sampling, in the ranges
    transformers' sampling warpers accept, less top_p 0 (it would keep no token) and an infinite
    temperature (every token alike: the model unread). Greedy decoding ignores their values, as
    transformers' generate does."""
    check_bool("do_sample", do_sample)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        kind, what, accepted = KNOBS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        if do_sample and not accepted(value):
            raise ValueError(
                f"{name} must be {what} when do_sample=True, got {value!r}; for greedy decoding "
                "use do_sample=False"
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
