"""Next-token choice inside a captured graph: fixed shapes, device RNG, no host sync.

Dims: B batch, V vocabulary.
"""

from __future__ import annotations

import torch


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
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # nucleus: keep the smallest prefix (by probability) whose mass reaches top_p; the top token always stays
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    # Gumbel-max in its exponential form: argmax(p / q), q ~ Exp(1), draws from p with one RNG call
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
