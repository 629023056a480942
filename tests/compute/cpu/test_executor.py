"""`cache=0`: every routed expert computed by the host's CPU (compute/cpu/executor.py).

On the CPU the kernels run in-line; on CUDA the GPU sends each layer's pairs to the worker through
pinned memory and waits for its outputs, inside the captured step. Either way the model must compute
what the slot path computes: greedy tokens equal over 64 steps in float32 activations (eager,
`generate`, the Decoder; its graph on CUDA), logits within the format's tolerance in bf16.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import asyncmoe
from asyncmoe.compute.cpu import request
from asyncmoe.compute.cpu.executor import CpuExecutor
from asyncmoe.compute.experts import combine
from asyncmoe.integrations.transformers import PROVIDER, find_experts

from greedy import GREEDY, STEPS, assert_same_greedy, prompt
from models import TOP_K, tiny


def executor_of(model) -> CpuExecutor:
    return getattr(find_experts(model)[0][1], PROVIDER).executor


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3"])
@torch.no_grad()
def test_cache_0_computes_what_the_model_does(family):
    """SiLU-GLU, GPT-OSS's transposed clamped gate with biases, shared experts beside the routed."""
    model = tiny(family)
    ours = asyncmoe.compile(copy.deepcopy(model), cache=0, cpu_threads=2)
    ids = prompt()
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert_same_greedy(ours, model, ids)


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4", "int4"])
@torch.no_grad()
def test_cache_0_quantized_equals_the_slot_path(quantize):
    model = tiny("olmoe")
    slots = asyncmoe.compile(copy.deepcopy(model), cache=4, quantize=quantize)
    ours = asyncmoe.compile(copy.deepcopy(model), cache=0, quantize=quantize, cpu_threads=2)
    ids = prompt()
    torch.testing.assert_close(ours(ids).logits, slots(ids).logits, atol=1e-4, rtol=1e-4)
    want = slots.generate(ids, **GREEDY)
    assert torch.equal(ours.generate(ids, **GREEDY), want)


def demo_models(device: str = "cpu"):
    """The embedded model (trained: its greedy choices are not near-ties) in float32, as itself and with
    cache=0."""
    from transformers import AutoModelForCausalLM

    path = asyncmoe.demo_model_path()
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    return load().to(device), asyncmoe.compile(load(), cache=0, device=device)


@torch.no_grad()
def test_cache_0_on_the_embedded_model():
    model, ours = demo_models()
    assert_same_greedy(ours, model, torch.tensor([[1, 5, 9, 200, 33, 17]]))


@torch.no_grad()
def test_cache_0_bf16_within_tolerance():
    model = tiny("qwen3_moe", dtype=torch.bfloat16)
    ours = asyncmoe.compile(copy.deepcopy(model), cache=0, cpu_threads=2)
    ids = prompt()
    got, want = ours(ids).logits.float(), model(ids).logits.float()
    assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 2e-2


@torch.no_grad()
def test_cache_0_under_torch_compile_fullgraph():
    model = tiny("olmoe")
    ours = asyncmoe.compile(copy.deepcopy(model), cache=0, cpu_threads=2)
    ids = prompt()
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_the_op_passes_opcheck():
    ours = asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1)
    ex = executor_of(ours)
    x = torch.randn(3, 32)
    idx = torch.tensor([[0, 5], [7, 1], [15, 0]])
    torch.library.opcheck(torch.ops.asyncmoe.cpu_experts, (x, idx, ex.id, 1))


@torch.no_grad()
def test_stats_count_what_the_cpu_computed():
    ours = asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=2)
    ids = prompt()
    ours(ids)
    s = asyncmoe.stats(ours, reset=True)
    T = ids.shape[1]
    for layer in s.layers:
        assert layer.slots == 0 and layer.calls == 1 and layer.hits == 0
        assert 1 <= layer.cpu_experts <= min(16, T * TOP_K) and layer.misses == layer.cpu_experts
        assert layer.cpu_bytes == layer.cpu_experts * layer.expert_bytes
        assert layer.cpu_ns > 0 and layer.cpu_wait_ns is None  # nothing waits on the CPU
        assert layer.bytes_h2d == 0 and layer.host_bytes == 16 * layer.expert_bytes
    assert "cpu exp" in str(s)
    assert asyncmoe.stats(ours).totals["cpu_experts"] == 0  # reset


