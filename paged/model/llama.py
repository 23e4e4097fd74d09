"""The Llama-family forward pass over HF weights, reading and writing the paged KV cache (guide §2, §5, §7).

model/loader.py supplies the weights (from a transformers model object or a checkpoint folder) and transformers the
rotary table; the attention path is ours (model/attention_backends.py; model/layer_ops.py for the ops around it).
One forward call runs a whole engine step: the new tokens of every scheduled sequence, flattened into one
[num_tokens] batch (single-token decodes first, then prefill chunks), so every matmul sees all of them at once.
Attention then splits into a decode call (one query per sequence) and a prefill call (a ragged chunk per sequence),
both over block tables.

Per layer:  x -> RMSNorm -> fused QKV (+ bias) -> (per-head q/k RMSNorm) -> RoPE -> write K,V into the pool
              -> paged attention -> O -> RMSNorm -> fused gate/up -> SiLU * up -> down,   each with a residual add.

That is transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM; what differs
between them (the bracketed steps, the sliding window) is read from their description in model/architectures.py, which
refuses by name a model this forward pass would run wrongly. Every other setting is honoured: any head_dim, tied or
untied embeddings, the static RoPE scalings (linear, dynamic within max_position_embeddings, yarn, llama3), whose
table comes from the model's own rotary module.
"""

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from paged.model.architectures import Architecture, head_dim, max_model_len
from paged.model.attention_backends import get_attn_backend
from paged.model.layer_ops import get_layer_ops, rms_norm, signed_sine
from paged.model.packed_linear import linear, pack

# PAGED_CHECK_KERNELS=1 in the environment (or this flag set True) runs the kernels' input checks
# (paged/kernels/checks.py) on each step's metadata, once per step; they read the tables back from the device.
CHECK_KERNELS = os.environ.get("PAGED_CHECK_KERNELS", "0") not in ("", "0")


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to. The longest lengths come as
    Python ints, from the lists they were built from, so that no layer reads a tensor back from the device."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int  # the first num_decode_tokens tokens are one-token decodes
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1]
    prefill_context_lens: torch.Tensor  # int32 [num_prefills]
    decode_max_context_len: int  # max(decode_context_lens), 0 without decodes
    prefill_max_query_len: int  # the longest prefill chunk, 0 without prefills
    prefill_max_context_len: int  # max(prefill_context_lens), 0 without prefills
    # the last num_pad_tokens decodes are padding, whose K/V are not written (their slots are -1 too, which a
    # captured CUDA graph's write skips)
    num_pad_tokens: int = 0
    checked: bool = field(default=False, repr=False)  # set once the debug checks have passed

    def check(self, q, k, v, key_cache, value_cache) -> None:
        """The kernels' input checks over this step, and that the ints above match the tensors: a ValueError
        naming the argument otherwise. Reads the tables back from the device (hence only under CHECK_KERNELS)."""
        from paged.kernels.checks import check_cache_write, check_decode, check_prefill

        check_cache_write(k, v, key_cache, value_cache, self.slot_mapping)
        num_real = self.slot_mapping.shape[0] - self.num_pad_tokens
        if (self.slot_mapping[:num_real] < 0).any():
            raise ValueError(
                "slot_mapping holds -1 outside the padding rows, but the engine's steps write every token they compute"
            )
        num_decode = self.num_decode_tokens
        found = {}
        if num_decode:
            found["decode_max_context_len"] = check_decode(
                q[:num_decode], key_cache, value_cache, self.decode_block_tables, self.decode_context_lens
            )
        if num_decode < q.shape[0]:
            found["prefill_max_query_len"] = check_prefill(
                q[num_decode:],
                key_cache,
                value_cache,
                self.prefill_block_tables,
                self.prefill_query_start_loc,
                self.prefill_context_lens,
            )
            found["prefill_max_context_len"] = int(self.prefill_context_lens.max())
        for name, value in found.items():
            if getattr(self, name) != value:
                raise ValueError(f"AttentionMetadata.{name} is {getattr(self, name)}, but the tensors say {value}")
        self.checked = True


