"""Does one GPU's host -> GPU copy slow down while another GPU of the same host copies?

    python benchmarks/h2d_side_by_side.py --out side_by_side.json

The latency suite's parts can run one per GPU on a machine of several GPUs only if the parts do not
share a bottleneck, and every case is bound by its copies. This measures the suite's own H2D figure
(`decode_step.h2d_bandwidths`: a pinned 512 MB `copy_`, median of 20) on each GPU alone, then on all GPUs
at once: the copies are queued back to back on every GPU before any is waited for, so they overlap for
the whole measurement, a harder case than two suite parts, which copy only part of the time.
"""

from __future__ import annotations

import argparse
import json

import torch

from decode_step import h2d_bandwidths


def side_by_side(devices: list[int]) -> dict:
    """Each device's H2D GB/s alone, then with every device copying at once."""
    alone = {d: h2d_bandwidths([d], reps=20)[d] for d in devices}
    together = h2d_bandwidths(devices, reps=20)
    return {
        "gpus": [torch.cuda.get_device_name(d) for d in devices],
        "alone_GB_per_s": alone,
        "together_GB_per_s": together,
        "together_over_alone": {d: together[d] / alone[d] for d in devices},
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = side_by_side(list(range(torch.cuda.device_count())))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
