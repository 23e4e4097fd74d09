"""Multi-LoRA serving on one base model (guide §16).

A LoRA adapter changes a projection W [out, in] into W + s * B A, with A [r, in], B [out, r], r small and
s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Merging B A into W would give one model per adapter;
serving keeps W once and adds the low-rank update per token instead, so one batch mixes adapters:

    out = x W^T                              the base matmul, once for every token of the step
    out[seg] += (x[seg] A_slot^T) B_slot^T    for each segment of tokens under one adapter: shrink to r, expand

This is Punica's and S-LoRA's SGMV (segmented gather matrix-vector): the engine puts each adapter's tokens side by
side, and the update runs one small matmul pair per segment over the adapters' weights stacked by slot,
A [max_loras, r_max, in] and B [max_loras, out, r_max] (rank zero-padded to max_lora_rank: the padding adds zeros).

The pieces, top to bottom:
    LoRARequest     which adapter a request runs under (vLLM's name and fields)
    load_adapter    reads PEFT's folder (adapter_config.json + adapter_model.safetensors) and checks it against
                    the model; PEFT's fields r, lora_alpha, use_rslora, rank_pattern, alpha_pattern,
                    target_modules are honoured; fan_in_fan_out applies to Conv1D layers only, and a Llama's
                    projections are nn.Linear (PEFT itself turns it off there), so A and B are read as they are
    LoRASlots       max_loras slots of stacked device weights, filled least-recently-used first
    LoRAManager     the host registry of every adapter seen, the slots, and each step's LoRABatch
    sgmv_shrink / sgmv_expand   the torch reference of the two halves (Triton twin: paged/kernels/lora.py)

The model's projections are fused (q, k, v in one matmul, gate and up in another): each target's update lands
on its slice of the fused output. The scheduler admits a request only while the running sequences use at most
max_loras distinct adapters, so every step's adapters fit the slots; the adapter's name and path join each
block's prefix-cache hash (`LoRARequest.cache_key`), so K/V computed under one adapter is never reused under another.
"""

import contextlib
import json
import math
import operator
import os
import re
from dataclasses import dataclass, field

import torch

