"""Does one GPU's host -> GPU copy slow down while another GPU of the same host copies?

    python benchmarks/h2d_side_by_side.py --out side_by_side.json

The latency suite's parts can run one per GPU on a machine of several GPUs only if the parts do not
share a bottleneck, and every case is bound by its copies. This measures the suite's own H2D figure
(`decode_step.h2d_bandwidth`: a pinned 512 MB `copy_`, median over repeats) on each GPU alone, then on
all GPUs at once: the copies are queued back to back on every GPU before any is waited for, so they
overlap for the whole measurement, a harder case than two suite parts, which copy only part of the time.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def bandwidths(devices: list[int], nbytes: int = 512 * 2**20, reps: int = 20) -> dict[int, float]:
    """GB/s of each device's pinned host -> GPU copies, all devices' copies in flight together."""
    src = {d: torch.empty(nbytes, dtype=torch.uint8).pin_memory() for d in devices}
    dst = {d: torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices}
    events = {d: [] for d in devices}
    for _ in range(reps + 2):
        for d in devices:
            with torch.cuda.device(d):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst[d].copy_(src[d], non_blocking=True)
                b.record()
                events[d].append((a, b))
    for d in devices:
        torch.cuda.synchronize(d)
    return {d: nbytes / 1e9 / (statistics.median(a.elapsed_time(b) for a, b in events[d][2:]) / 1e3) for d in devices}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    devices = list(range(torch.cuda.device_count()))
    alone = {d: bandwidths([d])[d] for d in devices}
    together = bandwidths(devices)
    result = {
        "gpus": [torch.cuda.get_device_name(d) for d in devices],
        "alone_GB_per_s": alone,
        "together_GB_per_s": together,
        "together_over_alone": {d: together[d] / alone[d] for d in devices},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
