"""transformers integration: the `"asyncmoe"` experts implementation and the surgery that installs it.

transformers >= 5 keeps a MoE layer's experts as 3-D parameters `[E, ...]` in one module whose class
is decorated with `@use_experts_implementation`; its forward dispatches on
`config._experts_implementation` to `fn(self, hidden_states [T,H], top_k_index [T,k],
top_k_weights [T,k]) -> [T,H]`. We register `"asyncmoe"` there, so routers, shared experts and
everything else stay the model's own, and `generate()`, static caches and torch.compile keep working.
"""

from __future__ import annotations

import functools
import json
import pathlib

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
from transformers.utils.logging import tqdm

from ..cache.expert_cache import ExpertCache
from ..cache.host import PinnedBlock, block_bytes, carve, check_host_memory, human_bytes, uva_view
from ..predict import predictors
from ..predict.predictors import Prefetch
from ..trace.format import Trace
from ..providers import CachedProvider, ExpertWeightProvider, ResidentProvider, link

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
PROVIDER = "asyncmoe"  # attribute of each experts module that holds its provider


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return getattr(self, PROVIDER)(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register("asyncmoe", experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """Modules built by a `@use_experts_implementation` class carry its layout flags."""
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    return all(isinstance(getattr(module, f, None), bool) for f in flags) and hasattr(module, "config")


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


@functools.cache
def supported_families() -> tuple[str, ...]:
    """Model types in the installed transformers whose experts use the experts interface."""
    import transformers

    models = pathlib.Path(transformers.__file__).parent / "models"
    return tuple(
        sorted(
            d.name
            for d in models.iterdir()
            if any("@use_experts_implementation" in f.read_text() for f in d.glob("modeling_*.py"))
        )
    )


def _families_hint() -> str:
    fams = supported_families()
    return f"supported: the {len(fams)} families on transformers' experts interface ({', '.join(fams)})"


def _looks_like_moe(model: nn.Module) -> list[str]:
    """Class names of modules that look like MoE blocks (for an honest 'unsupported' message)."""
    names = {type(m).__name__ for m in model.modules()}
    return sorted(n for n in names if "expert" in n.lower() or "moe" in n.lower())


def top_k_of(config) -> int | None:
    for key in TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = max(value)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check(model: nn.Module, experts: list[tuple[str, nn.Module]], cache) -> None:
    if isinstance(cache, bool) or not isinstance(cache, int):
        raise TypeError(f"cache must be an int (GPU slots per MoE layer), got {type(cache).__name__} {cache!r}")
    if cache <= 0:
        raise ValueError(f"cache={cache}: must be at least the model's top_k (slots per MoE layer)")
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        method = getattr(quant, "quant_method", None) or (quant.get("quant_method") if isinstance(quant, dict) else quant)
        raise ValueError(
            f"this model is quantized ({method}); asyncmoe caches experts stored in "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}. Load it without quantization "
            "(e.g. dtype=torch.bfloat16 and no quantization_config) to use asyncmoe."
        )
    if not experts:
        moe = _looks_like_moe(model)
        if moe:
            raise ValueError(
                f"{type(model).__name__} has MoE layers ({', '.join(moe)}) that do not use transformers' experts "
                f"interface (@use_experts_implementation), so asyncmoe cannot cache them; {_families_hint()}."
            )
        raise ValueError(f"{type(model).__name__} has no MoE layer for asyncmoe to offload; {_families_hint()}.")
    for name, m in experts:
        if isinstance(getattr(m, PROVIDER, None), ExpertWeightProvider):
            raise RuntimeError(f"{name} is already asyncmoe-compiled: call asyncmoe.compile once per model")
        if getattr(m, "_is_expert_parallel", False):
            raise ValueError(f"{name} is expert-parallel; asyncmoe caches all of a layer's experts on one device")
        params = dict(m.named_parameters(recurse=False))
        E = _num_experts(m)
        for pname, p in params.items():
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{name}.{pname} is {p.dtype}; asyncmoe caches experts in "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}. Load the model in one of those dtypes."
                )
            if p.dim() == 0 or p.shape[0] != E:
                raise ValueError(f"{name}.{pname} has shape {tuple(p.shape)}, not [num_experts={E}, ...]")
        top_k = top_k_of(m.config)
        if top_k is not None and cache < min(top_k, E):
            raise ValueError(
                f"cache={cache} is below top_k={top_k}: every token needs its {top_k} experts resident at once; "
                f"use cache>={top_k}"
            )


def _num_experts(m: nn.Module) -> int:
    return (m.gate_up_proj if m.has_gate else m.up_proj).shape[0]


