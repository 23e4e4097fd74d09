"""Attention backends (guide §5 "block tables", §7 "the paged kernel"): the torch reference, the Triton kernels, the
C++ kernel for a CPU, as typed classes after vLLM V1's (vllm/v1/attention/backend.py `AttentionBackend`;
backends/triton_attn.py, cpu_attn.py), and `get_attn_backend`, which picks one by name for a device.

A backend does three things per layer, with the same arguments whichever it is:

    write_kv(k, v, key_cache, value_cache, slot_mapping)       this step's K and V into the pool
    decode(q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len)
    prefill(q, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
            max_context_len)

with q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]; key_cache, value_cache
[num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks]; context_lens int32
[num_seqs]; query_start_loc int32 [num_seqs + 1]; slot_mapping int64 [num_tokens]. decode and prefill return
[num_tokens, num_heads, head_dim]. None checks its inputs (the engine's tables are valid; see llama.CHECK_KERNELS),
and none reads a tensor back from the device: the longest lengths come from the AttentionMetadata's ints.

Only attention: the ops around it (RMSNorm, RoPE, SiLU) are model/layer_ops.py's.
"""

from abc import ABC, abstractmethod

import torch

from paged import kernels
from paged.model import attention as torch_attention


class AttentionBackend(ABC):
    """The attention entry points the forward pass calls (model/llama.py, PagedLlama._attention)."""

    name: str  # as attention_backend= names it

    @classmethod
    def create(cls, device: torch.device) -> "AttentionBackend":
        """The backend for a model on `device` (get_attn_backend's); a ValueError where it cannot run there."""
        return cls()

    @abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """k, v [num_tokens, num_kv_heads, head_dim] into the pool's slots slot_mapping [num_tokens]."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        max_context_len: int,
    ) -> torch.Tensor:
        """One query per sequence: q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        max_query_len: int,
        max_context_len: int,
    ) -> torch.Tensor:
        """A ragged chunk per sequence, causal within it: q [num_tokens, num_heads, head_dim] -> the same shape."""


class TorchAttentionBackend(AttentionBackend):
    """The readable reference in plain torch (model/attention.py): gathers each sequence's blocks, then attends."""

    name = "torch"

    def write_kv(self, k, v, key_cache, value_cache, slot_mapping):
        torch_attention.write_kv(k, v, key_cache, value_cache, slot_mapping, may_skip=False)

    def decode(self, q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len):
        return torch_attention.decode_attention(
            q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len
        )

    def prefill(
        self,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        max_query_len,
        max_context_len,
    ):
        return torch_attention.prefill_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            max_query_len,
            max_context_len,
        )


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (paged/kernels/): a GPU's, or the interpreter's."""

    name = "triton"

    @classmethod
    def create(cls, device):
        if kernels.triton_missing():
            raise ValueError(f"attention_backend 'triton': {kernels.triton_missing()}; use 'cpu' or 'torch'")
        return cls()

    def write_kv(self, k, v, key_cache, value_cache, slot_mapping):
        kernels.write_cache(k, v, key_cache, value_cache, slot_mapping)

    def decode(self, q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len):
        return kernels.launch_decode(q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len)

    def prefill(
        self,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        max_query_len,
        max_context_len,
    ):
        return kernels.launch_prefill(
            q, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len
        )


class CpuAttentionBackend(AttentionBackend):
    """The C++ kernel for a CPU (paged/kernels/cpu.py), which reads K/V in place in the pool; its loops stop at each
    sequence's length, so it needs no longest length."""

    name = "cpu"

    def __init__(self, ops):
        self.ops = ops  # torch.ops.paged_cpu, as kernels.cpu.load() gives it

    @classmethod
    def create(cls, device):
        """Where the C++ library cannot be built, the torch reference, after one warning (kernels.cpu.load)."""
        if device.type != "cpu":
            raise ValueError(
                f"attention_backend 'cpu' runs on the CPU, but the model is on {device}; use 'triton' or 'torch' there"
            )
        from paged.kernels import cpu

        ops = cpu.load()  # compiled on first use, then cached; None (after a warning) where it cannot be
        return TorchAttentionBackend() if ops is None else cls(ops)

    def write_kv(self, k, v, key_cache, value_cache, slot_mapping):
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)

    def decode(self, q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len):
        return self.ops.decode(q, key_cache, value_cache, block_tables, context_lens, scale)

    def prefill(
        self,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        max_query_len,
        max_context_len,
    ):
        return self.ops.prefill(q, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)


# The registry: each name attention_backend= takes, and its class.
BACKENDS: dict[str, type[AttentionBackend]] = {
    "cpu": CpuAttentionBackend,
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}
ATTENTION_BACKENDS = tuple(BACKENDS)


def default_attention_backend(device: torch.device) -> str:
    """The Triton kernels on a GPU, the C++ kernel on a CPU; the torch reference on a GPU without Triton."""
    if device.type == "cpu":
        return "cpu"
    return "torch" if kernels.triton_missing() else "triton"


def get_attn_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend named `name` for a model on `device`: a ValueError for an unknown name, for "cpu" off the CPU, or
    for "triton" without Triton; "cpu" falls back to the torch reference where the C++ library cannot be built."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return BACKENDS[name].create(device)
