"""from_pretrained on the GPU at a real shape: an OLMoE-1B-7B-shaped checkpoint (~13 GB bf16) on local disk.

The load runs in a fresh process so that its peak GPU memory and peak host RSS are its own.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.cuda

LOAD = textwrap.dedent(
    """
    import json, resource, sys, time, torch, asyncmoe
    path, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2])).cuda()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = asyncmoe.from_pretrained(path, cache=16, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak_gpu = torch.cuda.max_memory_allocated()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = asyncmoe.Decoder(model, 1, ids.shape[1] + 32).generate(ids, 32).tokens[0].tolist()
    print("RESULT", json.dumps(dict(seconds=seconds, peak_gpu=peak_gpu, peak_rss=peak_rss, tokens=tokens)))
    """
)


@torch.no_grad()
def test_olmoe_checkpoint_loads_without_its_experts_on_the_gpu(tmp_path):
    sys.path.insert(0, "benchmarks")
    from decode_step import build

    import asyncmoe

    resident = build("olmoe")
    ckpt_bytes = sum(p.numel() * p.element_size() for p in resident.parameters())
    experts_bytes = sum(p.numel() * p.element_size() for n, p in resident.named_parameters() if ".experts." in n)
    resident_gpu = torch.cuda.memory_allocated()
    ids = torch.randint(1, 50304, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    want = asyncmoe.Decoder(resident, 1, 48).generate(ids, 32).tokens[0].tolist()
    resident.save_pretrained(tmp_path, max_shard_size="2GB")
    del resident
    torch.cuda.empty_cache()

    run = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path), json.dumps(ids.tolist())], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.split("RESULT ")[-1])
    shard = max(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    print(
        f"\ncheckpoint {ckpt_bytes / 2**30:.2f} GiB (experts {experts_bytes / 2**30:.2f} GiB, largest shard "
        f"{shard / 2**30:.2f} GiB); load {got['seconds']:.1f} s = {ckpt_bytes / 1e9 / got['seconds']:.2f} GB/s disk -> "
        f"pinned; peak GPU {got['peak_gpu'] / 2**30:.2f} GiB vs resident {resident_gpu / 2**30:.2f} GiB "
        f"({100 * got['peak_gpu'] / resident_gpu:.1f}%); peak host RSS {got['peak_rss'] / 2**30:.2f} GiB "
        f"({got['peak_rss'] / experts_bytes:.2f} x the experts)"
    )
    assert got["peak_gpu"] < 0.4 * resident_gpu
    assert got["peak_rss"] <= 1.1 * experts_bytes + shard + 2**30  # + the non-expert weights' ~1 GB and the CUDA context
    assert got["tokens"] == want