def test_settings_refuse_what_cache_0_cannot_do():
    model = tiny("olmoe")
    with pytest.raises(ValueError, match="or 0 to compute every routed expert"):
        asyncmoe.compile(model, cache=-1)
    with pytest.raises(ValueError, match="hybrid=False turns off"):
        asyncmoe.compile(model, cache=4, cpu_threads=2, hybrid=False)
    with pytest.raises(
        ValueError, match=r"runs only with hybrid=True .*pass hybrid=True or cache=0"
    ):
        asyncmoe.compile(model, cache=4, cpu_threads=2)
    with pytest.raises(ValueError, match=r"keeps all its experts resident .*leave cpu_threads out"):
        asyncmoe.compile(model, cache=16, cpu_threads=2)
    with pytest.raises(ValueError, match="an int >= 1"):
        asyncmoe.compile(model, cache=0, cpu_threads=0)
    with pytest.raises(ValueError, match="cache=0 has none"):
        asyncmoe.compile(model, cache=0, prefetch=True)
    with pytest.raises(ValueError, match="leave time_stalls out"):
        asyncmoe.compile(model, cache=0, time_stalls=True)
    assert not hasattr(find_experts(model)[0][1], PROVIDER)  # refused before any change


@torch.no_grad()
def test_the_models_of_a_process_share_one_pool():
    """Two models compute on one pool, each correctly while the other's calls come between its
    own; a third asking for another size is refused while they live; the pool goes with them."""
    one, two = tiny("olmoe"), tiny("gpt_oss")
    ours = [asyncmoe.compile(copy.deepcopy(m), cache=0, cpu_threads=2) for m in (one, two)]
    pool = executor_of(ours[0]).pool
    assert executor_of(ours[1]).pool is pool and pool.threads == 2
    with pytest.raises(ValueError, match="share one CPU pool, and the one a live model uses has 2"):
        asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1)
    ids = prompt()
    for t in range(1, ids.shape[1] + 1):  # the two models' calls interleaved
        for model, compiled in zip((one, two), ours):
            got, want = compiled(ids[:, :t]).logits, model(ids[:, :t]).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    alive = weakref.ref(pool)
    del ours, compiled, pool
    gc.collect()
    assert alive() is None
    assert executor_of(asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1)).pool.threads == 1


@torch.no_grad()
def test_wrong_hidden_dtype_is_refused():
    ours = asyncmoe.compile(tiny("olmoe"), cache=0, cpu_threads=1)
    m = find_experts(ours)[0][1]
    idx, w = torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="run the model in the dtype"):
        m(torch.randn(1, 32, dtype=torch.float64), idx, w)


# --------------------------------------------------------------------------------------------------
# CUDA: the worker behind the captured step


