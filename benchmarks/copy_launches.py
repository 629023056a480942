"""The gather copy of every tensor of the experts in one launch against one launch per tensor, each in a CUDA
graph of 16 calls (a step's layers): calls with nothing to copy (every expert resident), and of 1 and 2 experts.
OLMoE-1B-7B's bf16 experts (two tensors) and DeepSeek-V2-Lite's in MXFP4 (weights and scales of two projections).

    python benchmarks/copy_launches.py     # CUDA
"""

import torch
from decode_experts import graph_ms

from asyncmoe.cache.host import PinnedBlock, block_bytes, carve, uva_view
from asyncmoe.kernels.gather_copy import gather_copy_triton

dev = torch.device("cuda")
SHAPES = {
    "olmoe bf16 (2 tensors), M=8": ([((2048, 2048), torch.bfloat16), ((2048, 1024), torch.bfloat16)], 8),
    "deepseek mxfp4 (4 tensors), M=6": (
        [((2816, 1024), torch.uint8), ((2816, 64), torch.uint8), ((2048, 704), torch.uint8), ((2048, 44), torch.uint8)],
        6,
    ),
}
E, C, CALLS = 12, 16, 16


def per_tensor(hosts, slots, src, dst, count):
    for _ in range(CALLS):
        for h, s in zip(hosts, slots):
            gather_copy_triton([h], [s], src, dst, count)


def fused(hosts, slots, src, dst, count):
    for _ in range(CALLS):
        gather_copy_triton(hosts, slots, src, dst, count)


def main():
    for name, (tensors, M) in SHAPES.items():
        nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in tensors)
        specs = [((E, *s), d) for s, d in tensors]
        block = PinnedBlock(block_bytes(specs))
        hosts = carve(uva_view(block, dev), specs)
        slots = [torch.zeros(C, *s, dtype=d, device=dev) for s, d in tensors]
        src, dst = torch.arange(M, device=dev), torch.arange(M, device=dev)
        for n in (0, 1, 2):
            count = torch.full((1,), n, device=dev)
            args = (hosts, slots, src, dst, count)
            t_old, t_new = graph_ms(lambda: per_tensor(*args), 25, 1), graph_ms(lambda: fused(*args), 25, 1)  # noqa: B023
            gb = CALLS * n * nbytes / 1e6
            extra = f"; GB/s {gb / t_old:.1f} -> {gb / t_new:.1f}" if n else ""
            print(
                f"{name}, {n} experts a call: {t_old / CALLS * 1e3:.1f} -> {t_new / CALLS * 1e3:.1f} us a call{extra}"
            )
        # right bytes
        count = torch.full((1,), 2, device=dev)
        gather_copy_triton(hosts, slots, src, dst, count)
        torch.cuda.synchronize()
        ok = all(torch.equal(s[:2].cpu(), h[:2].cpu()) for h, s in zip(hosts, slots))
        print(f"{name}: bytes right {ok}")


if __name__ == "__main__":
    main()
