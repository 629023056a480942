"""Copies (misses + prefetches) of a Mixtral-shaped replay (12 layers, 4 of 8 slots, top-2, batch 1, uniform
routing; the gate predictor right 70% or 30% of the time) with the gate at a copy 14.3x the window (H200,
Mixtral shape: 7.46 ms against 0.52), relative to no prefetch; with the counters reset every 33 calls (the
latency suite's rounds: a reset after each prompt) or never. CPU only, 2,000 calls.

    python docs/results/2026-11-30/explore_replay.py <a checkout's root>

Run on four checkouts (explore_replay.txt): main (53ca427); stride (aae41e5: explore every 32 x copy // window
calls); fixonly (53ca427 with `(counters[CALLS] > 0) &` in gate_prefetch's explore); both (e711632).
"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from asyncmoe.cache import expert_cache
from asyncmoe.cache.expert_cache import COUNTERS, ExpertCache
from asyncmoe.predict.predictors import top_scores

def replay(prefetch, right, reset_every, calls=2000, L=12, E=8, C=4, k=2, pace=(0, 520000, 7460000)):
    g = torch.Generator().manual_seed(0)
    caches = [ExpertCache({"w": torch.zeros(E, 0)}, C, "lfru") for _ in range(L)]
    for c in caches:
        c.pace.copy_(torch.tensor(pace))
    total = 0
    n = lambda: sum(c.counters[COUNTERS.index("misses")].item() + c.counters[COUNTERS.index("prefetched")].item() for c in caches)
    for call in range(calls):
        if reset_every and call % reset_every == 0:
            total += n()
            for c in caches:
                c.counters.zero_()
        step = [torch.rand(1, E, generator=g).topk(k, dim=-1).indices for _ in range(L)]
        guess = [torch.where(torch.rand(1, k, generator=g) < right, ids, torch.randint(0, E, (1, k), generator=g)) for ids in step]
        for l, c in enumerate(caches):
            expert_cache.ensure(step[l], 0, c.policy, c.expert_to_slot, c.slot_to_expert, c.state, c.counters, [], [])
            if prefetch and l + 1 < L:
                t = caches[l + 1]
                gate = top_scores(guess[l + 1], torch.full((1, k), 0.5), E).mean(0)
                expert_cache.predict_and_prefetch(gate, False, None, None, 1, t.policy, t.predicted, t.nominated, t.expert_to_slot,
                                                  t.slot_to_expert, t.state, t.counters, [], [], t.outcomes, t.pace)
    return total + n()

for right in (0.7, 0.3):
    for reset in (33, 0):
        alone = replay(False, right, reset)
        print(f"{sys.argv[1].split('/')[-1]:8} predictor right {right}, reset every {reset or 'never':>5}: copies {replay(True, right, reset) / alone:.4f}x no prefetch's")
