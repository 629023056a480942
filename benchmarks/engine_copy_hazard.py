"""Whether a host sync in the main thread stalls the copy thread (kernels/engine_copy) while the GPU waits on it.

    python engine_copy_hazard.py SYNC MODE    # SYNC: none synchronize event tolist item; MODE: graph eager

Twenty calls of one channel copying eight 8 MB experts, each followed by a kernel that reads a slot and by SYNC;
MODE "graph" replays them captured. A stalled thread shows as the wait's timeout: a CUDA error after ~5 s.
One case a process: the timeout's trap leaves the context unusable.
"""

import sys
import time

import torch

from asyncmoe.cache.host import PinnedBlock, carve, uva_view
from asyncmoe.kernels import engine_copy


def main():
    sync, mode = sys.argv[1], sys.argv[2]
    dev = torch.device("cuda")
    E, C, N = 12, 8, 4 << 20
    block = PinnedBlock(E * N * 2)
    hosts = carve(uva_view(block, dev), [((E, N), torch.bfloat16)])
    slots = [torch.zeros(C, N, dtype=torch.bfloat16, device=dev)]
    channel = engine_copy.Channel(hosts, slots, "miss")
    src, dst = torch.arange(C, device=dev), torch.arange(C, device=dev)
    count = torch.full((1,), C, device=dev)
    x, y = torch.ones(4, device=dev), torch.zeros(4, device=dev)

    def call():
        channel.copy(src, dst, count)
        y.copy_(x + slots[0][0, :4].float())

    run = call
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        run = graph.replay
    syncs = {
        "none": lambda: None,
        "synchronize": torch.cuda.synchronize,
        "event": lambda: torch.cuda.current_stream().record_event().synchronize(),
        "tolist": y.tolist,
        "item": lambda: y.sum().item(),
    }
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        for _ in range(20):
            run()
            syncs[sync]()
        torch.cuda.synchronize()
        status = "ok"
    except torch.AcceleratorError as e:
        status = f"FAILED: {str(e).splitlines()[0]}"
    print(f"{mode:<6} {sync:<12} {status}  {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