def on_the_gpu(model, quantize: str | None):
    """The slot path's model on the GPU (the model itself where dense), and cache=0's."""
    if quantize is None:
        theirs = copy.deepcopy(model).cuda()
    else:
        theirs = asyncmoe.compile(
            copy.deepcopy(model), cache=4, quantize=quantize, device="cuda", hybrid=False
        )
    return theirs, asyncmoe.compile(copy.deepcopy(model), cache=0, quantize=quantize, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("quantize", [None, "fp8", "mxfp4", "int4"])
@torch.no_grad()
def test_cache_0_on_the_gpu_equals_the_slot_path(quantize):
    """float32 activations: 64 greedy tokens equal eager, under generate and in the Decoder's graph;
    the reference is the model itself (dense) or the slot path in the same format."""
    theirs, ours = on_the_gpu(tiny("olmoe"), quantize)
    ids = prompt("cuda")
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    assert_same_greedy(ours, theirs, ids, graph=True)
    s = asyncmoe.stats(ours)
    assert s.totals["cpu_experts"] > 0 and s.totals["cpu_wait_ns"] > 0


@pytest.mark.cuda
@torch.no_grad()
def test_cache_0_on_the_embedded_model_on_the_gpu():
    model, ours = demo_models("cuda")
    ids = torch.tensor([[1, 5, 9, 200, 33, 17]], device="cuda")
    assert_same_greedy(ours, model, ids, graph=True)


@pytest.mark.cuda
@pytest.mark.parametrize("quantize", [None, "fp8", "mxfp4"])
@torch.no_grad()
def test_cache_0_on_the_gpu_in_bf16(quantize):
    theirs, ours = on_the_gpu(tiny("gpt_oss", dtype=torch.bfloat16), quantize)
    ids = prompt("cuda")
    got, want = ours(ids).logits.float(), theirs(ids).logits.float()
    assert (got - want).abs().max() / want.pow(2).mean().sqrt() < 5e-2  # bf16 through the model
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    torch.testing.assert_close(compiled(ids).logits, ours(ids).logits, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@torch.no_grad()
def test_host_syncs_streaming_and_the_profiler_do_not_stall_it():
    """The worker never calls the driver: `.tolist()` and `.item()` right after a replay, the
    streaming callback's sync per token and the torch profiler's CUPTI callbacks leave it running."""
    model = tiny("olmoe")
    ours = asyncmoe.compile(copy.deepcopy(model), cache=0, device="cuda")
    ids = prompt("cuda")
    dec = asyncmoe.Decoder(ours, 1, 80, graph=True)
    want = dec.generate(ids, STEPS).tokens
    streamed = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities):
        got = dec.generate(ids, STEPS, callback=streamed.extend).tokens
    assert torch.equal(got, want) and streamed == want[0, ids.shape[1] :].tolist()
    dec.prefill(ids)
    for _ in range(16):
        dec.decode(1)
        dec.tok.tolist()
        dec.pos.item()
    assert torch.equal(dec.history[:, : ids.shape[1] + 17], want[:, : ids.shape[1] + 17])


@pytest.mark.cuda
@pytest.mark.timing
def test_a_round_trip_is_cheap(capsys):
    """One layer's request of one pair of the tiny model (an expert of 32 x 64: next to no work),
    sent and received inside a CUDA graph: the GPU writes the request, the worker answers, the GPU
    sees it. Median over graph replays of 100 round trips. A request whose pairs are all skipped is
    not sent at all."""
    ours = asyncmoe.compile(tiny("olmoe"), cache=0, device="cuda")
    ex = executor_of(ours)
    x = torch.zeros(1, 32, device="cuda")
    ids = torch.tensor([[0] + [-1] * (TOP_K - 1)], device="cuda")
    out = torch.zeros(TOP_K, 32, device="cuda")

    def trips(n: int):
        for _ in range(n):
            request.send(x, ids, ex.seq, ex.gpu, 0)
            request.receive(ex.seq, ex.gpu, out, ex.fault_view, ex.waited, 0, 10**9)

    request.send(x, torch.full_like(ids, -1), ex.seq, ex.gpu, 0)
    torch.cuda.synchronize()
    assert int(ex.seq) == 0 and int(ex.channel.request) == 0

    trips(2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        trips(100)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 100)
    us = statistics.median(times)
    assert int(ex.channel.done) == int(ex.seq) == 2 + 20 * 100
    with capsys.disabled():
        print(f"\none-pair CPU round trip in a graph: {us:.1f} us (median of 20 x 100)")
    assert us < 30


@pytest.mark.cuda
def test_a_call_with_nothing_for_the_cpu_neither_writes_nor_waits():
    """The hybrid's split gave the CPU no pair: the send writes nothing into the channel but its
    `awake` word, and the merge takes the GPU's rows without waiting, even with the worker stopped
    and a request number it never answered."""
    ours = asyncmoe.compile(tiny("olmoe"), cache=0, device="cuda")
    ex = executor_of(ours)
    ex.settings = dataclasses.replace(ex.settings, timeout_s=2.0)  # a wrong wait fails fast
    ex.worker.close()
    before = ex.channel.buffer.clone()
    x = torch.randn(2, 32, device="cuda")
    skipped = torch.full((2, TOP_K), -1, device="cuda")
    request.send(x, skipped, ex.seq, ex.gpu, 0)
    torch.cuda.synchronize()
    awake = slice(ex.channel.layout.awake, ex.channel.layout.awake + 8)
    assert not torch.equal(ex.channel.buffer[awake], before[awake])
    before[awake] = ex.channel.buffer[awake]
    assert torch.equal(ex.channel.buffer, before)  # not the payload, not the request number
    ex.seq.fill_(1)  # a request the stopped worker never answers
    gpu_out = torch.randn(2 * TOP_K, 32, device="cuda")
    weights = torch.rand(2, TOP_K, device="cuda")
    out = ex.combine(gpu_out, skipped, weights, 0, torch.float32)
    torch.cuda.synchronize()
    assert torch.equal(out, combine(gpu_out, weights, torch.float32)) and int(ex.waited.sum()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_combine_weights_and_sums_the_cpus_rows_and_the_gpus(weights_dtype):
    """The receiving kernel's combine, against `combine` of the rows it picks: the CPU's outputs
    (rounded to bf16) where ids name an expert, the GPU's elsewhere; with fp32 router weights the
    products stay fp32, with bf16 ones they round to bf16, as torch computes them."""
    ours = asyncmoe.compile(tiny("olmoe").to(torch.bfloat16), cache=0, device="cuda")
    ex = executor_of(ours)
    T = 5
    x = torch.randn(T, 32, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 16, (T, TOP_K), device="cuda")
    cpu_out = ex.compute(x, ids, 0)  # every pair's, float32
    ids[0, 0] = ids[2, 1] = ids[3, 0] = ids[3, 1] = -1  # the GPU's pairs
    gpu_out = torch.randn(T * TOP_K, 32, dtype=torch.bfloat16, device="cuda")
    weights = torch.rand(T, TOP_K, device="cuda").to(weights_dtype)
    ex.send(x, ids, 0)
    got = ex.combine(gpu_out, ids, weights, 0, torch.bfloat16)
    rows = torch.where((ids >= 0).reshape(-1, 1), cpu_out.bfloat16(), gpu_out)
    assert torch.equal(got, combine(rows, weights, torch.bfloat16))  # top-2: one sum order
    assert int(ex.waited[0, request.WAITS]) == 2  # compute's request and this one


def failure_in_a_child(body: str) -> str:
    """What a child process printed on running `body` after building the tiny model with `cache=0`
    on the GPU (`model`, its executor `ex`): a trapped CUDA context does not survive. `body` must
    fail as expected; its error is printed after RAISED."""
    setup = f"""
        import dataclasses, sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parents[2])!r})
        import asyncmoe
        from models import tiny
        from asyncmoe.compute.cpu import request
        from asyncmoe.integrations.transformers import PROVIDER, find_experts
        model = asyncmoe.compile(tiny("olmoe"), cache=0, device="cuda")
        ex = getattr(find_experts(model)[0][1], PROVIDER).executor
        try:
    """
    failed = """
        except Exception as e:
            print("RAISED", str(e)[:600])
            sys.exit(0)
        print("NO ERROR")
        sys.exit(1)
    """
    script = textwrap.dedent(setup) + textwrap.indent(textwrap.dedent(body), "    ")
    script += textwrap.dedent(failed)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.cuda
def test_a_refused_request_fails_loudly():
    """An expert id the layer does not have: the worker refuses the request, and the GPU's wait,
    reading only `done`, ends the CUDA context with the worker's reason."""
    printed = failure_in_a_child(
        """
        x = torch.zeros(1, ex.hidden, device="cuda")
        bad = torch.tensor([[ex.layers[0].num_experts + 3]], device="cuda")
        request.send(x, bad, ex.seq, ex.gpu, 0)
        request.receive(ex.seq, ex.gpu, torch.empty_like(x), ex.fault_view, ex.waited, 0, 10**10)
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            ex.check()
        """
    )
    assert "refused request 1 of layer 0 with error 6" in printed, printed


@pytest.mark.cuda
def test_a_wait_past_its_timeout_fails_loudly():
    """The worker stopped: the GPU's wait ends the CUDA context after its timeout, and the Decoder
    says why."""
    printed = failure_in_a_child(
        """
        ex.settings = dataclasses.replace(ex.settings, timeout_s=0.5)
        ex.worker.close()
        ids = torch.randint(3, 128, (1, 4), device="cuda")
        asyncmoe.Decoder(model, 1, 16).generate(ids, 4)
        """
    )
    assert "the GPU waited more than 0.5 s" in printed, printed
