"""The core on a GPU: pinned host store, UVA view, correctness in fp32 and bf16, GPU memory released."""

import copy
import functools
import gc

import pytest
import torch

import asyncmoe
from asyncmoe import ops
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache import host
from asyncmoe.cache.host import PinnedBlock, carve, uva_view
from asyncmoe.cache.policies import POLICIES
from asyncmoe.integrations.transformers import find_experts

from models import FAMILIES, NUM_EXPERTS, TOP_K, tiny

pytestmark = pytest.mark.cuda
CACHES = [TOP_K, NUM_EXPERTS // 4, NUM_EXPERTS]
SHAPES = [(1, 1), (4, 33), (4, 1), (1, 33), (4, 1), (1, 1)]


def test_pinned_block_and_uva_view():
    specs = [(torch.Size([5, 3, 8]), torch.bfloat16), (torch.Size([5, 7]), torch.float32)]
    block = PinnedBlock(4096)
    hosts = carve(block.data, specs)
    for h in hosts:
        h.copy_(torch.randn(h.shape))
    assert block.data.is_pinned()
    view = uva_view(block, torch.device("cuda"))
    assert view.is_cuda and view.numel() == 4096
    print(f"\nhost pointer {block.data.data_ptr():#x}, device pointer {view.data_ptr():#x}")
    for h, v in zip(hosts, carve(view, specs)):
        assert torch.equal(v.cpu(), h)  # torch ops read host memory through the view
        assert torch.equal(v.index_select(0, torch.tensor([4, 0], device="cuda")).cpu(), h[[4, 0]])
    del hosts, block
    assert view.sum().isfinite()  # the view keeps the registration alive


def test_a_model_collected_during_graph_capture_does_not_break_it():
    """Python's GC may free a dead asyncmoe model mid-capture; unpinning then would invalidate the capture."""
    model = asyncmoe.compile(tiny("olmoe", device="cuda"), cache=TOP_K)
    cycle = [model]
    cycle.append(cycle)  # only the cyclic GC can free it, whenever it happens to run
    del model, cycle
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        gc.collect()  # frees the model's pinned blocks inside the capture
        assert host._deferred  # their unpinning waits
    graph.replay()
    assert torch.equal(y, torch.full_like(x, 2))
    block = PinnedBlock(4096)  # the first pinning after the capture unpins the dead blocks
    assert not host._deferred and block.registered


@functools.cache
def reference(family, dtype):
    return tiny(family, dtype=dtype, device="cuda")


@functools.cache
def exact(family):
    model = tiny(family, dtype=torch.float64, device="cuda")
    model.set_experts_implementation("batched_mm")  # grouped_mm has no float64 CUDA kernel
    return model


def cases():
    for family in FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            for cache in CACHES:
                for policy in sorted(POLICIES) if cache < NUM_EXPERTS and dtype == torch.float32 else ["lfru"]:
                    yield family, dtype, cache, policy


@pytest.mark.parametrize("family, dtype, cache, policy", list(cases()))
@torch.no_grad()
def test_logits_match_unmodified_on_gpu(family, dtype, cache, policy):
    ref = reference(family, dtype)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=cache, policy=policy)
    g = torch.Generator().manual_seed(3)
    for batch, length in SHAPES:
        ids = torch.randint(0, 128, (batch, length), generator=g).cuda()
        ours, theirs = model(ids).logits, ref(ids).logits
        if dtype == torch.float32:
            assert (ours - theirs).abs().max().item() <= 1e-5
        else:  # bf16: as close to the fp64 model as the unmodified bf16 model is
            truth = exact(family)(ids).logits
            ours_err = (ours.double() - truth).abs().max().item()
            their_err = (theirs.double() - truth).abs().max().item()
            assert ours_err <= 1.5 * their_err + 1e-3, f"asyncmoe {ours_err:.3e} vs unmodified {their_err:.3e}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_greedy_generate_identical_on_gpu_fp32(family):
    ref = reference(family, torch.float32)
    model = asyncmoe.compile(copy.deepcopy(ref), cache=TOP_K)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7)).cuda()
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@torch.no_grad()
def test_gpu_memory_drops_by_the_offloaded_bytes():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_experts=64, num_experts_per_tok=8,
    )
    model = OlmoeForCausalLM(config).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    experts = [m for _, m in find_experts(model)]
    offloaded = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    asyncmoe.compile(model, cache=16)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    caches = [m.asyncmoe.cache for m in experts]
    added = sum(b.numel() * b.element_size() for c in caches for n, b in c.named_buffers() if not n.startswith("host_"))
    assert before - after >= offloaded - added - 2**20, (before, after, offloaded, added)
    assert added < offloaded / 3  # 16 of 64 slots plus small tables
    print(f"\nGPU memory: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; experts {offloaded / 2**20:.1f} MiB, slots+tables {added / 2**20:.1f} MiB")
    model(torch.randint(0, 1024, (1, 8), device="cuda"))  # and it still runs


@torch.no_grad()
def test_ensure_replays_in_a_cuda_graph_with_new_routing():
    """No host sync on the ensure path: captured once, replayed with routing the capture never saw."""
    E, C = 16, 4
    hosts = {"w": torch.randn(E, 64, 32, device="cuda")}
    eager, graphed = ExpertCache(hosts, C, "lru"), ExpertCache(hosts, C, "lru")
    ids = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    out = torch.empty(2, 2, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.ensure(ExpertCache(hosts, C, "lru"), ids, 0)  # warm-up on a throwaway cache (lazy init, autotune)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ops.ensure(graphed, ids, 0))
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        new = torch.rand(2, E, generator=g).topk(2, dim=-1).indices.cuda()
        ids.copy_(new)
        graph.replay()
        want = ops.ensure(eager, new, 0)
        assert torch.equal(out, want)
        assert torch.equal(graphed.slot_to_expert, eager.slot_to_expert)
        assert torch.equal(graphed.slot_w, eager.slot_w)
    assert torch.equal(graphed.counters, eager.counters) and eager.counters[2] > 4  # misses happened
