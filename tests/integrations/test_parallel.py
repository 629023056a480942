"""Expert parallelism: asyncmoe on a model that transformers splits over two ranks (gloo, two processes started
by the test), each rank caching its own experts; outputs and greedy tokens equal the single-process model's."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import asyncmoe
from asyncmoe.integrations.transformers import find_experts

from models import tiny

RANKS = 2
CACHE = 3  # of each rank's 8 experts (16 in all); the single-process model gets the same 3 of 16
NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, path: str, port: int, ids: torch.Tensor, folder: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS)
    )
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(RANKS))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        config = asyncmoe.expert_parallel()
        plain = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=config
        )
        with pytest.raises(ValueError, match="prefetch under expert parallelism is not supported"):
            asyncmoe.compile(plain, cache=CACHE, device="cpu", prefetch=True)
        model = asyncmoe.from_pretrained(
            path, cache=CACHE, dtype=torch.float32, device="cpu", distributed_config=config
        )
        with torch.no_grad():
            logits = model(ids).logits
            kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            tokens = model.generate(ids[:1], **kw)
        experts = [m.down_proj.clone() for _, m in find_experts(model)]  # this rank's host store
        own, summed = asyncmoe.stats(model), asyncmoe.stats(model, group=dist.group.WORLD)
        sizes = [[(layer.experts, layer.slots) for layer in s.layers] for s in (own, summed)]
        torch.save(
            dict(
                logits=logits,
                tokens=tokens,
                experts=experts,
                own=own.totals,
                summed=summed.totals,
                sizes=sizes,
            ),
            f"{folder}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_each_rank_caches_its_own_experts(family, tmp_path):
    ref = tiny(family)
    ref.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(RANKS)]
    mp.start_processes(
        _rank,
        args=(str(tmp_path / "model"), _free_port(), ids, str(tmp_path)),
        nprocs=RANKS,
        start_method="spawn",
        join=False,
    ).join()  # the first rank to fail raises here
    got = [torch.load(out, weights_only=False) for out in outs]
    single = asyncmoe.compile(copy.deepcopy(ref), cache=CACHE, device="cpu")
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want_logits, want_tokens = ref(ids).logits, ref.generate(ids[:1], **kw)
        torch.testing.assert_close(single(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(single.generate(ids[:1], **kw), want_tokens)
    per_rank = 16 // RANKS
    for r, g in enumerate(got):
        torch.testing.assert_close(g["logits"], want_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(g["tokens"], want_tokens)
        for (_, m), host in zip(
            find_experts(ref), g["experts"]
        ):  # the rank's experts, and only those
            assert torch.equal(host, m.down_proj.detach()[r * per_rank : (r + 1) * per_rank])
        assert g["own"]["misses"] > 0  # every rank served some of the pairs
        assert g["sizes"] == [
            [(per_rank, CACHE)] * 2,
            [(16, RANKS * CACHE)] * 2,
        ]  # per rank; summed over ranks
    for key in ("calls", "hits", "misses", "bytes_h2d", "host_bytes", "gpu_bytes"):
        assert got[0]["summed"][key] == sum(g["own"][key] for g in got) == got[1]["summed"][key], (
            key
        )


def test_expert_parallel_config(monkeypatch):
    """One call for the distributed API of every supported transformers: `ep_size` where it exists, else 5.17's
    `enable_expert_parallel`; tensor-parallel dense layers over the same ranks either way."""
    config = asyncmoe.expert_parallel(4)
    assert config.tp_size == 4
    assert getattr(config, "ep_size", None) == 4 or config.enable_expert_parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert asyncmoe.expert_parallel().tp_size == 2
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="launch with `torchrun --nproc-per-node N`"):
        asyncmoe.expert_parallel()
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        asyncmoe.expert_parallel(1)
