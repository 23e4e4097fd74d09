"""Cache write: scatter one step's keys and values into the paged pools (guide §5 "block tables", §6).

Every token the model processes this step leaves one key and one value vector per KV head. The block manager
has already chosen where each one lives: a slot, `slot = block_id * block_size + offset`, one per token, in the
slot mapping. This kernel is the whole of "writing the KV cache": one program per token reads its slot, splits
it into (block, offset) and copies the token's [num_kv_heads, head_dim] rows for K and for V into the two pools.
A slot of -1 means "skip this token" (padding, or a token whose KV is already cached after a prefix hit).

It is the Triton twin of `paged.model.attention.write_kv` (vLLM calls the same operation `reshape_and_cache`).
The pools are written in place; nothing is returned.

Shapes (NHD layout):
    key, value              [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping            int32 or int64 [num_tokens]
"""

from paged.kernels.interpreter import tl, triton  # Triton, in its interpreter where there is no GPU


@triton.jit
def cache_write_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_kd,  # strides of key
    stride_vt,
    stride_vh,
    stride_vd,  # strides of value
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,  # strides of both caches (checked equal on the host)
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride can pass 2**31 in a large pool
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :] * stride_cd
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_cache(key, value, key_cache, value_cache, slot_mapping):
    """Launch one program per token. Inputs are assumed valid (see paged.kernels.reshape_and_cache)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    cache_write_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
