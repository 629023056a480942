"""Cross-layer predictors: which experts will layer l+j route to, known while layer l computes.

Dims: T tokens, H hidden, E experts (of the target layer), E' experts of the source layer l.

- gate: layer l+1's router applied to layer l's MoE input (speculative gating: consecutive layers'
  MoE inputs differ by one residual update, so l+1's router mostly picks the same experts on them).
  Each token nominates its top-p experts; a nominated expert scores the mean probability tokens
  give it. Only for the next layer (docs/decisions.md#gate-lookahead).
- temporal: the experts the target layer routed to in the previous call (decode reuses experts).
- transition: online decayed counts of (expert routed at l+j-1 -> expert routed at l+j); with this
  call's routing at layer l (j = 1) or the target's previous-layer routing of the last call
  (j > 1), the expected share of tokens going to each expert; keeps its top-p.

Scores are in [0, 1] per expert; `combine` ranks the gate's nominations first, then experts the
other predictors back with enough support. All fixed-shape tensor ops. On CUDA all of them run on
the side stream: the gate op reads layer l's hidden states there (the compute stream joins before
freeing them, `ops.gate_join`) and leaves its scores in the target's `gate` buffer; temporal,
transition and `combine` read only persistent buffers and run inside the prefetch op.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import gpu
from ..cache.state import GATE, SOURCES
from ..choices import PREFETCH_BUDGET
from . import scores as score_kernels

# the mean temporal/transition score an expert needs to be prefetched (see `combine`)
MIN_SUPPORT = 0.3
TRANSITION_DECAY = 0.99  # per call: transitions seen ~70 calls ago count half


@dataclass(frozen=True)
class Prefetch:
    """Prefetch settings. `sources`: the predictors; `per_token`: experts each token nominates
    (default: the model's top-k); `budget`: most experts admitted per target layer per call (past
    the first, only as many as start copying within the compute they hide behind, and while they are
    routed often enough); `depth`: layers ahead; `copy_programs`: most Triton programs the
    side-stream copy runs on (None: one per 32 KB block, which floods the SMs the compute needs).

    The defaults, the gate alone and two experts a layer, are measured in
    docs/decisions.md#prefetch-budget and docs/decisions.md#prefetch-sources: a layer's prefetch has
    one layer's compute to hide behind, which one bf16 expert's copy fills and two fp8 ones' do, and
    temporal's nominations are resident already.
    """

    sources: tuple[str, ...] = ("gate",)
    depth: int = 1
    per_token: int | None = None
    budget: int = PREFETCH_BUDGET
    copy_programs: int | None = 32

    def __post_init__(self):
        if isinstance(self.sources, str) or not isinstance(self.sources, (tuple, list)):
            raise TypeError(
                f"prefetch sources must be a tuple of predictor names from {SOURCES}, got "
                f"{self.sources!r}; for one predictor write e.g. sources=('gate',)"
            )
        object.__setattr__(self, "sources", tuple(self.sources))  # a list, kept hashable
        unknown = set(self.sources) - set(SOURCES)
        if unknown or not self.sources:
            raise ValueError(
                f"prefetch sources must be a non-empty subset of {SOURCES}, got {self.sources}"
            )
        for name, what in (
            ("depth", "layers ahead"),
            ("budget", "experts per layer per call"),
            ("per_token", "experts each token nominates; None: the model's top-k"),
            ("copy_programs", "Triton programs of the side-stream copy; None: one per block"),
        ):
            value = getattr(self, name)
            if value is None and name in ("per_token", "copy_programs"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"prefetch {name} must be an int >= 1 ({what}), got {value!r}")
        if self.depth > 1 and set(self.sources) == {"gate"}:
            raise ValueError(
                f"prefetch depth {self.depth} needs temporal or transition in sources: the gate "
                "predicts only "
                f"the next layer (its router on this layer's input)"
            )


def gate_scores(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    per_token: int,
    out: torch.Tensor,
    use_kernel: bool | None = None,
) -> None:
    """x [T, H] (layer l's MoE input), weight [E, H] (layer l+1's router) -> out [E]: the Triton
    kernel for a decode-sized call on CUDA, the reference otherwise."""
    fits = x.shape[0] <= score_kernels.MAX_TOKENS
    if (gpu.available(x) if use_kernel is None else use_kernel) and fits:
        score_kernels.gate_scores_triton(x, weight, bias, per_token, out)
    else:
        gate_scores_reference(x, weight, bias, per_token, out)


def gate_scores_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    per_token: int,
    out: torch.Tensor,
) -> None:
    """Each token's top `per_token` probabilities under the router, averaged over the tokens, into
    `out` [E]."""
    top = gate_top(x, weight, bias, per_token)
    torch.mean(top_scores(top.indices, top.values, weight.shape[0]), dim=0, out=out)


def gate_top(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_token: int):
    """Each token's `per_token` likeliest experts under the router `weight` [E, H] applied to x [T,
    H]: (values: probabilities [T, p], indices [T, p]), likeliest first. What a recorded trace keeps
    of the gate."""
    probs = F.linear(x.to(weight.dtype), weight, bias).float().softmax(dim=-1)  # [T, E]
    return probs.topk(min(per_token, probs.shape[-1]), dim=-1)


def recorded_gate_scores(
    recorded: list[torch.Tensor],
    tokens: int,
    per_token: int,
    out: torch.Tensor,
    use_kernel: bool | None = None,
) -> None:
    """What the gate predicted when a trace was recorded, for the `tokens` rows from its replay
    cursor on, into `out` [E] as `gate_scores` scores them. `recorded`: (ids [N, g], probs [N, g],
    cursor [1]) of the replay. The Triton kernel for a decode-sized call on CUDA, the reference
    otherwise."""
    fits = tokens <= score_kernels.MAX_TOKENS
    if (gpu.available(out) if use_kernel is None else use_kernel) and fits:
        score_kernels.recorded_scores_triton(recorded, tokens, per_token, out)
    else:
        recorded_scores_reference(recorded, tokens, per_token, out)


def recorded_scores_reference(
    recorded: list[torch.Tensor], tokens: int, per_token: int, out: torch.Tensor
) -> None:
    ids, probs, cursor = recorded
    rows = (cursor + torch.arange(tokens, device=ids.device)) % ids.shape[0]
    torch.mean(
        top_scores(ids[rows, :per_token], probs[rows, :per_token], out.shape[0]), dim=0, out=out
    )


def top_scores(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., p] expert ids (-1: none) and their probabilities -> [..., E] float32: each named
    expert's probability, 0 elsewhere. The gate's per-token scores, live (`gate_scores`) or recorded
    in a trace."""
    # column E absorbs the -1s
    scores = torch.zeros(*indices.shape[:-1], num_experts + 1, device=indices.device)
    return scores.scatter_(-1, torch.where(indices >= 0, indices, num_experts), values.float())[
        ..., :-1
    ]


