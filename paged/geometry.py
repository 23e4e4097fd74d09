"""How many bytes the KV cache takes: per token, per block, per request, per pool (guide §1, §2, §6, §8).

Every decode step of a transformer reads, for each layer, the key and value vectors of every earlier token.
Those vectors are the KV cache. Its size follows from four numbers of the model and nothing else:

    bytes per token = 2 (K and V) * num_layers * num_kv_heads * head_dim * bytes per element

For Llama-3-70B in fp16 (80 layers, 8 KV heads, head_dim 128) that is 327,680 B = 320 KiB per token, so a
2,048-token request holds 640 MiB. A paged cache cuts that memory into blocks of `block_size` tokens; one
block of one layer holds block_size * num_kv_heads * head_dim * bytes for K and as much for V (64 KiB at
block size 16), and over all 80 layers a block is 5 MiB. A 40 GiB budget then holds 8,192 blocks, 131,072 tokens.

The worked example at the bottom (`worked_example`) compares reserving the model maximum for every request with
allocating only the blocks a request fills, and says which memory budget each of its figures assumes.
"""

from dataclasses import dataclass

import torch

from paged.validation import block_size_of

KiB, MiB, GiB = 1024, 1024**2, 1024**3

H100_SXM_BANDWIDTH = 3.35e12  # bytes/s, HBM3, NVIDIA H100 SXM datasheet
H100_SXM_BF16_FLOPS = 989.4e12  # FLOP/s, dense bf16 tensor cores, same datasheet
LLAMA3_70B_PARAMS = 70.6e9  # weights of Llama-3-70B, embeddings included
H100_MEMORY = 81_559 * MiB  # an "80 GB" H100 as NVML (nvidia-smi) reports it: 81,559 MiB = 79.6 GiB = 85.5 GB


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (fp32 4, fp16/bf16 2, fp8 1)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype such as torch.float16, got {dtype!r}")
    return dtype.itemsize


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def format_bytes(num_bytes: float) -> str:
    """'320 KiB', '640 MiB', '24.4 GiB', '1.25 GiB': binary units, three significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1)):
        value = num_bytes / size
        if abs(value) >= 1 or unit == "B":
            return (f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}") + f" {unit}"


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache. All sizes are in bytes; token counts are plain ints."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int  # bytes of one cached number: 4 fp32, 2 fp16/bf16
    num_attention_heads: int  # query heads; num_attention_heads / num_kv_heads queries share one K/V head (GQA)

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "element_bytes", "num_attention_heads"):
            _positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> "KVGeometry":
        """From a Llama-like HF config: num_hidden_layers, num_attention_heads, num_key_value_heads (None or
        absent means no GQA), head_dim (None or absent means hidden_size // num_attention_heads)."""
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            element_bytes=dtype_bytes(dtype),
            num_attention_heads=num_heads,
        )

    @classmethod
    def llama3_70b(cls) -> "KVGeometry":
        """The guide's running example: Llama-3-70B, 80 layers, 64 query heads, 8 KV heads, head_dim 128, fp16."""
        return cls(num_layers=80, num_kv_heads=8, head_dim=128, element_bytes=2, num_attention_heads=64)

    # per token ------------------------------------------------------------------------------------------------
    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer: 2 * num_kv_heads * head_dim * element_bytes (4 KiB for 70B)."""
        return 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (320 KiB = 327,680 B for Llama-3-70B fp16)."""
        return self.num_layers * self.bytes_per_token_per_layer

    def tensor_shape(self, num_tokens: int, batch_size: int = 1) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) tensor in HF's DynamicCache: [batch, num_kv_heads, num_tokens, head_dim]."""
        return (batch_size, self.num_kv_heads, num_tokens, self.head_dim)

    # per request ----------------------------------------------------------------------------------------------
    def request_bytes(self, num_tokens: int) -> int:
        """KV of one request held contiguously, exactly num_tokens long (640 MiB for 2,048 tokens of 70B)."""
        return _non_negative_int("num_tokens", num_tokens) * self.bytes_per_token

    def paged_request_bytes(self, num_tokens: int, block_size: int) -> int:
        """KV of one request in a paged cache: num_tokens rounded up to whole blocks."""
        return blocks_for_tokens(num_tokens, block_size) * self.block_bytes(block_size)

    # per block ------------------------------------------------------------------------------------------------
    def block_bytes_per_layer(self, block_size: int) -> int:
        """One block of one layer, K and V (64 KiB for 70B at block size 16)."""
        return block_size_of(_positive_int("block_size", block_size)) * self.bytes_per_token_per_layer

    def block_bytes(self, block_size: int) -> int:
        """One block over all layers, K and V (5 MiB for 70B at block size 16)."""
        return self.num_layers * self.block_bytes_per_layer(block_size)

    # per pool -------------------------------------------------------------------------------------------------
    def pool_blocks(self, budget_bytes: int, block_size: int) -> int:
        """Whole blocks that fit in a memory budget (40 GiB -> 8,192 blocks for 70B at block size 16)."""
        return _non_negative_int("budget_bytes", budget_bytes) // self.block_bytes(block_size)

    def pool_tokens(self, budget_bytes: int, block_size: int) -> int:
        """Token slots those blocks hold (40 GiB -> 131,072 tokens)."""
        return self.pool_blocks(budget_bytes, block_size) * block_size

    # reading the cache ----------------------------------------------------------------------------------------
    def decode_read_bytes(self, context_len: int, num_layers: int | None = None) -> int:
        """Bytes of K and V one decode step reads for one sequence of context_len tokens, in num_layers layers
        (default all). For 70B at 4,096 tokens: 16 MiB per layer, 1.25 GiB over all 80."""
        layers = self.num_layers if num_layers is None else _positive_int("num_layers", num_layers)
        return _non_negative_int("context_len", context_len) * self.bytes_per_token_per_layer * layers

    @property
    def attention_flops_per_byte(self) -> float:
        """Arithmetic intensity of decode attention: FLOPs per byte of K/V read.

        Per cached token and layer, every query head does a dot product with K and an axpy with V
        (4 * head_dim FLOPs per head), while K and V are read once per KV head. The head_dim cancels:
        intensity = 2 * (num_attention_heads / num_kv_heads) / element_bytes, 8 FLOP/B for 70B fp16,
        against the ~295 FLOP/B an H100 needs to be compute-bound.
        """
        flops = 4 * self.num_attention_heads * self.head_dim
        return flops / self.bytes_per_token_per_layer


