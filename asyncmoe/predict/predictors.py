"""Cross-layer predictors: which experts will layer l+j route to, known while layer l computes.

Dims: T tokens, H hidden, E experts (of the target layer), E' experts of the source layer l.

- gate: layer l+1's router applied to layer l's MoE input (speculative gating: consecutive layers'
  MoE inputs differ by one residual update, so l+1's router mostly picks the same experts on them).
  Each token nominates its top-p experts; a nominated expert scores the mean probability tokens
  give it. Only for the next layer.
- temporal: the experts the target layer routed to in the previous call (decode reuses experts).
- transition: online decayed counts of (expert routed at l+j-1 -> expert routed at l+j); with this
  call's routing at layer l (j = 1) or the target's previous-layer routing of the last call
  (j > 1), the expected share of tokens going to each expert; keeps its top-p.

Scores are in [0, 1] per expert; `combine` ranks the gate's nominations first, then experts the
other predictors back with enough support. All fixed-shape tensor ops. The gate runs on the compute
stream (its input, layer l's hidden states, is a compute-stream temporary) and leaves its scores in
the target's `gate` buffer; temporal, transition and `combine` read only persistent buffers and run
inside the prefetch op, on the side stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import predict as predict_kernels

SOURCES = ("gate", "temporal", "transition")  # bit i of a slot's `source`: nominated by SOURCES[i]
GATE, TEMPORAL, TRANSITION = 1, 2, 4
MIN_SUPPORT = 0.3  # the mean temporal/transition score an expert needs to be prefetched (see `combine`)


@dataclass(frozen=True)
class Prefetch:
    """Prefetch settings. `sources`: the predictors (default the gate alone: below);
    `per_token`: experts each token nominates (default: the model's top-k);
    `budget`: most experts admitted per target layer per call; `depth`: layers ahead;
    `copy_programs`: most Triton programs the side-stream copy runs on (None: one per 32 KB block,
    which floods the SMs the compute needs).

    Why a budget of one expert: a layer's prefetch has one layer's compute to hide behind, and the
    next layer's own misses queue behind whatever it copies. On the H200 at batch 1 one OLMoE expert
    (12.6 MB, 0.25 ms at 51 GB/s) about fills one layer's compute (0.26 ms). Replaying the embedded
    model's recorded routing and gate at the OLMoE shape (docs/results/2026-11-30, sixth session),
    budgets 1 / 2 / top-k (8) gave 16.2 / 17.3 / 19.0 ms/token at cache 16 against 17.6 without
    prefetch, and 9.05 / 9.63 / 9.90 against 9.48 at cache 32.

    Why not temporal by default: what the target routed last call is resident (it was just used), so
    temporal never nominates an expert to copy; its only effect is that `prefetch` keeps those experts
    from eviction, and where they fill the slots (cache near top-k) the gate's prefetch then evicts by
    the policy alone, which may take one the gate nominated (without temporal only those are kept).
    On the embedded model's recorded trace (8192 tokens, `asyncmoe.trace.simulate`) gate + temporal +
    transition leaves 4.0% more misses per token than gate + transition at cache 8 of 64, top-8 (28.24
    against 27.15), 1.3% at top-6 (18.08 against 17.85), and 0.0-0.7% at caches 12-32; on the H200
    at the OLMoE shape replaying that trace, 24.42 against 23.69 ms/token at cache 8 (3.0%).

    Why not transition by default: beside the gate at a budget of one it decided no admission on the
    embedded trace (the gate's nomination comes first; the same misses either way), and alone its
    scores stay under MIN_SUPPORT there (on the suite's synthetic Mixtral trace, which has the embedded
    model's cross-layer lift, they pass it for 0.13 fetches per token at 2 of 8 slots, 0.95% of the
    routed experts: docs/routing.md); what it does cost is its `observe` and scoring each call. On the H200 (same run)
    the gate alone moved the same bytes with the same hits as gate + transition at caches 8 and 16,
    and was 0.5% faster at 16 (16.10 against 16.19 ms/token, faster in each of 5 rounds), equal at 8
    (docs/results/2026-11-30, eighteenth session)."""

    sources: tuple[str, ...] = ("gate",)
    depth: int = 1
    per_token: int | None = None
    budget: int = 1
    copy_programs: int | None = 32

    def __post_init__(self):
        unknown = set(self.sources) - set(SOURCES)
        if unknown or not self.sources:
            raise ValueError(f"prefetch sources must be a non-empty subset of {SOURCES}, got {self.sources}")
        if self.depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {self.depth}")
        if self.depth > 1 and set(self.sources) == {"gate"}:
            raise ValueError(f"prefetch depth {self.depth} needs temporal or transition in sources: the gate predicts only "
                             f"the next layer (its router on this layer's input)")
        if self.budget < 1:
            raise ValueError(f"prefetch budget must be >= 1 (experts per layer per call), got {self.budget}")
        if self.copy_programs is not None and self.copy_programs < 1:
            raise ValueError(f"prefetch copy_programs must be >= 1 or None, got {self.copy_programs}")


def gate_scores(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int, out: torch.Tensor,
    use_kernel: bool | None = None,
) -> None:
    """x [T, H] (layer l's MoE input), weight [E, H] (layer l+1's router) -> out [E].

    On CUDA a decode-sized call is one Triton launch (kernels.predict) that writes `out`; this is its reference."""
    if (predict_kernels.use_kernels(x) if use_kernel is None else use_kernel) and x.shape[0] <= predict_kernels.MAX_TOKENS:
        predict_kernels.gate_scores(x, weight, bias, per_token, out)
        return
    top = gate_top(x, weight, bias, per_token)
    torch.mean(top_scores(top.indices, top.values, weight.shape[0]), dim=0, out=out)


def gate_top(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int):
    """Each token's `per_token` likeliest experts under the router `weight` [E, H] applied to x [T, H]:
    (values: probabilities [T, p], indices [T, p]), likeliest first. What a recorded trace keeps of the gate."""
    probs = F.linear(x.to(weight.dtype), weight, bias).float().softmax(dim=-1)  # [T, E]
    return probs.topk(min(per_token, probs.shape[-1]), dim=-1)


def top_scores(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., p] expert ids (-1: none) and their probabilities -> [..., E] float32: each named expert's
    probability, 0 elsewhere. The gate's per-token scores, live (`gate_scores`) or recorded in a trace."""
    scores = torch.zeros(*indices.shape[:-1], num_experts + 1, device=indices.device)  # column E absorbs the -1s
    return scores.scatter_(-1, torch.where(indices >= 0, indices, num_experts), values.float())[..., :-1]


def temporal_scores(routed_last_call: torch.Tensor) -> torch.Tensor:
    """[E] bool -> [E]."""
    return routed_last_call.float()


def transition_scores(routed_before: torch.Tensor, transitions: torch.Tensor, keep: int) -> torch.Tensor:
    """routed_before [E'] bool, transitions [E', E] decayed counts -> [E], the top `keep` of them."""
    rows = transitions / transitions.sum(dim=1, keepdim=True).clamp(min=1e-6)  # P(e here | e' before)
    share = (routed_before.float() @ rows) / routed_before.sum().clamp(min=1)  # [E]
    top = torch.argsort(-share, stable=True)[:keep]  # ties (a row with one successor gives exactly 1): lower id first
    return torch.zeros_like(share).scatter_(0, top, share[top])


def combine(parts: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(source bit, scores [E])] -> (score [E], bits of the sources that nominated each expert [E] int8).

    The gate's nominations rank first (score 1 + gate score); after them come the experts that the
    other predictors back with a mean score of at least MIN_SUPPORT. Why not a plain mean of all: on
    the embedded model's held-out text (cache 16 of 64, measured on the CPU) the mean left 10.96
    demand misses per token and fetched 23.8 experts per token, 11.9 of them never used; the gate
    alone 9.75 and 17.7 (6.7 unused): the weaker predictors (28% of their fetches used) spent the
    budget and evicted what the gate had fetched. Gate first with this threshold: 9.84 and 18.3 (6.9).
    """
    gate = [s for bit, s in parts if bit == GATE]
    others = [(bit, s) for bit, s in parts if bit != GATE]
    score = torch.zeros_like(parts[0][1])
    sources = torch.zeros(score.shape, dtype=torch.int8, device=score.device)
    if others:
        support = torch.stack([s for _, s in others]).mean(dim=0)
        confident = support >= MIN_SUPPORT
        score = torch.where(confident, support, score)
        sources = sum((torch.where(confident & (s > 0), bit, 0) for bit, s in others), sources).to(torch.int8)
    if gate:
        score = torch.where(gate[0] > 0, 1 + gate[0], score)
        sources = sources | torch.where(gate[0] > 0, GATE, 0).to(torch.int8)
    return score, sources
