"""The custom ops (cache/ops.py, prefetch/ops.py): each passes torch.library.opcheck (schema, fake,
mutation declarations, aot dispatch), each fake states the contract, and on a GPU `ensure` replays
in a CUDA graph."""

import pytest
import torch

from asyncmoe.cache import ops as cache_ops
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.state import GATE, TEMPORAL, TRANSITION, CacheState, Counter
from asyncmoe.cache.streams import SIDE
from asyncmoe.prefetch import ops as prefetch_ops
from asyncmoe.prefetch.state import PrefetchBuffers

BITS = {"gate": GATE, "temporal": TEMPORAL, "transition": TRANSITION}


def clone(ts):
    return [t.clone() for t in ts]  # opcheck runs the op several times on the same arguments


def warm_cache(policy: str) -> ExpertCache:
    cache = ExpertCache({"w": torch.randn(10, 4, 3), "b": torch.randn(10, 4)}, 4, policy)
    cache_ops.ensure(
        cache, torch.tensor([[0, 1], [2, 3]]), 0
    )  # a warm cache, so the ops also evict
    return cache


def ensure_args(cache: ExpertCache, ids: torch.Tensor, wave: int):
    return (
        ids,
        wave,
        False,
        False,
        cache.policy,
        clone(cache.state),
        cache.hosts,
        clone(cache.slots),
    )


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("wave", [0, 1])
def test_ensure_opcheck(policy, wave):
    cache = warm_cache(policy)
    ids = torch.tensor([[4, 5], [6, 1], [7, 8]])
    torch.library.opcheck(torch.ops.asyncmoe.ensure.default, ensure_args(cache, ids, wave))


@pytest.mark.parametrize(
    "predictors", ["gate", "temporal", "gate+temporal+transition", "gate, after a source"]
)
def test_prefetch_opcheck(predictors):
    transition = "transition" in predictors
    cache, p = warm_cache("lru"), PrefetchBuffers(10, torch.device("cpu"), 10 if transition else 0)
    p.gate.copy_(torch.tensor([0.0, 0.9, 0.0, 0.0, 0.5, 0.7, 0.0, 0.0, 0.1, 0.0]))
    if transition:
        p.transitions.copy_(torch.rand(10, 10))
    bits = sum(BITS[p] for p in predictors.split(",")[0].split("+"))
    before = torch.arange(10) % 3 == 0 if transition else None
    source = [warm_cache("lru").routed] if "source" in predictors else []
    state, prefetch_state = clone(cache.state), clone(p.state)
    args = (
        bits,
        2,
        0,
        False,
        "lru",
        state,
        prefetch_state,
        before,
        cache.hosts,
        clone(cache.slots),
        *source,
    )
    torch.library.opcheck(torch.ops.asyncmoe.prefetch.default, args)


def test_the_prefetch_op_admits_into_the_target():
    """`prefetch_ops.prefetch` on the CPU runs inline: the gate's nominations are admitted into the
    cache it is given."""
    cache, p = warm_cache("lru"), PrefetchBuffers(10, torch.device("cpu"))
    p.gate.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.7, 0.0, 0.0, 0.1, 0.0]))
    prefetch_ops.prefetch(cache, p, GATE, 2)
    assert cache.expert_to_slot[[5, 8]].ge(0).all() and cache.counters[Counter.PREFETCHED] == 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("source", [False, True])
def test_gate_scores_opcheck(bias, source):
    x, weight = torch.randn(3, 8), torch.randn(10, 8)
    after = [torch.zeros(10, dtype=torch.bool)] if source else []
    torch.library.opcheck(
        torch.ops.asyncmoe.gate_scores.default,
        (x, weight, torch.randn(10) if bias else None, 4, torch.zeros(10), [], *after),
    )


