"""The Llama-family forward pass over HF weights, reading and writing the paged KV cache (guide §5, §7).

transformers supplies the weights (a model object, or a checkpoint folder read by model/checkpoints.py) and the rotary
table; the attention path is ours. One forward call runs a whole engine step: the new tokens of every scheduled
sequence, flattened into one [num_tokens] batch (single-token decodes first, then prefill chunks), so every matmul
sees all of them at once. Attention then splits into a decode call (one query per sequence) and a prefill call (a
ragged chunk per sequence), both over block tables.

Per layer:  x -> RMSNorm -> fused QKV (+ bias) -> (per-head q/k RMSNorm) -> RoPE -> write K,V into the pool
              -> paged attention -> O -> RMSNorm -> fused gate/up -> SiLU * up -> down,   each with a residual add.

That is transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM; what differs
between them (the bracketed steps, the sliding window) is read from their description in model/architectures.py, which
refuses by name a model this forward pass would run wrongly. Every other setting is honoured: any head_dim, tied or
untied embeddings, the static RoPE scalings (linear, dynamic within max_position_embeddings, yarn, llama3), whose
table comes from the model's own rotary module.
"""

import functools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from paged import kernels
from paged.model import attention as torch_attention
from paged.model.architectures import ARCHITECTURES, Architecture, check_supported, head_dim, max_model_len
from paged.model.packed_linear import linear, pack

ATTENTION_BACKENDS = ("cpu", "torch", "triton")


def default_attention_backend(device: torch.device) -> str:
    """The Triton kernels on a GPU, the C++ kernel on a CPU; the torch reference on a GPU without Triton."""
    if device.type == "cpu":
        return "cpu"
    return "torch" if kernels.triton_missing() else "triton"


def check_model(hf_model, argument: str = "model") -> Architecture:
    """The description of a transformers model object; a ValueError naming `argument` and the setting if it is not
    one of the supported architectures in a setting this forward pass runs exactly as transformers does."""
    import transformers
    class_name = type(hf_model).__name__
    for name in ARCHITECTURES:
        if isinstance(hf_model, getattr(transformers, name)):
            class_name = name
    return check_supported(class_name, getattr(hf_model, "config", None), argument)