def find_router(model: nn.Module, name: str, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The router beside an experts module: the MoE block's parameter shaped [E, H] (and its [E] bias, if any)."""
    E = _num_experts(experts)
    H = experts.down_proj.shape[-1] if experts.is_transposed else experts.down_proj.shape[-2]
    block = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    for module_name, module in block.named_modules():
        if module is experts or module_name.startswith(name.rpartition(".")[2] + "."):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and tuple(weight.shape) == (E, H):
            bias = module._parameters.get("bias")
            return weight, (bias if bias is not None and tuple(bias.shape) == (E,) else None)
    return None


def _offload(m: nn.Module, num_slots: int, policy: str, device: torch.device, time_stalls: bool) -> ExpertCache:
    """Move the module's expert tensors to the host store and give it a cache of `num_slots` slots."""
    params = dict(m.named_parameters(recurse=False))
    specs = [(p.shape, p.dtype) for p in params.values()]
    if device.type == "cuda":
        nbytes = block_bytes(specs)
        check_host_memory(nbytes, "pinning this layer's experts")
        block = PinnedBlock(nbytes)
        hosts = carve(block.data, specs)
        for host, p in zip(hosts, params.values()):
            host.copy_(p.detach())
        views = carve(uva_view(block, device), specs)
    else:  # a CPU cache reads the parameters where they already are
        check_host_memory(num_slots * block_bytes([(s[1:], d) for s, d in specs]), "the CPU expert slots")
        block, hosts = None, [p.detach() for p in params.values()]
        views = hosts
    for name, host in zip(params, hosts):
        # A plain attribute, not a parameter: `model.to()` must not drag the host store to the GPU,
        # and nothing in the forward reads it. `state_dict` still returns it (see the hook below).
        del m._parameters[name]
        setattr(m, name, host)
    cache = ExpertCache(dict(zip(params, views)), num_slots, policy, time_stalls)
    cache.pinned_block = block  # keeps the registration alive as long as the cache
    m._asyncmoe_offloaded = tuple(params)
    m._register_state_dict_hook(_add_offloaded_to_state_dict)
    return cache


def _add_offloaded_to_state_dict(module, state_dict, prefix, local_metadata):
    for name in module._asyncmoe_offloaded:
        state_dict[prefix + name] = getattr(module, name)
    return state_dict


class Replay(nn.Module):
    """Routes one experts module by a trace layer instead of its router, whose work still runs (realistic cost).

    A device-side cursor walks the trace's tokens (wrapping at its end), so a captured graph replays it too.
    With the trace's gate arrays (`gate_ids`, `gate_probs` [N, g]) it also says what the gate predictor
    predicted for this layer when the trace was recorded (`predict`).
    """

    def __init__(self, ids: torch.Tensor, gate_ids: torch.Tensor | None = None, gate_probs: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("ids", ids, persistent=False)  # [N, k]
        self.register_buffer("cursor", torch.zeros(1, dtype=torch.int64, device=ids.device), persistent=False)
        self.register_buffer("gate_ids", gate_ids, persistent=False)
        self.register_buffer("gate_probs", gate_probs, persistent=False)

    def rows(self, tokens: int) -> torch.Tensor:
        return (self.cursor + torch.arange(tokens, device=self.ids.device)) % self.ids.shape[0]

    def forward(self, top_k_index: torch.Tensor) -> torch.Tensor:
        rows = self.rows(top_k_index.shape[0])
        self.cursor.add_(top_k_index.shape[0])
        return self.ids[rows].to(top_k_index.dtype)

    def predict(self, tokens: int, per_token: int, out: torch.Tensor) -> None:
        """The recorded gate predictor's scores for this layer's next `tokens` rows into `out` [E], as
        `predictors.gate_scores` scores: each token's top `per_token` probabilities, averaged over tokens."""
        rows = self.rows(tokens)
        scores = predictors.top_scores(self.gate_ids[rows, :per_token], self.gate_probs[rows, :per_token], out.shape[0])
        torch.mean(scores, dim=0, out=out)


def _replay_hook(module, args, kwargs):
    """A forward pre-hook, so that hooks registered later (a trace recorder) see the ids actually used."""
    if len(args) > 1:
        return (args[0], module.asyncmoe_replay(args[1]), *args[2:]), kwargs
    return args, {**kwargs, "top_k_index": module.asyncmoe_replay(kwargs["top_k_index"])}


def _install_replay(experts: list[tuple[str, nn.Module]], trace: Trace, device: torch.device) -> None:
    """Model MoE layer i replays trace layer i % trace.layers; expert count and top-k must match. A layer
    whose trace layer is 0 gets no recorded gate scores (nothing predicted trace layer 0 from the one before)."""
    for i, (name, m) in enumerate(experts):
        E, k = _num_experts(m), top_k_of(m.config)
        if trace.num_experts != E or (k is not None and trace.top_k != k):
            raise ValueError(
                f"{name} routes {k} of {E} experts but the trace has {trace.top_k} of {trace.num_experts}: "
                "replay needs the same number of experts and top-k"
            )
        layer = i % trace.layers
        gate = [] if trace.gate_ids is None else [
            torch.as_tensor(trace.gate_ids[:, layer]).to(device=device, dtype=torch.int64),
            torch.as_tensor(trace.gate_probs[:, layer]).to(device=device, dtype=torch.float32),
        ]
        m.asyncmoe_replay = Replay(torch.as_tensor(trace.ids[:, layer]).to(device=device, dtype=torch.int64), *gate)
        m.register_forward_pre_hook(_replay_hook, with_kwargs=True)
        _feed_replayed_gate(m)


def _feed_replayed_gate(m: nn.Module) -> None:
    """Let the gate predictor of the layer before score a replayed layer by the trace's recorded gate."""
    provider, replay = getattr(m, PROVIDER, None), getattr(m, "asyncmoe_replay", None)
    if isinstance(provider, CachedProvider) and replay is not None and replay.gate_ids is not None:
        object.__setattr__(provider, "replayed_gate", replay.predict)


def replay_routing(model: nn.Module, trace: Trace, device: torch.device | str) -> None:
    """Route every MoE layer of `model` (asyncmoe-compiled or not) by `trace` instead of its router; see `Replay`."""
    _install_replay(find_experts(model), trace, torch.device(device))


def rewind_replay(model: nn.Module) -> None:
    """Start every replayed layer at the trace's first token again (eager; a captured graph keeps the cursors)."""
    for _, m in find_experts(model):
        if hasattr(m, "asyncmoe_replay"):
            m.asyncmoe_replay.cursor.zero_()


def install(
    model: nn.Module,
    cache: int,
    policy: str,
    device: torch.device | str | None,
    prefetch: Prefetch | None,
    replay: Trace | None = None,
    time_stalls: bool = False,
) -> nn.Module:
    """Give every experts module of `model` a provider and switch it to the `"asyncmoe"` implementation."""
    experts = find_experts(model)
    _check(model, experts, cache)
    if device is None:
        device = next(iter(experts[0][1].parameters())).device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if time_stalls and device.type != "cuda":
        raise ValueError(
            f"time_stalls reads the GPU's clock, so it needs a CUDA device; this model runs on {device}. "
            "Pass device='cuda', or leave time_stalls off (on the CPU nothing waits: there are no streams)."
        )
    if device.type == "cuda":
        total = sum(block_bytes([(p.shape, p.dtype) for p in m.parameters(recurse=False)]) for _, m in experts)
        on_gpu = sum(p.numel() * p.element_size() for _, m in experts for p in m.parameters(recurse=False) if p.is_cuda)
        # Experts already on the GPU are copied out before their memory is freed: all of it is new host memory.
        check_host_memory(on_gpu, f"pinning the experts of {len(experts)} MoE layers ({human_bytes(total)})")

    cached = []
    for name, m in tqdm(experts, desc="asyncmoe: experts to host memory", unit="layer", disable=len(experts) < 2):
        implementation = m.config._experts_implementation or "eager"
        if cache >= _num_experts(m):
            fn = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, type(m).forward.__wrapped__)
            provider = ResidentProvider(implementation, fn)
            m.to(device)
        else:
            provider = CachedProvider(_offload(m, cache, policy, device, time_stalls), find_router(model, name, m))
            cached.append(provider)
        setattr(m, PROVIDER, provider)
    model.to(device)
    top_k = max((top_k_of(m.config) or 1) for _, m in experts)
    link(cached, prefetch, top_k)
    if replay is not None:
        _install_replay(experts, replay, device)
    for _, m in experts:  # replayed before compile
        _feed_replayed_gate(m)

    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("asyncmoe")
    for _, m in experts:  # plain modules, and composite models whose config heuristics skipped a sub-config
        if m.config._experts_implementation != "asyncmoe":
            m.config._experts_implementation = "asyncmoe"
    return model


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a local checkpoint; every shard its index lists must be there."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a transformers checkpoint: it has no config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} is missing {len(missing)} of the {len(shards)} shards its {index.name} lists "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): download the checkpoint again"
            )
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (asyncmoe loads safetensors checkpoints)")
    return files