from paged.kernels import triton_missing
from paged.validation import available_memory, integer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The fused projections of paged.model.llama.LayerWeights and the targets (PEFT's module names) each one holds, in order.
FUSED_TARGETS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGET_MODULES = tuple(m for targets in FUSED_TARGETS.values() for m in targets)
_MODULE_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT saves without the adapter's name)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run a request under: a name, an id >= 1 that stands for it in this engine, and the folder
    PEFT saved it to. The same id must always come with the same name and path. An id given as an integer scalar
    of numpy or torch is kept as the int it stands for (so it keys the registry and the prefix cache as one);
    anything else is refused when a request names the adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        lora_id = self.lora_int_id
        if not isinstance(lora_id, (bool, int)) and hasattr(lora_id, "__index__"):
            try:
                object.__setattr__(self, "lora_int_id", operator.index(lora_id))
            except TypeError:  # a tensor of several elements, say: resolve() names it
                pass

    @property
    def cache_key(self) -> tuple:
        """What joins the prefix-cache hash of every block computed under this adapter: its name and its path, as
        vLLM's `_gen_lora_extra_hash_keys` keys them. Not the id, which is only this engine's number for the adapter:
        two engines that number the same adapter differently still name its blocks alike. The key does not see the
        weights: an adapter rewritten in place and served again under the same name and path meets its old K/V."""
        return "lora", self.lora_name, os.fspath(self.lora_path)


@dataclass
class LoRAAdapter:
    """One adapter read from disk and checked, on the host: for each (layer, target), A [r, in] and s * B [out, r]."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest r over its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class TargetSlice:
    """Where one target lives in the model: its fused projection, its rows in the fused output, its input width."""

    fused: str
    index: int  # position among the fused projection's targets
    offset: int  # first output row in the fused weight
    out_features: int
    in_features: int


def target_slices(model) -> dict[str, TargetSlice]:
    """Each target module's slice of the fused weights of a paged.model.llama.PagedLlama."""
    q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    layer = model.layers[0]
    hidden, intermediate = layer.qkv.shape[1], layer.down.shape[1]
    sizes = {
        "q_proj": q_size,
        "k_proj": kv_size,
        "v_proj": kv_size,
        "o_proj": hidden,
        "gate_proj": intermediate,
        "up_proj": intermediate,
        "down_proj": hidden,
    }
    widths = {"qkv": hidden, "o": q_size, "gate_up": hidden, "down": intermediate}
    slices = {}
    for fused, targets in FUSED_TARGETS.items():
        offset = 0
        for index, module in enumerate(targets):
            slices[module] = TargetSlice(fused, index, offset, sizes[module], widths[fused])
            offset += sizes[module]
    return slices


# ---- reading PEFT's folder ------------------------------------------------------------------------------------


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """adapter_config.json, with the fields serving needs checked; ValueError naming what is wrong."""
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path {path!r} holds no {ADAPTER_CONFIG} (a folder saved by PEFT's save_pretrained)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{ADAPTER_CONFIG} in {path!r} is malformed: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ADAPTER_CONFIG} in {path!r} is malformed: it must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{ADAPTER_CONFIG} in {path!r}: peft_type is {config['peft_type']!r}, only 'LORA' is served")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"{ADAPTER_CONFIG} in {path!r} is malformed: {key} must be a positive number, got {value!r}"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{ADAPTER_CONFIG} in {path!r} is malformed: {key} must be an object")
    unsupported = {
        "use_dora": config.get("use_dora"),
        "modules_to_save": config.get("modules_to_save"),
        "lora_bias": config.get("lora_bias"),
    }
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    for key, value in unsupported.items():
        if value:
            raise ValueError(f"{ADAPTER_CONFIG} in {path!r}: {key}={value!r} is not served (plain LoRA only)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = [t for t in targets if t not in TARGET_MODULES]
        if lacking:
            raise ValueError(
                f"{ADAPTER_CONFIG} in {path!r}: target module {lacking[0]!r} is not one the model "
                f"has (target_modules may name {', '.join(TARGET_MODULES)})"
            )
    elif targets is not None and not isinstance(targets, str):  # a string is a regex, or "all-linear"
        raise ValueError(f"{ADAPTER_CONFIG} in {path!r} is malformed: target_modules must be a list or a string")
    return config


def load_adapter(
    request: LoRARequest, slices: dict[str, TargetSlice], num_layers: int, max_lora_rank: int
) -> LoRAAdapter:
    """Read and check one adapter; raises ValueError (naming the file, the field and the limit) if it cannot be
    served on this model. Returns fp32 host tensors, B already scaled (by lora_alpha / r, lora_alpha / sqrt(r) with
    rsLoRA, per module under alpha_pattern)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(request.lora_path)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} (adapter {request.lora_name!r}) is not a folder")
    config = read_adapter_config(path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise ValueError(f"lora_path {path!r} holds no {ADAPTER_WEIGHTS}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{ADAPTER_WEIGHTS} in {path!r} is malformed: {error}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"{ADAPTER_WEIGHTS} in {path!r}: tensor {key!r} is not a LoRA weight of a layer's "
                f"projection (target modules may be {', '.join(TARGET_MODULES)})"
            )
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or _MODULE_PARENT[module] != parent:
            raise ValueError(
                f"{ADAPTER_WEIGHTS} in {path!r}: target module {parent}.{module!r} is not one the "
                f"model has (target modules may be {', '.join(TARGET_MODULES)})"
            )
        if layer >= num_layers:
            raise ValueError(f"{ADAPTER_WEIGHTS} in {path!r}: layer {layer} is past the model's {num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise ValueError(f"{ADAPTER_WEIGHTS} in {path!r} holds no LoRA weights")
    weights, rank = {}, 0
    for (layer, module), pair in sorted(halves.items()):
        where = f"{ADAPTER_WEIGHTS} in {path!r}, layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: lora_A and lora_B must both be there")
        a, b = pair["A"], pair["B"]
        target = slices[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (target.out_features, r):
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must be "
                f"[r, {target.in_features}] and [{target.out_features}, r]"
            )
        module_key = f"model.layers.{layer}.{_MODULE_PARENT[module]}.{module}"
        config_r = _pattern_value(config.get("rank_pattern") or {}, module_key, config["r"])
        if r != config_r:
            raise ValueError(f"{where}: the weights have rank {r} but {ADAPTER_CONFIG} says r={config_r}")
        if r > max_lora_rank:
            raise ValueError(
                f"adapter {request.lora_name!r} has rank {r} ({module}), more than max_lora_rank "
                f"({max_lora_rank}); raise max_lora_rank"
            )
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module_key, config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(request.lora_name, request.lora_int_id, path, rank, weights)


# ---- the torch reference of shrink and expand (SGMV) ----------------------------------------------------------


@dataclass
class Segments:
    """Runs of consecutive tokens that share an adapter: tokens starts[g]..ends[g]-1 use slot slots[g].
    The host lists drive the torch reference; the int32 tensors [num_segments] and the longest run drive the kernel."""

    starts: list[int]
    ends: list[int]
    slots: list[int]
    start_tensor: torch.Tensor
    end_tensor: torch.Tensor
    slot_tensor: torch.Tensor
    max_len: int

    @classmethod
    def build(cls, runs: list[tuple[int, int, int]], device) -> "Segments | None":
        if not runs:
            return None
        starts, ends, slots = (list(column) for column in zip(*runs))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        return cls(
            starts,
            ends,
            slots,
            as_tensor(starts),
            as_tensor(ends),
            as_tensor(slots),
            max(e - s for s, e in zip(starts, ends)),
        )


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: Segments) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, rank, in] -> y [num_tokens, rank], y[t] = A_slot(t) x[t] on the
    segments' tokens (other rows are left unset: nobody reads them)."""
    y = x.new_empty(x.shape[0], lora_a.shape[1])
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots):
        torch.mm(x[start:end], lora_a[slot].t(), out=y[start:end])
    return y


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, segments: Segments) -> None:
    """y [num_tokens, rank], lora_b [num_slots, out_features, rank]: out [num_tokens, out_features] += B_slot y[t]
    in place on the segments' tokens (out may be a column slice of a fused output)."""
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots):
        out[start:end].addmm_(y[start:end], lora_b[slot].t())


