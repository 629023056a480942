"""A prompt's streamed waves (cache/stream.py): every pair computed once, from a slot holding its expert's data;
no wave's copies overwrite the wave before it; on CUDA the copy engine on the copy stream, ordered by events."""

import pytest
import torch

from asyncmoe.cache import algorithm
from asyncmoe.cache.expert_cache import ExpertCache
from asyncmoe.cache.host import PinnedBlock, carve, uva_view
from asyncmoe.cache.policies import POLICIES
from asyncmoe.cache.state import Counter
from asyncmoe.cache.stream import streamed_waves

E, ROW = 24, 1024  # experts, floats an expert


def cache_on(
    device: str, slots: int, policy: str = "lru", row: int = ROW
) -> tuple[ExpertCache, torch.Tensor]:
    """A cache of E random experts [E, row] and `slots` slots; on CUDA pinned, read through UVA and copied
    from its host addresses, as `offload` builds it. Returns the cache and the experts on the CPU."""
    data = torch.randn(E, row, generator=torch.Generator().manual_seed(slots))
    if device == "cpu":
        return ExpertCache({"w": data.clone()}, slots, policy), data
    spec = [(data.shape, data.dtype)]
    block = PinnedBlock(data.numel() * 4)
    (host,) = carve(block.data, spec)
    host.copy_(data)
    (view,) = carve(uva_view(block, torch.device(device)), spec)
    cache = ExpertCache({"w": view}, slots, policy, pinned={"w": host})
    cache.pinned_block = block
    return cache, data


def routing(T: int, k: int, reach: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(reach, generator=g)[:k] for _ in range(T)])  # [T, k]


@pytest.mark.parametrize("slots", [1, 2, 4, 7])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_pair_computes_once_from_its_experts_data_and_no_wave_refills_the_one_before(
    slots, policy
):
    cache, data = cache_on("cpu", slots, policy)
    waves, before = [], None
    for seed in range(3):  # a cache warm from the calls before, too
        ids = routing(12, 2, 20 - seed, seed)

        def compute(slot_ids, ids=ids):
            nonlocal before
            held = cache.slots[0]
            on = slot_ids.reshape(-1) >= 0
            experts = ids.reshape(-1)[on]
            assert torch.equal(held[slot_ids.reshape(-1)[on]], data[experts])  # its data, copied in
            if before is not None and slots >= 2:  # the wave before still in its slots
                assert torch.equal(held[before[1]], data[before[0]])
            before = (experts, slot_ids.reshape(-1)[on])
            waves.append(torch.unique(experts).numel())
            return held[slot_ids.reshape(-1).clamp(min=0)]

        waves.clear()
        before = None
        out = streamed_waves(cache, ids, compute)
        assert torch.equal(
            out, data[ids.reshape(-1)]
        )  # every pair, from the wave that holds its expert
        per_wave = max(slots // 2, 1)
        assert max(waves) <= per_wave and sum(waves) == torch.unique(ids).numel()
        resident = cache.expert_to_slot[:E] >= 0
        assert int(resident.sum()) <= slots


def test_streamed_decisions_count_as_the_waves_do():
    """Hits, misses and bytes: the streamed waves' counters, by the same definitions as any wave's."""
    cache, _ = cache_on("cpu", 4)
    ids = routing(16, 2, 10, 0)
    streamed_waves(cache, ids, lambda s: torch.zeros(s.numel(), ROW))
    c = cache.counters
    assert int(c[Counter.CALLS]) == 1 and int(c[Counter.MISSES]) == torch.unique(ids).numel()
    assert int(c[Counter.BYTES_H2D]) == int(c[Counter.MISSES]) * ROW * 4
    # again: the last two waves' experts, in the 4 slots, hit, and go first
    streamed_waves(cache, ids, lambda s: torch.zeros(s.numel(), ROW))
    assert int(c[Counter.HITS]) == 4 and int(c[Counter.CALLS]) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("slots", [2, 8])
def test_on_the_gpu_the_copy_stream_fills_what_each_wave_reads(slots):
    """16 MB experts, so that a copy not waited for would be read half made."""
    cache, data = cache_on("cuda", slots, row=4 * 2**20)
    ids = routing(64, 2, E, 1).cuda()
    torch.cuda.synchronize()
    out = streamed_waves(cache, ids, lambda s: cache.slots[0][s.reshape(-1).clamp(min=0)] * 1.0)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), data[ids.reshape(-1).cpu()])
    assert algorithm.wave_capacity(slots, True) == slots // 2
