"""The CPU expert kernels (asyncmoe/compute/cpu/experts.c) against their plain-torch reference, for every format,
layout, gate and activation, each instruction-set path this host can run, and 1 and 2 threads; and against real
transformers experts modules."""

from __future__ import annotations

import pytest
import torch

from asyncmoe.compute.cpu import reference
from asyncmoe.compute.cpu.kernels import ACTS, CpuExperts, Pool, Projection, experts_mlp, library
from asyncmoe.formats import FP8, Fp8, Int4, Mxfp4
from asyncmoe.integrations.offload import host_specs, store

from models import tiny

FORMATS = ["f32", "bf16", "f16", "fp8", "mxfp4", "int4"]
DENSE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
GATES = [("halves", "silu"), ("gpt_oss", "silu"), ("none", "silu"), ("none", "gelu")]


def isas() -> list[str]:
    """The native build and each narrower path the host can also run (AVX-512 without BF16 and AVX2 under AVX-512
    with BF16, AVX2 under AVX-512, plain C), and AVX512-BF16's 4-bit path as plain C where the host has AVX2."""
    native = library("native").amc_isa().decode()
    return (
        ["native"]
        + (["avx512"] if native == "avx512-bf16" else [])
        + (["avx2"] if native.startswith("avx512") else [])
        + (["scalar"] if native != "scalar" else [])
        + (["pairs-emulated"] if native != "scalar" else [])
    )


_pools: dict[tuple[str, int], Pool] = {}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The references' small torch ops: one thread, not torch's pool contending with the kernels' threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=isas())
def isa(request):
    return request.param


def pool(isa: str, threads: int) -> Pool:
    if (isa, threads) not in _pools:
        _pools[isa, threads] = Pool(threads, spin_us=50, isa=isa)
    return _pools[isa, threads]


