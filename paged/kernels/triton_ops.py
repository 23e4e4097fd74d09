"""The Triton kernels' entry points (guide §5-§7), each checked against the torch reference in paged.model.attention.

    reshape_and_cache        cache_write.py   scatter a step's K/V into the pools through the slot mapping
    paged_decode_attention   decode_v1.py     one program per (sequence, query head)
                             decode_v2.py     GQA-grouped, split-KV (flash-decoding) + log-sum-exp merge
    paged_prefill_attention  prefill.py       a chunk attends causally to its cached prefix and itself

The three functions above check their inputs (shapes, dtypes, and, with one device-to-host copy, that every
context fits its block table and every block id it uses is in the pool; checks.py) and raise ValueError
naming the argument and the limit. `launch_decode` and `launch_prefill` skip the checks and take the longest
context or chunk as a Python int: the engine, which runs every layer over the same block tables and knows those
lengths from its own lists, calls them and never waits for the GPU between layers (paged/model/llama.py).

`paged.kernels` gives these names without importing this module until one is used, so that the package works
where Triton is not installed. Without CUDA the kernels run in Triton's interpreter (interpreter.py), which is
slow (numpy per program), has no bf16 tl.dot and no autotuning; use float32 or float16 there.
"""

import torch

from paged.kernels.cache_write import write_cache
from paged.kernels.checks import check_cache_write, check_decode, check_prefill
from paged.kernels.decode_v1 import paged_decode_v1
from paged.kernels.decode_v2 import MAX_SPLITS, paged_decode_v2
from paged.kernels.interpreter import triton
from paged.kernels.prefill import paged_prefill

__all__ = [
    "reshape_and_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "launch_decode",
    "launch_prefill",
    "write_cache",
]

_TOKENS_PER_SPLIT = 256  # shorter splits leave too little work to pay for the merge (a guess until measured)


def _refuse_interpreter_bfloat16(key_cache):
    if not key_cache.is_cuda and key_cache.dtype == torch.bfloat16:
        raise ValueError(
            "key_cache is bfloat16 on a CPU: Triton's interpreter has no bfloat16 dot; use float16 or float32 there"
        )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write key, value [num_tokens, num_kv_heads, head_dim] into the pools at slot_mapping [num_tokens].

    In place, same semantics as paged.model.attention.write_kv: slot = block_id * block_size + offset, -1 skips."""
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    _refuse_interpreter_bfloat16(key_cache)
    if key.shape[0]:
        write_cache(key, value, key_cache, value_cache, slot_mapping)


def choose_num_splits(num_seqs, num_kv_heads, max_context_len, device):
    """Split long contexts until the grid has about two programs per streaming multiprocessor."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    worth_it = triton.cdiv(max_context_len, _TOKENS_PER_SPLIT)
    return max(1, min(wanted, worth_it, MAX_SPLITS))


def paged_decode_attention(
    query, key_cache, value_cache, block_tables, context_lens, scale, version=None, num_splits=None
):
    """One new token per sequence attends to its cached context: query [num_seqs, num_heads, head_dim] ->
    [num_seqs, num_heads, head_dim]. version 1 or 2 (None picks 2, the faster; 1 is kept to compare);
    num_splits (version 2 only) cuts each context into that many runs (None picks from the GPU's size)."""
    if version not in (None, 1, 2):
        raise ValueError(f"version must be 1, 2 or None, got {version!r}")
    if num_splits is not None:
        if version == 1:
            raise ValueError("num_splits applies to version 2 only (version 1 never splits a context)")
        if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    ctx_max = check_decode(query, key_cache, value_cache, block_tables, context_lens)
    _refuse_interpreter_bfloat16(key_cache)
    if ctx_max is None:
        return torch.empty_like(query)
    return launch_decode(query, key_cache, value_cache, block_tables, context_lens, scale, ctx_max, version, num_splits)


def launch_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    max_context_len: int,
    version=None,
    num_splits=None,
):
    """paged_decode_attention without the checks, for valid inputs: max_context_len is the longest of
    context_lens, given by the caller so that nothing is read back from the device."""
    if version == 1:
        return paged_decode_v1(query, key_cache, value_cache, block_tables, context_lens, scale)
    if num_splits is None:
        num_splits = choose_num_splits(query.shape[0], key_cache.shape[2], max_context_len, query.device)
    return paged_decode_v2(query, key_cache, value_cache, block_tables, context_lens, scale, num_splits)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale):
    """The chunks of new tokens query [num_tokens, num_heads, head_dim] attend causally to their sequences'
    cached tokens and to themselves; sequence b's rows are query_start_loc[b]:query_start_loc[b + 1] and sit at
    the last query_len positions of its context_lens[b]. Returns [num_tokens, num_heads, head_dim]."""
    qlen_max = check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    _refuse_interpreter_bfloat16(key_cache)
    if qlen_max is None:
        return torch.empty_like(query)
    return launch_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, qlen_max)


def launch_prefill(
    query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len: int
):
    """paged_prefill_attention without the checks, for valid inputs: max_query_len is the longest chunk, given by
    the caller so that nothing is read back from the device."""
    return paged_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len
    )