def decode_step_flops_per_byte(geometry: KVGeometry, num_params: float, batch_size: int, context_len: int) -> float:
    """Arithmetic intensity of one whole decode step: FLOPs per byte read from memory.

    Each of batch_size sequences (context_len tokens each) makes one token: 2 FLOPs per weight plus the
    attention over its cache. The step reads every weight once (shared by the batch) and every sequence's KV.
    Batching raises the intensity of the weights, never that of the KV: with long contexts the step stays
    under the H100's ~295 FLOP/B ridge however large the batch.
    """
    _positive_int("batch_size", batch_size)
    flops = batch_size * (
        2 * num_params + 4 * geometry.num_attention_heads * geometry.head_dim * context_len * geometry.num_layers
    )
    bytes_read = num_params * geometry.element_bytes + batch_size * geometry.request_bytes(context_len)
    return flops / bytes_read


def measure_hf_cache(cache) -> list[dict]:
    """Shapes and bytes of each layer of a transformers DynamicCache (cache.layers[i].keys / .values,
    each [batch, num_kv_heads, num_tokens, head_dim])."""
    return [
        {
            "layer": i,
            "key_shape": tuple(layer.keys.shape),
            "value_shape": tuple(layer.values.shape),
            "dtype": layer.keys.dtype,
            "bytes": layer.keys.nbytes + layer.values.nbytes,
        }
        for i, layer in enumerate(cache.layers)
    ]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers: blocks of b for a tokens."""
    return -(-a // b)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed for num_tokens tokens: ceil(num_tokens / block_size)."""
    _non_negative_int("num_tokens", num_tokens)
    return -(-num_tokens // block_size_of(_positive_int("block_size", block_size)))


def block_table_bytes(num_seqs: int, max_model_len: int, block_size: int, index_dtype=torch.int32) -> int:
    """A dense block table [num_seqs, ceil(max_model_len / block_size)] of block ids.

    [200, 512] int32 = 400 KiB for 200 sequences of up to 8,192 tokens at block size 16: tiny next to the
    KV it indexes (one block of 70B alone is 5 MiB).
    """
    _positive_int("num_seqs", num_seqs)
    _positive_int("max_model_len", max_model_len)
    return num_seqs * blocks_for_tokens(max_model_len, block_size) * dtype_bytes(index_dtype)


def read_time_s(num_bytes: int, bandwidth: float = H100_SXM_BANDWIDTH) -> float:
    """Seconds to stream num_bytes at `bandwidth` bytes/s (the floor for a memory-bound kernel).

    16 MiB at 3.35 TB/s takes 5.0 µs.
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    return num_bytes / bandwidth


@dataclass(frozen=True)
class WorkedExample:
    """The guide's naive-vs-paged comparison for one model. Bytes are exact ints; see `worked_example`."""

    num_requests: int
    max_model_len: int
    mean_tokens: int
    block_size: int
    budget_bytes: int
    naive_request_bytes: int  # every request reserves max_model_len tokens
    naive_reserved_bytes: int  # num_requests of them
    naive_waste_fraction: float  # reserved but never holding a token, at the mean length
    paged_request_bytes: int  # mean_tokens rounded up to blocks
    paged_reserved_bytes: int  # num_requests of them
    naive_max_requests: int  # requests the budget admits when each reserves max_model_len
    paged_max_requests: int  # requests the budget admits when each holds mean_tokens in blocks


def worked_example(
    geometry: KVGeometry | None = None,
    num_requests: int = 200,
    max_model_len: int = 2048,
    mean_tokens: int = 400,
    block_size: int = 16,
    budget_bytes: int = 200 * GiB,
) -> WorkedExample:
    """The guide's worked example, for Llama-3-70B fp16 by default.

    - naive: 200 requests each reserve 2,048 tokens * 320 KiB = 640 MiB, 125 GiB in all; at a mean of 400 live
      tokens 1 - 400/2048 = 80 % of it holds nothing;
    - paged: the same 200 requests hold 400 tokens = 25 blocks = 125 MiB each, 24.4 GiB in all (200 * 400 *
      320 KiB; not 25 GiB);
    - capacity: both caps assume a KV budget of 200 GiB (the budget argument): 200 GiB / 640 MiB = 320
      requests when each reserves the maximum, 200 GiB / 125 MiB = 1,638 requests when each holds its mean
      400 tokens in blocks. (In the 40 GiB pool of the block-size example the caps would be 64 and 327.)
    """
    geometry = geometry or KVGeometry.llama3_70b()
    _positive_int("num_requests", num_requests)
    _positive_int("max_model_len", max_model_len)
    _positive_int("mean_tokens", mean_tokens)
    if mean_tokens > max_model_len:
        raise ValueError(f"mean_tokens ({mean_tokens}) must be <= max_model_len ({max_model_len})")
    naive_request = geometry.request_bytes(max_model_len)
    paged_request = geometry.paged_request_bytes(mean_tokens, block_size)
    return WorkedExample(
        num_requests=num_requests,
        max_model_len=max_model_len,
        mean_tokens=mean_tokens,
        block_size=block_size,
        budget_bytes=_positive_int("budget_bytes", budget_bytes),
        naive_request_bytes=naive_request,
        naive_reserved_bytes=num_requests * naive_request,
        naive_waste_fraction=1 - mean_tokens / max_model_len,
        paged_request_bytes=paged_request,
        paged_reserved_bytes=num_requests * paged_request,
        naive_max_requests=budget_bytes // naive_request,
        paged_max_requests=budget_bytes // paged_request,
    )