def project(
    x: torch.Tensor, weight: torch.Tensor, lora, layer: int, name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [num_tokens, in] @ weight^T [in, out] (+ bias [out]), plus each token's LoRA update when the step has
    adapters (guide §16)."""
    out = linear(x, weight, bias)
    if lora is not None:
        lora.add(layer, name, x, out)
    return out


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(num_heads + 2 * num_kv_heads) * head_dim], where the architecture has it
    q_norm: torch.Tensor | None = None  # [head_dim], where the architecture has it
    k_norm: torch.Tensor | None = None  # [head_dim]


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # a LayerWeights' matmul weights


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the same tensor when the embeddings are tied)
    layers: list[LayerWeights]


class PagedLlama:
    """A Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) that keeps its KV cache in a paged pool.

    model/loader.py's load_model makes one from any source (the bundled model, a transformers model object, a
    checkpoint folder): config and arch describe it, weights are already in the engine's layout, and rotary_emb is
    transformers' rotary module for this config (it gives the cos and sin tables). source says where the weights came
    from ("smollm2", the model object, a folder's resolved path), so that a draft of the same model can share them.
    backend names the attention backend (model/attention_backends.py); tensor_parallel is this rank's
    TensorParallelGroup (model/tensor_parallel.py), whose shard the weights already are: the forward pass then adds
    the ranks' partial sums and gathers their logits."""

    def __init__(
        self,
        config,
        arch: Architecture,
        weights: ModelWeights,
        rotary_emb,
        source,
        backend: str = "torch",
        tensor_parallel=None,
    ):
        self.source = source
        self.config, self.arch = config, arch
        self.tp = tensor_parallel
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.vocab_size = weights.embed_tokens.shape[0]
        if tensor_parallel is not None:  # this rank's heads and vocabulary
            shard = tensor_parallel.shard
            self.num_heads, self.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
            self.vocab_size = shard.vocab_size
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.max_position = max_model_len(arch, config)
        self.dtype, self.device = weights.embed_tokens.dtype, weights.embed_tokens.device
        self.backend = get_attn_backend(backend, self.device)
        self.layer_ops = get_layer_ops(self.backend.name, self.dtype)
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
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
        logits_indices: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits [len(logits_indices), vocab] in fp32.
        lora (a paged.lora.LoRABatch, guide §16) adds each token's adapter update to the projections it targets."""
        num_tokens = input_ids.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Row lookups go through F.embedding: on a CPU, advanced indexing (tensor[ids]) can be many times slower.
        cos, sin = F.embedding(positions, self.cos), F.embedding(positions, self.signed_sin)  # [tokens, head_dim]
        if self.tp is None:
            hidden = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        else:  # each rank looks up the tokens of its slice of the vocabulary; one all-reduce adds them
            hidden = self.tp.embed(input_ids, self.embed_tokens)
        delta = None  # what the last sublayer adds to the residual stream, added as the next norm reads it
        for index, layer in enumerate(self.layers):
            x = self.layer_ops.add_rms_norm(hidden, delta, layer.input_norm, self.eps)
            qkv = project(x, layer.qkv, lora, index, "qkv", layer.qkv_bias)
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.arch.qk_norm:  # one RMSNorm over each head's head_dim, shared by all q heads (and all k heads)
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat([rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)], dim=1)
            qk = self.layer_ops.rope(qk, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # RoPE'd once for all q and k heads
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            out = self._attention(q, k, v, kv_cache.key_cache(index), kv_cache.value_cache(index), meta)
            delta = self._reduce(project(out.view(num_tokens, q_size), layer.o, lora, index, "o"))
            x = self.layer_ops.add_rms_norm(hidden, delta, layer.post_norm, self.eps)
            act = self.layer_ops.silu_and_mul(project(x, layer.gate_up, lora, index, "gate_up"))
            delta = self._reduce(project(act, layer.down, lora, index, "down"))
        hidden += delta
        last = rms_norm(hidden.index_select(0, logits_indices), self.final_norm, self.eps)  # [num_logits, hidden]
        logits = linear(last, self.lm_head)  # [num_logits, vocab (this rank's)]
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()  # [num_logits, vocab]

    def _reduce(self, delta: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums [num_tokens, hidden] added over the ranks (tensor parallel)."""
        return delta if self.tp is None else self.tp.all_reduce(delta)

    def _attention(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]."""
        if CHECK_KERNELS and not meta.checked:  # every layer shares the step's tables: the first layer checks them
            meta.check(q, k, v, key_cache, value_cache)
        if meta.num_pad_tokens:  # padding rows attend, but write nothing
            num_real = q.shape[0] - meta.num_pad_tokens
            self.backend.write_kv(k[:num_real], v[:num_real], key_cache, value_cache, meta.slot_mapping[:num_real])
        else:
            self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self.backend.decode(
                q,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                meta.decode_max_context_len,
            )
        prefill = self.backend.prefill(
            q[num_decode:],
            key_cache,
            value_cache,
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_context_lens,
            self.scale,
            meta.prefill_max_query_len,
            meta.prefill_max_context_len,
        )
        if num_decode == 0:
            return prefill
        decode = self.backend.decode(
            q[:num_decode],
            key_cache,
            value_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
            meta.decode_max_context_len,
        )
        return torch.cat([decode, prefill])