@pytest.mark.cuda
def test_a_prefetch_forks_at_the_source_decision_and_copies_after_its_copies():
    """The predict stream, forked with a source whose `ensure` has run, waits only for that ensure's
    decision; the copy stream waits for the ensure's copies; and the next prediction does not queue
    behind a prefetch's copies. Here the source's "copies" and then the prefetch's are sleeps of
    about a second."""
    routed = torch.zeros(8, dtype=torch.bool, device="cuda")
    target = torch.full((9,), -1, dtype=torch.int64, device="cuda")  # the target's expert_to_slot
    compute = torch.cuda.current_stream()
    SIDE.stream(routed.device), SIDE.stream(routed.device, "copy")  # created before the timed part
    torch.cuda.synchronize()
    SIDE.mark("decided", routed)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
    SIDE.mark("copied", routed)
    slept = torch.cuda.Event()
    slept.record()
    planned, copying, next_planned = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(SIDE.fork(routed.device, routed)):
        SIDE.planned(target).record()
        planned.record()
    with torch.cuda.stream(SIDE.copier(target, routed, ())):
        copying.record()
        torch.cuda._sleep(2_000_000_000)
    with torch.cuda.stream(SIDE.fork(routed.device, routed)):
        next_planned.record()
    planned.synchronize()
    assert not slept.query(), "the predict stream waited for the source's copies before planning"
    copying.synchronize()
    assert slept.query(), "the copy stream copied before the source's copies were made"
    next_planned.synchronize()
    assert not SIDE.stream(routed.device, "copy").query(), (
        "the next prediction waited for the prefetch's copies"
    )
    torch.cuda.synchronize()
    assert compute.query()


@pytest.mark.cuda
def test_ensure_decides_while_the_prefetch_copies_and_copies_after_it():
    """`ensure(wait=True)` waits for the prefetch into its layer to have planned, not to have
    copied: it decides while the prefetch's copies run and makes its own copies after them. Here the
    prefetch's "copies" are a sleep of about a second on the copy stream."""
    cache = ExpertCache({"w": torch.randn(10, 4, 3, device="cuda")}, 4, "lru")
    side = SIDE.stream(cache.routed.device, "copy")
    cache_ops.ensure(
        cache, torch.tensor([[2, 3]], device="cuda"), 0
    )  # compiles the kernels before the timed part
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        SIDE.planned(cache.expert_to_slot).record()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
        SIDE.ready(cache.expert_to_slot).record()
        slept = torch.cuda.Event()
        slept.record()
    slots = cache_ops.ensure(cache, torch.tensor([[0, 1]], device="cuda"), 0, wait=True)
    SIDE._event("decided", cache.routed).synchronize()
    assert not slept.query(), "ensure waited for the prefetch's copies before deciding"
    SIDE._event("copied", cache.routed).synchronize()
    assert slept.query(), "ensure copied before the prefetch's copies were made"
    torch.cuda.synchronize()
    assert torch.equal(cache.slots[0][slots[0]], cache.hosts[0][[0, 1]])


def test_gate_scores_with_a_recorded_gate_score_what_was_recorded():
    """A replayed layer: the live router runs, and the recorded gate of the rows at the cursor
    replaces it."""
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    ids, probs = (
        torch.tensor([[1, 2], [3, -1], [0, 1]]),
        torch.tensor([[0.6, 0.4], [0.9, 0.0], [0.5, 0.5]]),
    )
    recorded = [ids, probs, torch.tensor([1])]
    torch.library.opcheck(
        torch.ops.asyncmoe.gate_scores.default, (x, weight, None, 2, torch.zeros(4), recorded)
    )
    out = torch.zeros(4)
    torch.ops.asyncmoe.gate_scores(x, weight, None, 2, out, recorded)  # rows 1 and 2
    assert out.tolist() == pytest.approx([0.25, 0.25, 0, 0.45])


def test_gate_join_opcheck():
    torch.library.opcheck(torch.ops.asyncmoe.gate_join.default, (torch.randn(2, 8), torch.zeros(4)))


def test_observe_opcheck():
    previous = torch.tensor([True, False, True])
    routed = torch.tensor([False, True, True, False])
    torch.library.opcheck(torch.ops.asyncmoe.observe.default, (previous, routed, torch.rand(3, 4)))