def lora_ops(kernel: str):
    """(shrink, expand): the torch reference ("torch") or the Triton kernels ("triton", paged/kernels/lora.py)."""
    if kernel == "torch":
        return sgmv_shrink, sgmv_expand
    if kernel == "triton":
        from paged.kernels.lora import sgmv_expand as triton_expand
        from paged.kernels.lora import sgmv_shrink as triton_shrink

        return triton_shrink, triton_expand
    raise ValueError(f"lora kernel must be 'torch' or 'triton', got {kernel!r}")


# ---- slots on the device ----------------------------------------------------------------------------------------


class LoRASlots:
    """max_loras slots of adapter weights on the model's device, stacked per layer and fused projection:
    lora_a[layer][fused] [max_loras, num_targets * max_rank, in]   (the targets' A side by side: one shrink)
    lora_b[layer][fused] [max_loras, out_total, max_rank]          (each target's B on its rows of the output)
    A slot is loaded from the host when an adapter is needed and none of the slots holds it, least recently used out."""

    def __init__(self, model, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slices = target_slices(model)
        kwargs = dict(dtype=model.dtype, device=model.device)
        self.lora_a, self.lora_b = [], []
        for layer in model.layers:
            self.lora_a.append(
                {
                    fused: torch.zeros(
                        max_loras, len(targets) * max_rank, self.slices[targets[0]].in_features, **kwargs
                    )
                    for fused, targets in FUSED_TARGETS.items()
                }
            )
            self.lora_b.append(
                {
                    fused: torch.zeros(max_loras, getattr(layer, fused).shape[0], max_rank, **kwargs)
                    for fused in FUSED_TARGETS
                }
            )
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self.slot_weights: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]  # (layer, target) pairs
        self.last_used = [0] * max_loras  # the step that last used each slot
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.lora_a + self.lora_b for t in layer.values())

    @staticmethod
    def nbytes_for(model, max_loras: int, max_rank: int) -> int:
        """The bytes of the slots LoRASlots(model, max_loras, max_rank) allocates, before it does."""
        slices, layer = target_slices(model), model.layers[0]
        per_rank = sum(
            len(targets) * slices[targets[0]].in_features + getattr(layer, fused).shape[0]
            for fused, targets in FUSED_TARGETS.items()
        )  # A's and B's elements per slot and rank
        return len(model.layers) * max_loras * max_rank * per_rank * model.dtype.itemsize

    def targets_of(self, slot: int) -> set[str]:
        """The target modules the adapter in slot has weights for, in any layer."""
        return {module for _, module in self.slot_weights[slot]}

    def slot_of(self, lora_id: int) -> int | None:
        return self.slot_ids.index(lora_id) if lora_id in self.slot_ids else None

    def load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Write the adapter into slot (zeros wherever it has no weights)."""
        if self.slot_ids[slot] is not None:
            self.num_evictions += 1
        self.slot_ids[slot] = None  # until the copy is done
        for layer_a, layer_b in zip(self.lora_a, self.lora_b):
            for fused in FUSED_TARGETS:
                layer_a[fused][slot].zero_()
                layer_b[fused][slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            target, r = self.slices[module], a.shape[0]
            row = target.index * self.max_rank
            self.lora_a[layer][target.fused][slot, row : row + r].copy_(a)
            self.lora_b[layer][target.fused][slot, target.offset : target.offset + target.out_features, :r].copy_(b)
        self.slot_ids[slot] = adapter.int_id
        self.slot_weights[slot] = set(adapter.weights)
        self.num_loads += 1

    def activate(self, needed: list[int], registry: dict[int, LoRAAdapter], keep: set[int], step: int) -> dict:
        """Make every adapter in needed (at most max_loras distinct ids) resident; returns id -> slot.
        A slot to fill is an empty one, else the least recently used one whose adapter this step does not need,
        preferring one no running sequence needs (keep) either."""
        if len(set(needed)) > self.max_loras:  # the scheduler's admission rule keeps this from happening
            raise RuntimeError(f"a step needs {len(set(needed))} adapters but there are {self.max_loras} slots")
        for lora_id in needed:
            if self.slot_of(lora_id) is None:
                free = [s for s, held in enumerate(self.slot_ids) if held not in needed]
                victim = min(
                    free, key=lambda s: (self.slot_ids[s] is not None, self.slot_ids[s] in keep, self.last_used[s])
                )
                self.load(registry[lora_id], victim)
        slots = {lora_id: self.slot_of(lora_id) for lora_id in needed}
        for slot in slots.values():
            self.last_used[slot] = step
        return slots


# ---- one step's adapters, for the forward pass ---------------------------------------------------------------


class LoRABatch:
    """What the forward pass needs to add each token's adapter update: the slots' weights; per fused projection
    and per target, the segments of tokens whose adapter has weights there; and the (layer, target) pairs where
    any of this step's adapters has weights. Everywhere else the slots in use hold zeros, so the update there is
    skipped rather than computed as zero (PEFT's layers_to_transform makes adapters of a few layers only)."""

    def __init__(self, slots: LoRASlots, runs: list[tuple[int, int, int]], shrink, expand, device):
        self.slots, self.shrink, self.expand = slots, shrink, expand
        self.held = set().union(*(slots.slot_weights[slot] for _, _, slot in runs))  # {(layer, target)}
        self.held_fused = {(layer, slots.slices[module].fused) for layer, module in self.held}
        built = {}  # the same runs are built once (adapters often target alike)

        def segments(selected):
            key = tuple(selected)
            if key not in built:
                built[key] = Segments.build(selected, device)
            return built[key]

        targets_of = {slot: slots.targets_of(slot) for _, _, slot in runs}
        self.target_segments = {
            module: segments([run for run in runs if module in targets_of[run[2]]]) for module in TARGET_MODULES
        }
        self.fused_segments = {
            fused: segments([run for run in runs if targets_of[run[2]] & set(targets)])
            for fused, targets in FUSED_TARGETS.items()
        }

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [num_tokens, out_total] (the fused projection of x [num_tokens, in]) += each token's s * B A x."""
        if (layer, fused) not in self.held_fused:  # no adapter of this step has weights here
            return
        segments = self.fused_segments[fused]
        rank = self.slots.max_rank
        y = self.shrink(x, self.slots.lora_a[layer][fused], segments)  # [num_tokens, num_targets * rank]
        lora_b = self.slots.lora_b[layer][fused]
        for module in FUSED_TARGETS[fused]:
            if (layer, module) not in self.held:
                continue
            target = self.slots.slices[module]
            rows = slice(target.offset, target.offset + target.out_features)
            self.expand(
                y[:, target.index * rank : (target.index + 1) * rank],
                lora_b[:, rows],
                out[:, rows],
                self.target_segments[module],
            )


# ---- the engine's side: registry, slots, steps ------------------------------------------------------------------


@dataclass(frozen=True)
class LoRAState:
    """The LoRA slots as an engine step found them (LoRAManager.checkpoint)."""

    num_steps: int
    slot_ids: tuple[int | None, ...]  # the adapter id in each slot
    last_used: tuple[int, ...]
    num_loads: int
    num_evictions: int


class LoRAManager:
    """The host registry (every adapter requested so far, checked and read once), the device slots, and the step
    plumbing: which adapter a request runs under, and the LoRABatch for each forward pass."""

    def __init__(self, model, config, kernel: str | None = None):
        """config: the engine's EngineConfig, whose max_loras and max_lora_rank it checked; only whether the slots
        fit the device's memory is checked here, since that needs the model."""
        self.max_loras, self.max_lora_rank = config.max_loras, config.max_lora_rank
        needed, room = LoRASlots.nbytes_for(model, self.max_loras, self.max_lora_rank), available_memory(model.device)
        if room is not None and needed > room:
            raise ValueError(
                f"max_loras ({self.max_loras}) slots of max_lora_rank ({self.max_lora_rank}) take "
                f"{needed / 2**30:.2f} GiB on {model.device}, more than the {room / 2**30:.2f} GiB "
                f"available; lower max_loras or max_lora_rank"
            )
        self.num_layers = len(model.layers)
        self.device = model.device
        self.slots = LoRASlots(model, self.max_loras, self.max_lora_rank)
        on_gpu_with_triton = model.device.type == "cuda" and not triton_missing()
        self.shrink, self.expand = lora_ops(kernel or ("triton" if on_gpu_with_triton else "torch"))
        self.registry: dict[int, LoRAAdapter] = {}
        self.num_steps = 0

    def resolve(self, lora_request) -> LoRAAdapter:
        """The adapter a request names, read from disk the first time its id is seen; ValueError if it cannot be
        served. Nothing is registered unless every check passed."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        lora_id = integer("lora_int_id", lora_request.lora_int_id)
        if lora_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 means the base model), got {lora_id} (adapter {lora_request.lora_name!r})"
            )
        if not isinstance(lora_request.lora_name, str) or not lora_request.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_request.lora_name!r}")
        if not isinstance(lora_request.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a path (str), got {type(lora_request.lora_path).__name__}")
        known = self.registry.get(lora_id)
        if known is not None:
            if known.name != lora_request.lora_name or known.path != os.fspath(lora_request.lora_path):
                raise ValueError(
                    f"lora_int_id {lora_id} already names adapter {known.name!r} at {known.path!r}; "
                    f"got {lora_request.lora_name!r} at {lora_request.lora_path!r}: one id per adapter"
                )
            return known
        for other in self.registry.values():
            if other.name == lora_request.lora_name:
                raise ValueError(
                    f"lora_name {other.name!r} already has lora_int_id {other.int_id}, "
                    f"got {lora_id}: one id per adapter"
                )
        adapter = load_adapter(lora_request, self.slots.slices, self.num_layers, self.max_lora_rank)
        self.registry[lora_id] = adapter
        return adapter

    @contextlib.contextmanager
    def transaction(self):
        """Adapters registered inside leave the registry again if the block raises (a batch refused as a whole)."""
        before = set(self.registry)
        try:
            yield
        except BaseException:
            for lora_id in set(self.registry) - before:
                del self.registry[lora_id]
            raise

    def checkpoint(self) -> "LoRAState":
        """The adapter in each slot and the counts, as an engine step found them (engine/journal.py)."""
        slots = self.slots
        return LoRAState(
            self.num_steps, tuple(slots.slot_ids), tuple(slots.last_used), slots.num_loads, slots.num_evictions
        )

    def restore(self, record: "LoRAState") -> None:
        """The adapters each slot held before the undone step: one it replaced is loaded again from the host."""
        slots = self.slots
        for slot, lora_id in enumerate(record.slot_ids):
            if slots.slot_ids[slot] != lora_id:
                if lora_id is None:
                    slots.slot_ids[slot] = None  # empty again: whatever it holds is never read
                else:
                    slots.load(self.registry[lora_id], slot)
        self.num_steps, slots.last_used = record.num_steps, list(record.last_used)
        slots.num_loads, slots.num_evictions = record.num_loads, record.num_evictions

    def prepare_step(self, batch: list, running: list) -> tuple[list, LoRABatch]:
        """batch [(sequence, num_new)] in the scheduler's order (`plan.batch`: decodes first, each adapter's
        sequences side by side within the decodes and within the prefills): their adapters made resident, and the
        step's LoRABatch for the forward pass."""
        needed = list(dict.fromkeys(seq.request.lora_int_id for seq, _ in batch if seq.request.lora_int_id))
        self.num_steps += 1
        keep = {seq.request.lora_int_id for seq in running}
        slot_of = self.slots.activate(needed, self.registry, keep, self.num_steps)
        runs, start = [], 0
        for seq, num_new in batch:
            lora_id = seq.request.lora_int_id
            if lora_id and runs and runs[-1][1] == start and runs[-1][2] == slot_of[lora_id]:
                runs[-1] = (runs[-1][0], start + num_new, runs[-1][2])  # extend the run
            elif lora_id:
                runs.append((start, start + num_new, slot_of[lora_id]))
            start += num_new
        return batch, LoRABatch(self.slots, runs, self.shrink, self.expand, self.device)

    def stats(self) -> dict:
        return {
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "registered": sorted(self.registry),
            "slots": list(self.slots.slot_ids),
            "num_loads": self.slots.num_loads,
            "num_evictions": self.slots.num_evictions,
            "slot_bytes": self.slots.nbytes,
        }