def stored(
    fmt: str,
    E: int,
    N: int,
    K: int,
    transposed: bool,
    bias: bool,
    gen: torch.Generator,
    block: tuple[int, int] = (16, 24),
) -> Projection:
    """Random stored tensors of a projection: every code of the format, scales that keep outputs near 1; fp8 in
    `block`s (the default: several a row and a column, the last ones partial, none of whole 32s)."""
    bias_dtype = DENSE.get(fmt, torch.bfloat16)
    b = (torch.randn(E, N, generator=gen) * 0.1).to(bias_dtype) if bias else None
    shape = (E, K, N) if transposed else (E, N, K)
    if fmt in DENSE:
        return Projection(
            (torch.randn(shape, generator=gen) / K**0.5).to(DENSE[fmt]), None, b, None, transposed
        )
    if fmt == "fp8":
        codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # 0x7F and 0xFF are NaN
        rows, cols = shape[1:]
        scales = torch.rand(E, -(-rows // block[0]), -(-cols // block[1]), generator=gen) / (
            50 * K**0.5
        )
        return Projection(codes.view(FP8), scales, b, Fp8(block), transposed)
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    if fmt == "mxfp4":
        scales = torch.randint(121, 125, (E, N, K // 32), generator=gen, dtype=torch.uint8)
        return Projection(packed, scales, b, Mxfp4())
    scales = (torch.rand(E, N, K // 32, generator=gen) * 0.3 / K**0.5).to(torch.bfloat16)
    return Projection(packed, scales, b, Int4())


def random_layer(fmt, transposed, gate, act, bias, E=4, H=37, I=45, seed=0) -> CpuExperts:
    if fmt in ("mxfp4", "int4"):
        H, I = 96, 64  # K a multiple of the group for both projections
    gen = torch.Generator().manual_seed(seed)
    up = stored(fmt, E, I if gate == "none" else 2 * I, H, transposed, bias, gen)
    return CpuExperts(up, stored(fmt, E, H, I, transposed, bias, gen), gate, act)


def batches(E: int, H: int, gen: torch.Generator):
    """(x, token_ids, expert_ids): one token and its top-3; ten tokens of top-2, an expert taking more pairs than a
    weight read serves, in shuffled order; x in each dtype the kernels read."""
    yield (
        torch.randn(1, H, generator=gen),
        torch.zeros(3, dtype=torch.int64),
        torch.tensor([2, 0, 3]),
    )
    T = 10
    tokens = torch.arange(T).repeat(2)
    experts = torch.cat(
        [torch.zeros(T, dtype=torch.int64), torch.randint(1, E, (T,), generator=gen)]
    )
    order = torch.randperm(2 * T, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):
        yield torch.randn(T, H, generator=gen).to(dtype), tokens[order], experts[order]


def flip_slack(layer: CpuExperts, x, token_ids, expert_ids) -> torch.Tensor:
    """[P, H]: how far the outputs can move where both sides round the activation to bf16 (bf16 inputs) and a
    last-bit difference before the rounding sends an activation a_j, near a midpoint between two bf16 values, to
    the other one: every output n of its pair moves by |w[n, j]| times that bf16 step."""
    t, e = token_ids.long(), expert_ids.long()
    a = reference.activate(layer, reference.linear(layer.up, x.float()[t], e))
    bits = a.abs().view(torch.int32) & ~0xFFFF  # a's magnitude truncated to bf16
    low, high = bits.view(torch.float32), (bits + 0x10000).view(torch.float32)
    step = high - low
    near = ((a.abs() - low) / step - 0.5).abs() < 1e-2  # within 1% of a step from the midpoint
    w = reference.dense(layer.down)[e].abs()  # [P, H, I]
    return torch.einsum("phi,pi->ph", w, (near * step).float())


def check(layer: CpuExperts, x, token_ids, expert_ids, p: Pool) -> None:
    out = experts_mlp(layer, x, token_ids, expert_ids, p)
    ref = reference.experts_mlp(layer, x, token_ids, expert_ids)
    atol = 2e-5 * (ref.abs().max().item() + 1e-6)
    if x.dtype != torch.bfloat16:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=atol)
        return
    bound = atol + 1e-4 * ref.abs() + 1.01 * flip_slack(layer, x, token_ids, expert_ids)
    excess = (out - ref).abs() - bound
    assert excess.max().item() <= 0, (
        f"{(excess > 0).sum().item()} outputs past their bound, worst by {excess.max()}"
    )


CASES = [(f, t) for f in FORMATS for t in (False, True) if not (t and f in ("mxfp4", "int4"))]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gate,act", GATES)
@pytest.mark.parametrize("fmt,transposed", CASES)
def test_matches_reference(isa, fmt, transposed, gate, act, threads):
    gen = torch.Generator().manual_seed(1)
    for bias in (False, True):
        layer = random_layer(fmt, transposed, gate, act, bias)
        for x, token_ids, expert_ids in batches(layer.num_experts, layer.hidden, gen):
            check(layer, x, token_ids, expert_ids, pool(isa, threads))


@pytest.mark.parametrize("gate", ["halves", "none"])
@pytest.mark.parametrize("act", list(ACTS))
def test_activations(isa, act, gate):
    gen = torch.Generator().manual_seed(2)
    layer = random_layer("bf16", False, gate, act, bias=True)
    for x, token_ids, expert_ids in batches(layer.num_experts, layer.hidden, gen):
        check(layer, x, token_ids, expert_ids, pool(isa, 2))


@pytest.mark.parametrize(
    "fmt,transposed,block", [("bf16", False, None), ("f16", True, None), ("fp8", False, (128, 128)),
                             ("fp8", True, (128, 128)), ("mxfp4", False, None), ("int4", False, None)]
)  # fmt: skip
def test_long_rows_and_wide_tiles(isa, fmt, transposed, block):
    """K above the decode segment (2048) and N above the transposed tile (512); fp8's default blocks, partial."""
    gen = torch.Generator().manual_seed(3)
    E, H, I = 2, 2112, 320
    up, down = (stored(fmt, E, n, k, transposed, True, gen) for n, k in ((2 * I, H), (H, I)))
    if block is not None:  # re-derive scales for the default block from real weights
        w = torch.randn(E, *up.weight.shape[1:], generator=gen) / H**0.5
        q, s = Fp8(block).quantize(w, transposed)
        up = Projection(q, s, up.bias, Fp8(block), transposed)
    layer = CpuExperts(up, down, "gpt_oss" if transposed else "halves")
    x = torch.randn(3, H, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        check(
            layer, x.to(dtype), torch.tensor([0, 1, 2, 2]), torch.tensor([1, 0, 0, 1]), pool(isa, 2)
        )


def test_int4_groups(isa):
    gen = torch.Generator().manual_seed(4)
    for group in (16, 64, 128):
        E, H, I = 3, 256, 128
        projections = []
        for N, K in ((2 * I, H), (H, I)):
            packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(E, N, K // group, generator=gen) * 0.02).to(torch.bfloat16)
            projections.append(Projection(packed, scales, None, Int4(group)))
        layer = CpuExperts(*projections)
        x = torch.randn(2, H, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            check(
                layer, x.to(dtype), torch.tensor([0, 1, 1]), torch.tensor([2, 2, 0]), pool(isa, 2)
            )


@pytest.mark.parametrize("up,down", [("mxfp4", "bf16"), ("bf16", "int4"), ("int4", "fp8")])
def test_mixed_formats(isa, up, down):
    """The 4-bit decoders' input order applies to one projection's inputs, whatever the other's format."""
    gen = torch.Generator().manual_seed(8)
    E, H, I = 4, 96, 64
    layer = CpuExperts(
        stored(up, E, 2 * I, H, False, True, gen), stored(down, E, H, I, False, True, gen)
    )
    for x, token_ids, expert_ids in batches(E, H, gen):
        check(layer, x, token_ids, expert_ids, pool(isa, 2))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "fp8-32", "fp8-64", "bf16"])
def test_pairs_tails(isa, fmt):
    """Projections multiplied in bf16 pairs where the host can, with one bf16 token and several: 4-bit inputs in every
    part of their order (whole 128s, two and then one, a whole 64, a last 32) and ending in a half both ways; fp8 in
    blocks of 32 and of 64 (in runs of 64, a last part of 64 as 32s) and bf16, their inputs ending in a part of
    32."""
    gen = torch.Generator().manual_seed(9)
    fmt, block = fmt.split("-")[0], (16, int(fmt.split("-")[1]) if "-" in fmt else 32)
    E, H, I = 3, (480 if fmt in ("mxfp4", "int4") else 100), 96
    up, down = (stored(fmt, E, n, k, False, True, gen, block) for n, k in ((2 * I, H), (H, I)))
    layer = CpuExperts(up, down)
    for T, k in ((1, 2), (5, 3)):
        x = torch.randn(T, H, generator=gen).bfloat16()
        token_ids = torch.arange(T).repeat_interleave(k)
        expert_ids = torch.randint(0, E, (T * k,), generator=gen)
        check(layer, x, token_ids, expert_ids, pool(isa, 2))


def test_bf16_rows_in_twos_for_many_tokens(isa):
    """bf16 projections of an expert of 16 tokens or more take two rows a pass over the inputs where the host
    multiplies in pairs: an odd share of rows (its last alone), token blocks ending in one and in three, and experts
    of fewer tokens beside them."""
    gen = torch.Generator().manual_seed(10)
    E, H, I = 3, 99, 96
    up, down = (stored("bf16", E, n, k, False, True, gen) for n, k in ((2 * I, H), (H, I)))
    layer = CpuExperts(up, down)
    for counts in ((17, 19, 5), (16, 0, 27)):
        expert_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
        x = torch.randn(len(expert_ids), H, generator=gen).bfloat16()
        check(layer, x, torch.arange(len(expert_ids)), expert_ids, pool(isa, 2))


def test_builds_take_their_paths(isa):
    """Each build is the instruction set it is named for (the emulated pairs path among them)."""
    name = library(isa).amc_isa().decode()
    expected = {
        "avx512": "avx512",
        "avx2": "avx2",
        "scalar": "scalar",
        "pairs-emulated": "avx2-pairs-emulated",
    }
    assert name == expected.get(isa, name)


def test_no_pairs():
    layer = random_layer("bf16", False, "halves", "silu", False)
    out = experts_mlp(
        layer, torch.randn(0, layer.hidden), torch.zeros(0), torch.zeros(0), pool("native", 2)
    )
    assert out.shape == (0, layer.hidden)


# --- against transformers' own experts modules ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss"])
def test_matches_transformers_module(family, dtype):
    """The module's eager forward with one expert per token at routing weight 1 is that expert's MLP."""
    model = tiny(family, dtype=dtype)
    model.set_experts_implementation("eager")
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in experts.parameters():  # large enough that GPT-OSS's clamp at 7 is reached
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if family == "gpt_oss" else 0.2))
    T, H = 12, experts.gate_up_proj.shape[-1 if not experts.is_transposed else -2]
    x = torch.randn(T, H, generator=gen).to(dtype)
    chosen = torch.randint(0, experts.gate_up_proj.shape[0], (T, 1), generator=gen)
    with torch.no_grad():
        expected = experts(x, chosen, torch.ones(T, 1, dtype=dtype)).float()
    weights = {name: p.detach() for name, p in experts.named_parameters()}
    layer = CpuExperts.from_module(experts, weights)
    assert layer.gate == ("gpt_oss" if family == "gpt_oss" else "halves")
    out = experts_mlp(layer, x, torch.arange(T), chosen[:, 0], pool("native", 2))
    # bf16: the module rounds each projection's outputs to bf16, the kernels only the activation between them
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize(
    "fmt", [None, Fp8(), Mxfp4(), Int4()], ids=["dense", "fp8", "mxfp4", "int4"]
)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_host_store_of_a_module(family, fmt):
    """The host store as asyncmoe's offload writes it, in each format, read through from_module."""
    experts = tiny(family, dtype=torch.bfloat16).model.layers[0].mlp.experts
    weights = {
        name: torch.empty(shape, dtype=dtype) for name, shape, dtype in host_specs(experts, fmt)
    }
    store(experts, fmt, weights)
    layer = CpuExperts.from_module(experts, weights, fmt)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, layer.hidden, generator=gen).to(torch.bfloat16)
    check(
        layer,
        x,
        torch.tensor([0, 0, 1, 2, 3, 3]),
        torch.tensor([5, 9, 5, 0, 15, 2]),
        pool("native", 2),
    )


# --- what the kernels refuse ---


def test_refuses_what_it_cannot_compute():
    gen = torch.Generator().manual_seed(7)
    dense = lambda *shape: torch.randn(shape, generator=gen)
    with pytest.raises(ValueError, match="transposed=False"):
        Projection(torch.zeros(2, 8, 16, dtype=torch.uint8), torch.zeros(2, 8, 1, dtype=torch.uint8), fmt=Mxfp4(),
                   transposed=True).check("up")  # fmt: skip
    with pytest.raises(ValueError, match="fp8 needs"):
        Projection(dense(2, 8, 16).to(FP8), torch.ones(2, 2, 2), fmt=Fp8()).check("up")
    with pytest.raises(ValueError, match="read float32, bfloat16 or float16"):
        Projection(dense(2, 8, 16).to(torch.float64)).check("up")
    with pytest.raises(ValueError, match="bias must be"):
        Projection(dense(2, 8, 16), bias=dense(2, 16)).check("up")
    with pytest.raises(ValueError, match="contiguous"):
        Projection(dense(2, 16, 8).transpose(1, 2)).check("up")
    with pytest.raises(ValueError, match="do not make one MLP"):
        CpuExperts(
            Projection(dense(2, 8, 16)), Projection(dense(2, 16, 8))
        )  # halves need N_up = 2I
    with pytest.raises(ValueError, match="act="):
        CpuExperts(Projection(dense(2, 16, 16)), Projection(dense(2, 16, 8)), act="tanh")

    layer = CpuExperts(Projection(dense(4, 16, 16)), Projection(dense(4, 16, 8)))
    p = pool("native", 1)
    with pytest.raises(ValueError, match="expert id"):
        experts_mlp(layer, dense(2, 16), torch.tensor([0, 1]), torch.tensor([0, 4]), p)
    with pytest.raises(ValueError, match="token id"):
        experts_mlp(layer, dense(2, 16), torch.tensor([0, 2]), torch.tensor([0, 1]), p)
    layer._descriptor.up.transposed = 1
    layer._descriptor.up.format = (
        4  # a transposed mxfp4 descriptor, which the Python side never builds
    )
    with pytest.raises(ValueError, match="descriptor refused"):
        experts_mlp(layer, dense(2, 16), torch.tensor([0, 1]), torch.tensor([0, 1]), p)


def test_refuses_modules_it_does_not_know():
    model = tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    weights = {name: p.detach() for name, p in experts.named_parameters()}
    experts.act_fn = torch.nn.Tanh()
    with pytest.raises(ValueError, match="activation"):
        CpuExperts.from_module(experts, weights)

    class OwnGate(type(experts)):
        def _apply_gate(self, gate_up):
            return gate_up[..., ::2]

    experts.__class__ = OwnGate
    with pytest.raises(ValueError, match="its own _apply_gate"):
        CpuExperts.from_module(experts, weights)