def fake_args(args):
    mode = torch._subclasses.FakeTensorMode()
    fake = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return mode, tuple([fake(t) for t in a] if isinstance(a, list) else fake(a) for a in args)


def test_fake_states_the_contract():
    cache = ExpertCache({"w": torch.randn(10, 4)}, 2, "lru")
    mode, args = fake_args(ensure_args(cache, torch.zeros(3, 4, dtype=torch.int64), 0))
    with mode:
        with pytest.raises(Exception, match="top_k=4 exceeds the cache's 2 slots.*use cache>=4"):
            torch.ops.asyncmoe.ensure(*args)


@pytest.mark.parametrize(
    "state, message",
    [
        (lambda s: s[:-1], f"state must hold the {len(CacheState._fields)} CacheState tensors"),
        (lambda s: s._replace(pace=torch.zeros(2, dtype=torch.int64)), r"pace must be \[3\]"),
        (lambda s: s._replace(timer=torch.zeros(2, dtype=torch.int64)), "timer must be empty"),
    ],
)
def test_fake_checks_the_state(state, message):
    cache = ExpertCache({"w": torch.randn(10, 4)}, 2, "lru")
    ids = torch.zeros(3, 2, dtype=torch.int64)
    mode, args = fake_args(
        (ids, 0, False, False, "lru", list(state(cache.state)), cache.hosts, cache.slots)
    )
    with mode:
        with pytest.raises(Exception, match=message):
            torch.ops.asyncmoe.ensure(*args)


@pytest.mark.parametrize(
    "bits, budget, before, message",
    [
        (GATE, 3, None, r"prefetch budget 3 must be in 1..2"),
        (GATE, 1, "short", "prefetch_state must hold the 7 PrefetchState tensors"),
        (TRANSITION, 1, None, "the transition predictor needs routed_before"),
        (
            TRANSITION,
            1,
            torch.zeros(7, dtype=torch.bool),
            r"transitions must be \[7, 10\], got \(0, 10\)",
        ),
        (0, 1, None, "prefetch needs a predictor"),
    ],
)
def test_prefetch_fake_checks_its_request(bits, budget, before, message):
    cache, p = (
        ExpertCache({"w": torch.randn(10, 4)}, 2, "lru"),
        PrefetchBuffers(10, torch.device("cpu")),
    )
    state, prefetch_state = list(cache.state), list(p.state)
    if before == "short":
        before, prefetch_state = None, prefetch_state[:-1]
    mode, args = fake_args(
        (bits, budget, 0, False, "lru", state, prefetch_state, before, cache.hosts, cache.slots)
    )
    with mode:
        with pytest.raises(Exception, match=message):
            torch.ops.asyncmoe.prefetch(*args)


@pytest.mark.cuda
@torch.no_grad()
def test_ensure_replays_in_a_cuda_graph_with_new_routing():
    """No host sync on the ensure path: captured once, replayed with routing the capture never
    saw."""
    E, C = 16, 4
    hosts = {"w": torch.randn(E, 64, 32, device="cuda")}
    eager, graphed = ExpertCache(hosts, C, "lru"), ExpertCache(hosts, C, "lru")
    ids = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    out = torch.empty(2, 2, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cache_ops.ensure(
            ExpertCache(hosts, C, "lru"), ids, 0
        )  # warm-up on a throwaway cache (lazy init, autotune)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(cache_ops.ensure(graphed, ids, 0))
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        new = torch.rand(2, E, generator=g).topk(2, dim=-1).indices.cuda()
        ids.copy_(new)
        graph.replay()
        want = cache_ops.ensure(eager, new, 0)
        assert torch.equal(out, want)
        assert torch.equal(graphed.slot_to_expert, eager.slot_to_expert)
        assert torch.equal(graphed.slot_w, eager.slot_w)
    assert (
        torch.equal(graphed.counters, eager.counters) and eager.counters[Counter.MISSES] > 4
    )  # misses happened