def checkpoint_bytes(files: list[pathlib.Path], dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take in `dtype`, from the safetensors headers alone."""
    total = 0
    for f in files:
        with safe_open(f, "pt") as st:
            for key in st.keys():
                total += torch.Size(st.get_slice(key).get_shape()).numel()
    return total * dtype.itemsize


def load(
    path, cache: int, dtype: torch.dtype, device, policy: str, prefetch: Prefetch | None, time_stalls: bool, **kwargs
) -> nn.Module:
    """Load a checkpoint onto the CPU with transformers (its own weight conversions), then install asyncmoe on `device`.

    The experts go from the loaded CPU tensors to pinned host memory layer by layer and never to the GPU.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype={dtype}: asyncmoe runs experts in {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    local = pathlib.Path(path)
    if local.exists():
        needed = checkpoint_bytes(checkpoint_files(local), dtype)
        check_host_memory(needed, f"loading {path} in {dtype}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model = install(model, cache, policy, device, prefetch, time_stalls=time_stalls)
    providers = [getattr(m, PROVIDER) for _, m in find_experts(model)]
    blocks = [p.cache.pinned_block for p in providers if isinstance(p, CachedProvider)]
    where = f"pinned host memory: {human_bytes(sum(b.nbytes for b in blocks if b))}" if any(blocks) else "host memory"
    print(f"asyncmoe: experts of {len(blocks)} of {len(providers)} MoE layers in {where}; {cache} slots per layer on {device}")
    return model


class TraceRecorder:
    """Records the routing of every MoE layer while active: `with record(model) as r: ...; r.trace.save(path)`.

    Hooks run in eager forwards only (a CUDA graph replays kernels, not Python): record with
    `Decoder(graph=False)` or `model.generate`. Tokens of a call are recorded in row-major order
    (batch, then position). Call `new_sequence()` before each sequence to mark `starts`.
    `gate=True` also records the gate predictor's nominations (each token's top-k experts of layer
    l+1's router on layer l's MoE input), so that a replay of the trace can feed the gate predictor.
    """

    def __init__(self, model: nn.Module, gate: bool = False):
        named = find_experts(model)
        if not named:
            raise ValueError(f"{type(model).__name__} has no MoE layer to record; {_families_hint()}")
        self.experts = [m for _, m in named]
        self.routers = [find_router(model, name, m) for name, m in named] if gate else None
        if gate and any(r is None for r in self.routers[1:]):
            raise ValueError(f"{type(model).__name__}: no router weight [E, H] found beside every experts module; "
                             "record without gate=True")
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.experts]
        self.weights: list[list[torch.Tensor]] = [[] for _ in self.experts]
        self.gate: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.experts]  # (ids, probs) per call
        self.starts: list[int] = []
        self.handles = []

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            self.ids[layer].append(ids.detach().to("cpu", torch.int64))  # a host sync: recording is an eager tool
            self.weights[layer].append(weights.detach().to("cpu", torch.float32))
            if self.routers is None:
                return
            k = ids.shape[-1]
            if layer == 0:  # nothing before the first MoE layer predicts it
                self.gate[0].append((torch.full(ids.shape, -1), torch.zeros(ids.shape)))
            if layer + 1 < len(self.experts):
                x = args[0] if args else kwargs["hidden_states"]
                with torch.no_grad():
                    top = predictors.gate_top(x, *self.routers[layer + 1], k)
                # host copies, as above: recording is an eager tool, never in a captured step
                self.gate[layer + 1].append((top.indices.to("cpu", torch.int64), top.values.to("cpu", torch.float32)))

        return hook

    def new_sequence(self) -> None:
        """The next recorded token starts a sequence."""
        self.starts.append(sum(t.shape[0] for t in self.ids[0]))

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(self.experts)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @property
    def trace(self) -> Trace:
        if not self.ids[0]:
            raise ValueError("nothing was recorded: run the model inside `with record(model)`")
        ids = torch.stack([torch.cat(calls) for calls in self.ids], dim=1)  # [N, L, k]
        weights = torch.stack([torch.cat(calls) for calls in self.weights], dim=1)
        gate = {}
        if self.routers is not None:
            gate = {name: torch.stack([torch.cat([call[i] for call in calls]) for calls in self.gate], dim=1).numpy()
                    for i, name in enumerate(("gate_ids", "gate_probs"))}
        return Trace(ids.numpy(), _num_experts(self.experts[0]), starts=self.starts or None, weights=weights.numpy(), **gate)