# PAGED_CHECK_KERNELS=1 in the environment (or this flag set True) runs the kernels' input checks
# (paged/kernels/checks.py) on each step's metadata, once per step; they read the tables back from the device.
CHECK_KERNELS = os.environ.get("PAGED_CHECK_KERNELS", "0") not in ("", "0")


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to. The longest lengths come as
    Python ints, from the lists they were built from, so that no layer reads a tensor back from the device."""
    slot_mapping: torch.Tensor               # int64 [num_tokens]
    num_decode_tokens: int                   # the first num_decode_tokens tokens are one-token decodes
    decode_block_tables: torch.Tensor        # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor        # int32 [num_decodes]
    prefill_block_tables: torch.Tensor       # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor    # int32 [num_prefills + 1]
    prefill_context_lens: torch.Tensor       # int32 [num_prefills]
    decode_max_context_len: int              # max(decode_context_lens), 0 without decodes
    prefill_max_query_len: int               # the longest prefill chunk, 0 without prefills
    prefill_max_context_len: int             # max(prefill_context_lens), 0 without prefills
    checked: bool = field(default=False, repr=False)  # set once the debug checks have passed

    def check(self, q, k, v, key_cache, value_cache) -> None:
        """The kernels' input checks over this step, and that the ints above match the tensors: a ValueError
        naming the argument otherwise. Reads the tables back from the device (hence only under CHECK_KERNELS)."""
        from paged.kernels.checks import check_cache_write, check_decode, check_prefill
        check_cache_write(k, v, key_cache, value_cache, self.slot_mapping)
        if (self.slot_mapping < 0).any():
            raise ValueError("slot_mapping holds -1, but the engine's steps write every token they compute")
        num_decode = self.num_decode_tokens
        found = {}
        if num_decode:
            found["decode_max_context_len"] = check_decode(q[:num_decode], key_cache, value_cache,
                                                           self.decode_block_tables, self.decode_context_lens)
        if num_decode < q.shape[0]:
            found["prefill_max_query_len"] = check_prefill(q[num_decode:], key_cache, value_cache,
                                                           self.prefill_block_tables, self.prefill_query_start_loc,
                                                           self.prefill_context_lens)
            found["prefill_max_context_len"] = int(self.prefill_context_lens.max())
        for name, value in found.items():
            if getattr(self, name) != value:
                raise ValueError(f"AttentionMetadata.{name} is {getattr(self, name)}, but the tensors say {value}")
        self.checked = True


def attention_backend(name: str, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """The three attention operations the forward pass needs (write_kv, decode, prefill), and the name of what
    provides them: the torch reference, the Triton kernels, or the C++ kernel for a CPU (paged/kernels/cpu.py), which
    reads K/V in place in the pool. Three small per-layer ops come along (add_rms_norm, rope, silu_and_mul): in
    torch, or, for fp32 and bf16 on the CPU, fused by the C++ library, with the same bits (the fused RMSNorm only on
    x86 CPUs with AVX2 or AVX-512, where its order of additions is torch's). Where the C++ library
    cannot be built, "cpu" falls back to the torch reference after one warning.

    Every backend takes the same arguments: write_kv(k, v, key_cache, value_cache, slot_mapping);
    decode(q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len);
    prefill(q, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
    max_context_len). None checks its inputs (the engine's tables are valid; see CHECK_KERNELS), and none reads a
    tensor back from the device: the longest lengths come from AttentionMetadata."""
    if name == "cpu":
        from paged.kernels import cpu
        ops = cpu.load()  # compiled on first use, then cached; None (after a warning) where it cannot be
        if ops is not None:
            def cpu_decode(q, kc, vc, tables, lens, scale, max_context_len):  # its loops stop at each length
                return ops.decode(q, kc, vc, tables, lens, scale)

            def cpu_prefill(q, kc, vc, tables, query_start_loc, lens, scale, max_query_len, max_context_len):
                return ops.prefill(q, kc, vc, tables, query_start_loc, lens, scale)

            fused = dtype in (torch.float32, torch.bfloat16)     # the dtypes the fused layer ops are written for
            # the fused RMSNorm adds in the order of torch's sum on an x86 CPU with AVX2 (or AVX-512)
            fused_norm = fused and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            return SimpleNamespace(name="cpu", write_kv=ops.reshape_and_cache, decode=cpu_decode, prefill=cpu_prefill,
                                   add_rms_norm=ops.rms_norm if fused_norm else add_rms_norm,
                                   rope=ops.rotary if fused else apply_rope,
                                   silu_and_mul=ops.silu_and_mul if fused else silu_and_mul)
        name = "torch"
    if name == "torch":
        return SimpleNamespace(name="torch", write_kv=functools.partial(torch_attention.write_kv, may_skip=False),
                               decode=torch_attention.decode_attention, prefill=torch_attention.prefill_attention,
                               add_rms_norm=add_rms_norm, rope=apply_rope, silu_and_mul=silu_and_mul)
    if name == "triton":
        if kernels.triton_missing():
            raise ValueError(f"attention_backend 'triton': {kernels.triton_missing()}; use 'cpu' or 'torch'")

        def triton_decode(q, kc, vc, tables, lens, scale, max_context_len):
            return kernels.launch_decode(q, kc, vc, tables, lens, scale, max_context_len)

        def triton_prefill(q, kc, vc, tables, query_start_loc, lens, scale, max_query_len, max_context_len):
            return kernels.launch_prefill(q, kc, vc, tables, query_start_loc, lens, scale, max_query_len)

        return SimpleNamespace(name="triton", write_kv=kernels.write_cache, decode=triton_decode,
                               prefill=triton_prefill, add_rms_norm=add_rms_norm, rope=apply_rope,
                               silu_and_mul=silu_and_mul)
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As LlamaRMSNorm (x * rsqrt(mean(x^2) + eps) * weight), in one fused op; bit-equal to HF's in fp32."""
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta (the residual add, in place; skipped when delta is None), then rms_norm(hidden): vLLM's
    fused_add_rms_norm, written in torch."""
    if delta is not None:
        hidden += delta
    return rms_norm(hidden, weight, eps)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """HF's sin table [positions, head_dim] with its first half negated, for apply_rope."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos and signed_sine(sin) [num_tokens, head_dim], HF's tables.

    HF rotates x = [x1, x2] into x * cos + [-x2, x1] * sin. Rolling x by half a head gives [x2, x1]; the minus
    sign lives in signed_sin. The products are the same floats, so the result is bit-equal to HF's.
    """
    out = x * cos[:, None, :]
    return out.add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin[:, None, :]))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * intermediate] -> silu(gate) * up [num_tokens, intermediate], as HF's LlamaMLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def project(x: torch.Tensor, weight: torch.Tensor, lora, layer: int, name: str,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight^T [in, out] (+ bias [out]), plus each token's LoRA update when the step has
    adapters (guide §16)."""
    out = linear(x, weight, bias)
    if lora is not None:
        lora.add(layer, name, x, out)
    return out


@dataclass
class LayerWeights:
    input_norm: torch.Tensor   # [hidden]
    qkv: torch.Tensor          # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: torch.Tensor            # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor    # [hidden]
    gate_up: torch.Tensor      # [2 * intermediate, hidden]
    down: torch.Tensor         # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(num_heads + 2 * num_kv_heads) * head_dim], where the architecture has it
    q_norm: torch.Tensor | None = None    # [head_dim], where the architecture has it
    k_norm: torch.Tensor | None = None    # [head_dim]


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")   # a LayerWeights' matmul weights


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor    # [hidden]
    lm_head: torch.Tensor       # [vocab, hidden] (the same tensor when the embeddings are tied)
    layers: list[LayerWeights]


def module_weights(hf_model, arch: Architecture) -> ModelWeights:
    """The engine's layout of a transformers model object's weights: its own tensors where nothing is fused."""
    state = hf_model.state_dict()  # detached tensors sharing the parameters' memory
    layers = []
    for index in range(hf_model.config.num_hidden_layers):
        parts = {name: [state[f"model.layers.{index}.{hf_name}"] for hf_name in hf_names]
                 for name, hf_names in arch.layer_tensors().items()}
        layers.append(LayerWeights(**{name: torch.cat(p) if len(p) > 1 else p[0] for name, p in parts.items()}))
    return ModelWeights(state["model.embed_tokens.weight"], state["model.norm.weight"],
                        hf_model.lm_head.weight.detach(), layers)


class PagedLlama:
    """A Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) that keeps its KV cache in a paged pool.

    PagedLlama(hf_model, backend) runs a transformers model object on its own weights;
    PagedLlama.from_weights(...) runs weights already in the engine's layout (checkpoints.load_checkpoint)."""

    def __init__(self, hf_model, backend: str = "torch"):
        arch = check_model(hf_model)
        self._setup(hf_model.config, arch, module_weights(hf_model, arch), hf_model.model.rotary_emb, backend)

    @classmethod
    def from_weights(cls, config, arch: Architecture, weights: ModelWeights, rotary_emb,
                     backend: str = "torch", tensor_parallel=None) -> "PagedLlama":
        """rotary_emb: transformers' rotary module for this config (it gives the cos and sin tables).
        tensor_parallel: this rank's TensorParallelGroup (model/tensor_parallel.py), whose shard the weights already are;
        the forward pass then adds the ranks' partial sums and gathers their logits."""
        model = cls.__new__(cls)
        model._setup(config, arch, weights, rotary_emb, backend, tensor_parallel)
        return model

    def _setup(self, config, arch: Architecture, weights: ModelWeights, rotary_emb, backend: str,
               tensor_parallel=None) -> None:
        self.config, self.arch = config, arch
        self.tp = tensor_parallel
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.vocab_size = weights.embed_tokens.shape[0]
        if tensor_parallel is not None:   # this rank's heads and vocabulary
            shard = tensor_parallel.shard
            self.num_heads, self.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
            self.vocab_size = shard.vocab_size
        self.head_dim = head_dim(config)
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.max_position = max_model_len(arch, config)
        self.dtype, self.device = weights.embed_tokens.dtype, weights.embed_tokens.device
        if backend == "cpu" and self.device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, but the model is on {self.device}; "
                             f"use 'triton' or 'torch' there")
        self.backend = attention_backend(backend, self.dtype)
        self.embed_tokens, self.final_norm = weights.embed_tokens, weights.final_norm
        # On a CPU, each matmul's weight is reordered once for oneDNN (model/packed_linear.py), in place, one tensor at a
        # time, so the plain one is freed as its packed copy is made; a tied LM head gets a packed copy of its own
        # and the embedding lookup keeps the plain table.
        self.lm_head = pack(weights.lm_head)
        for layer in weights.layers:
            for name in LINEAR_WEIGHTS:
                setattr(layer, name, pack(getattr(layer, name)))
        self.layers = weights.layers
        # The rotary table for every position, computed once by the model's own rotary module (any RoPE variant).
        with torch.no_grad():
            positions = torch.arange(self.max_position, device=self.device)[None]
            cos, sin = rotary_emb(self.embed_tokens[:1][None], positions)
        self.cos, self.signed_sin = cos[0], signed_sine(sin[0])  # [max_position, head_dim]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache, logits_indices: torch.Tensor, lora=None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits [len(logits_indices), vocab] in fp32.
        lora (a paged.lora.LoRABatch, guide §16) adds each token's adapter update to the projections it targets."""
        num_tokens = input_ids.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Row lookups go through F.embedding: on a CPU, advanced indexing (tensor[ids]) can be many times slower.
        cos, sin = F.embedding(positions, self.cos), F.embedding(positions, self.signed_sin)  # [tokens, head_dim]
        if self.tp is None:
            hidden = F.embedding(input_ids, self.embed_tokens)                      # [num_tokens, hidden]
        else:   # each rank looks up the tokens of its slice of the vocabulary; one all-reduce adds them
            hidden = self.tp.embed(input_ids, self.embed_tokens)
        delta = None        # what the last sublayer adds to the residual stream, added as the next norm reads it
        for index, layer in enumerate(self.layers):
            x = self.backend.add_rms_norm(hidden, delta, layer.input_norm, self.eps)
            qkv = project(x, layer.qkv, lora, index, "qkv", layer.qkv_bias)
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.arch.qk_norm:  # one RMSNorm over each head's head_dim, shared by all q heads (and all k heads)
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat([rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)], dim=1)
            qk = self.backend.rope(qk, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # RoPE'd once for all q and k heads
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            out = self._attention(q, k, v, kv_cache.key_cache(index), kv_cache.value_cache(index), meta)
            delta = self._reduce(project(out.view(num_tokens, q_size), layer.o, lora, index, "o"))
            x = self.backend.add_rms_norm(hidden, delta, layer.post_norm, self.eps)
            act = self.backend.silu_and_mul(project(x, layer.gate_up, lora, index, "gate_up"))
            delta = self._reduce(project(act, layer.down, lora, index, "down"))
        hidden += delta
        last = rms_norm(hidden.index_select(0, logits_indices), self.final_norm, self.eps)  # [num_logits, hidden]
        logits = linear(last, self.lm_head)                                 # [num_logits, vocab (this rank's)]
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()   # [num_logits, vocab]

    def _reduce(self, delta: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums [num_tokens, hidden] added over the ranks (tensor parallel)."""
        return delta if self.tp is None else self.tp.all_reduce(delta)

    def _attention(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]."""
        if CHECK_KERNELS and not meta.checked:  # every layer shares the step's tables: the first layer checks them
            meta.check(q, k, v, key_cache, value_cache)
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self.backend.decode(q, key_cache, value_cache, meta.decode_block_tables,
                                       meta.decode_context_lens, self.scale, meta.decode_max_context_len)
        prefill = self.backend.prefill(q[num_decode:], key_cache, value_cache, meta.prefill_block_tables,
                                       meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale,
                                       meta.prefill_max_query_len, meta.prefill_max_context_len)
        if num_decode == 0:
            return prefill
        decode = self.backend.decode(q[:num_decode], key_cache, value_cache, meta.decode_block_tables,
                                     meta.decode_context_lens, self.scale, meta.decode_max_context_len)
        return torch.cat([decode, prefill])