def temporal_scores(routed_last_call: torch.Tensor) -> torch.Tensor:
    """[E] bool -> [E]."""
    return routed_last_call.float()


def transition_scores(
    routed_before: torch.Tensor, transitions: torch.Tensor, keep: int
) -> torch.Tensor:
    """routed_before [E'] bool, transitions [E', E] decayed counts -> [E], the top `keep` of
    them."""
    # P(e here | e' before)
    rows = transitions / transitions.sum(dim=1, keepdim=True).clamp(min=1e-6)
    share = (routed_before.float() @ rows) / routed_before.sum().clamp(min=1)  # [E]
    # ties (a row with one successor gives exactly 1): lower id first
    top = torch.argsort(-share, stable=True)[:keep]
    return torch.zeros_like(share).scatter_(0, top, share[top])


def combine(parts: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(source bit, scores [E])] -> (score [E], bits of the sources that nominated each expert [E]
    int8).

    The gate's nominations rank first (score 1 + gate score); after them come the experts that the
    other predictors back with a mean score of at least MIN_SUPPORT, so the weaker predictors do not
    spend the budget on what the gate would not fetch (docs/decisions.md#combine-gate-first).
    """
    gate = [s for bit, s in parts if bit == GATE]
    others = [(bit, s) for bit, s in parts if bit != GATE]
    score = torch.zeros_like(parts[0][1])
    sources = torch.zeros(score.shape, dtype=torch.int8, device=score.device)
    if others:
        support = torch.stack([s for _, s in others]).mean(dim=0)
        confident = support >= MIN_SUPPORT
        score = torch.where(confident, support, score)
        sources = sum((torch.where(confident & (s > 0), bit, 0) for bit, s in others), sources).to(
            torch.int8
        )
    if gate:
        score = torch.where(gate[0] > 0, 1 + gate[0], score)
        sources = sources | torch.where(gate[0] > 0, GATE, 0).to(torch.int8)
    return score, sources


def observe(
    previous: torch.Tensor,
    routed: torch.Tensor,
    transitions: torch.Tensor,
    use_kernel: bool | None = None,
):
    """Learn expert transitions online: the Triton kernel on CUDA, the reference elsewhere."""
    if gpu.available(transitions) if use_kernel is None else use_kernel:
        score_kernels.observe_triton(previous, routed, transitions, TRANSITION_DECAY)
    else:
        observe_reference(previous, routed, transitions)


def observe_reference(
    previous: torch.Tensor, routed: torch.Tensor, transitions: torch.Tensor
) -> None:
    """transitions [E', E] decays once and adds (routed at the previous layer [E']) x (routed here
    [E])."""
    transitions.mul_(TRANSITION_DECAY).add_(previous[:, None].float() * routed[None, :].float())
