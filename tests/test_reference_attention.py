"""The torch reference attention (paged.model.attention) on pools with any strides the shared checks accept: heads padded
in their storage, and K and V as two halves of one tensor per layer ([num_blocks, 2, block_size, heads, head_dim],
vLLM V1's layout). Against the same call on contiguous copies (a dense layout) and against the C++ kernel."""

import pytest
import torch
from helpers import paged_pool, random_query, require_cpu_kernel

from paged.kernels import checks, cpu
from paged.model import attention as ref

pytestmark = pytest.mark.usefixtures("one_thread")


def strided_copies(key_cache, value_cache, layout):
    """The same K/V in pools that are views of larger storage (equal shapes, non-contiguous)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if layout == "padded heads":
        key_store = torch.full((num_blocks, block_size, num_kv_heads + 3, head_dim), float("nan"))
        value_store = torch.full_like(key_store, float("nan"))
        key, value = key_store[:, :, 1 : 1 + num_kv_heads], value_store[:, :, 1 : 1 + num_kv_heads]
    else:  # "kv halves": one layer's tensor holds K and V side by side in each block
        store = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
        key, value = store[:, 0], store[:, 1]
    key.copy_(key_cache)
    value.copy_(value_cache)
    assert not key.is_contiguous() and key.stride() == value.stride()
    return key, value


def strided_inputs(layout):
    """A decode batch and a prefill batch over a strided pool, and the same pool contiguous."""
    lens = [5, 16, 40, 33]
    key_cache, value_cache, tables, context_lens = paged_pool(lens, 16, 2, 64, torch.float32, seed=3, device="cpu")
    key, value = strided_copies(key_cache, value_cache, layout)
    query = random_query(len(lens), 6, 64, torch.float32, seed=3, device="cpu")
    assert checks.check_decode(query, key, value, tables, context_lens) == max(lens)  # the checks accept it
    query_lens = torch.tensor([5, 1, 7, 33])
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    chunk = random_query(int(query_lens.sum()), 6, 64, torch.float32, seed=4, device="cpu")
    decode_args = (query, key, value, tables, context_lens, 0.125)
    prefill_args = (chunk, key, value, tables, starts, context_lens, 0.125)
    return decode_args, prefill_args, (key_cache, value_cache)


@pytest.mark.parametrize("layout", ["padded heads", "kv halves"])
def test_reference_attention_on_strided_pools(layout):
    decode_args, prefill_args, (key_cache, value_cache) = strided_inputs(layout)
    query, _, _, tables, context_lens, scale = decode_args
    assert torch.equal(
        ref.decode_attention(*decode_args),
        ref.decode_attention(query, key_cache, value_cache, tables, context_lens, scale),
    )
    chunk, _, _, _, starts, _, _ = prefill_args
    assert torch.equal(
        ref.prefill_attention(*prefill_args),
        ref.prefill_attention(chunk, key_cache, value_cache, tables, starts, context_lens, scale),
    )


@pytest.mark.parametrize("layout", ["padded heads", "kv halves"])
def test_reference_attention_on_strided_pools_is_the_cpu_kernels(layout):
    require_cpu_kernel()
    decode_args, prefill_args, _ = strided_inputs(layout)
    assert torch.allclose(
        ref.decode_attention(*decode_args), cpu.paged_decode_attention(*decode_args), atol=1e-5, rtol=1e-5
    )
    assert torch.allclose(
        ref.prefill_attention(*prefill_args), cpu.paged_prefill_attention(*prefill_args), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("layout", ["padded heads", "kv halves"])
def test_write_kv_on_strided_pools(layout):
    key_cache, value_cache, _, _ = paged_pool([40], 16, 2, 64, torch.float32, seed=6, device="cpu")
    key, value = strided_copies(key_cache, value_cache, layout)
    slots = torch.tensor([3, 17, -1, 40, 41, 63])
    new_key, new_value = (
        random_query(6, 2, 64, torch.float32, seed=7, device="cpu"),
        random_query(6, 2, 64, torch.float32, seed=8, device="cpu"),
    )
    ref.write_kv(new_key, new_value, key, value, slots)
    ref.write_kv(new_key, new_value, key_cache, value_cache, slots)
    assert torch.equal(key, key_cache) and torch.equal(value, value_cache)
