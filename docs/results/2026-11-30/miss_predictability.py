"""Could a predictor have known asyncmoe's misses on `benchmarks/decode_step.py`'s routing? (issue 3, target c)

    PYTHONPATH=. python docs/results/2026-11-30/miss_predictability.py [layers] [steps]   # from the repository root

The OLMoE-1B-7B shape with random weights and routers widened as decode_step.py builds it (bf16 on the
CPU: same shapes and init, not the GPU run's numbers), its 16-token random prompt, greedy decode.
Per MoE layer a 32-slot LRU cache over the calls (the prompt's experts first), and per decode call:
the misses (routed, not resident), and the gate predictor's best case: layer l+1's router on layer l's
MoE input, each token's top-8 (asyncmoe keeps each token's top-p of them, never more than top-k).
Temporal cannot name a miss here: with 32 >= k slots LRU keeps the last call's experts.
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import shapes  # noqa: E402

from asyncmoe.integrations.transformers import find_experts, find_router  # noqa: E402

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
SLOTS, K = 32, 8
shapes.SHAPES["study"] = ("OlmoeConfig", dict(shapes.SHAPES["olmoe-1b-7b"][1], num_hidden_layers=LAYERS))
model = shapes.random_model("study", torch.bfloat16, "cpu")
found = find_experts(model)
routers = [find_router(model, name, m)[0].detach().float() for name, m in found]
calls = [[] for _ in found]  # per layer, per call: (MoE input [T, H] fp32, routed ids [T, k])


def hook(layer):
    def pre(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        calls[layer].append((x.detach().float(), ids.detach().clone()))
    return pre


for i, (_, m) in enumerate(found):
    m.register_forward_pre_hook(hook(i), with_kwargs=True)
prompt = torch.randint(1, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model.generate(prompt, max_new_tokens=STEPS + 1, do_sample=False)

BUDGETS = (1, 2, 4)
by_budget = {b: [0, 0] for b in BUDGETS}  # copies, of them routed
misses = later_misses = caught = nominated = used = routed = 0
for layer in range(len(found)):
    resident: list[int] = []  # LRU order, most recent last
    for call, (x, ids) in enumerate(calls[layer]):
        want = ids.flatten().tolist()
        if call > 0:  # decode calls; the prompt only fills the cache
            miss = {e for e in want if e not in resident}
            routed += len(want)
            misses += len(miss)
            if layer > 0:
                later_misses += len(miss)
                prev_x = calls[layer - 1][call][0]
                prob = (prev_x @ routers[layer].T).softmax(-1)  # [T, E]
                top = prob.topk(K, dim=-1)
                guess = set(top.indices.flatten().tolist())
                fetch = guess - set(resident)  # what the gate would have to copy
                caught += len(miss & guess)
                nominated += len(fetch)
                used += len(fetch & set(want))
                score = prob.mean(0)  # asyncmoe ranks a nomination by its mean probability over tokens
                ranked = sorted(fetch, key=lambda e: -score[e].item())
                for b in BUDGETS:
                    by_budget[b][0] += len(ranked[:b])
                    by_budget[b][1] += len(set(ranked[:b]) & set(want))
        for e in want:  # LRU: move to the end, evict from the front
            if e in resident:
                resident.remove(e)
            resident.append(e)
        del resident[: max(0, len(resident) - SLOTS)]
decode = len(calls[0]) - 1
print(f"OLMoE widths, {len(found)} MoE layers, {decode} decode calls, {SLOTS}-slot LRU: "
      f"hit rate {1 - misses / routed:.3f}, misses per token {misses / decode:.2f}")
print(f"gate predictor (layers 1..), each token's top-{K}: catches {caught} of the misses "
      f"({caught / max(1, later_misses):.1%} of those layers' {later_misses}); names {nominated / decode:.2f} non-resident experts per token, "
      f"{used / max(1, nominated):.1%} of them routed by that call")
for b in BUDGETS:
    print(f"  the {b} likeliest of them per layer: {by_budget[b][0] / decode:.2f} copies per token, "
          f"{by_budget[b][1] / max(1, by_budget[b][0]):.1%} routed by that call ({by_budget[b][1] / max(1, later_misses):.1%} of the misses)")
