"""Triton kernels for paged attention (guide §5-§7), each checked against the torch reference in paged.attention.

    reshape_and_cache        kernels/cache_write.py   scatter a step's K/V into the pools through the slot mapping
    paged_decode_attention   kernels/decode_v1.py     one program per (sequence, query head)
                             kernels/decode_v2.py     GQA-grouped, split-KV (flash-decoding) + log-sum-exp merge
    paged_prefill_attention  kernels/prefill.py       a chunk attends causally to its cached prefix and itself

The functions here check their inputs (shapes, dtypes, and, with one device-to-host copy, that every context
fits its block table and every block id it uses is in the pool) and raise ValueError naming the argument and
the limit. The launchers inside the modules skip the checks: a caller that runs many layers over the same
block tables can check once and call them directly.

Without CUDA the kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set here unless the environment
already says otherwise, before any @triton.jit decorator runs, and triton's own library is made usable by it
even if triton was imported earlier (kernels/interpreter.py). The interpreter is slow (numpy per program),
has no bf16 tl.dot and no autotuning; use float32 or float16 there.
"""

import torch

from kernels.interpreter import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()

import triton  # noqa: E402  (after TRITON_INTERPRET is settled)

from kernels.cache_write import write_cache  # noqa: E402
from kernels.decode_v1 import paged_decode_v1  # noqa: E402
from kernels.decode_v2 import MAX_SPLITS, paged_decode_v2  # noqa: E402
from kernels.prefill import paged_prefill  # noqa: E402

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TOKENS_PER_SPLIT = 256      # shorter splits leave too little work to pay for the merge (a guess until measured)


def _check_kv_cache(key_cache, value_cache):
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache must have key_cache's shape and strides {tuple(key_cache.shape)}, "
                         f"{key_cache.stride()}; got {tuple(value_cache.shape)}, {value_cache.stride()}")
    if value_cache.dtype != key_cache.dtype or value_cache.device != key_cache.device:
        raise ValueError(f"value_cache ({value_cache.dtype}, {value_cache.device}) must match key_cache "
                         f"({key_cache.dtype}, {key_cache.device})")
    if key_cache.dtype not in _FLOATS:
        raise ValueError(f"key_cache dtype must be one of {_FLOATS}, got {key_cache.dtype}")
    if not key_cache.is_cuda and key_cache.dtype == torch.bfloat16:
        raise ValueError("key_cache is bfloat16 on a CPU: Triton's interpreter has no bfloat16 dot; "
                         "use float16 or float32 there")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size (key_cache.shape[1]) must be a power of two, got {block_size}")


def _check_attention(query, key_cache, value_cache, block_tables, context_lens, query_rows):
    """Checks shared by decode and prefill that need no device-to-host copy."""
    _check_kv_cache(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [{query_rows}, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} must equal key_cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} (query.shape[1]) must be a multiple of "
                         f"num_kv_heads {num_kv_heads} (key_cache.shape[2])")
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} must equal key_cache dtype {key_cache.dtype}")
    for name, t in (("query", query), ("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks_per_seq], "
                         f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.dim() != 1:
        raise ValueError(f"context_lens must be int32 [num_seqs], "
                         f"got {context_lens.dtype} of shape {tuple(context_lens.shape)}")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but context_lens has "
                         f"{context_lens.shape[0]} sequences")


def _bad_table_entries(block_tables, context_lens, block_size, num_blocks):
    """[num_seqs, max_blocks_per_seq] bool: entries a sequence uses that point outside the pool."""
    used = (context_lens.long() + block_size - 1) // block_size                   # [num_seqs]
    j = torch.arange(block_tables.shape[1], device=block_tables.device)
    in_use = j[None, :] < used[:, None]
    return in_use & ((block_tables < 0) | (block_tables >= num_blocks))


def _check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad):
    capacity = block_tables.shape[1] * block_size
    if ctx_max > capacity:
        seq = int(torch.argmax(context_lens))
        raise ValueError(f"context_lens[{seq}] = {ctx_max} is longer than its block table can hold: "
                         f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity} tokens")
    if bad:
        seq, j = (int(x) for x in _bad_table_entries(block_tables, context_lens, block_size, num_blocks).nonzero()[0])
        raise ValueError(f"block_tables[{seq}, {j}] = {int(block_tables[seq, j])} is outside the pool "
                         f"[0, {num_blocks}) (num_blocks = key_cache.shape[0])")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write key, value [num_tokens, num_kv_heads, head_dim] into the pools at slot_mapping [num_tokens].

    In place, same semantics as paged.attention.write_kv: slot = block_id * block_size + offset, -1 skips."""
    _check_kv_cache(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != key_cache.shape[2:]:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], "
                             f"got shape {tuple(t.shape)}")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be int32 or int64 [num_tokens={key.shape[0]}], "
                         f"got {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but key_cache is on {key_cache.device}")
    if key.shape[0] == 0:
        return
    lo, hi = torch.aminmax(slot_mapping)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < -1 or hi >= num_blocks * block_size:
        raise ValueError(f"slot_mapping values must be -1 (skip) or in [0, {num_blocks * block_size}) "
                         f"(num_blocks x block_size), got min {lo} and max {hi}")
    write_cache(key, value, key_cache, value_cache, slot_mapping)


def choose_num_splits(num_seqs, num_kv_heads, max_context_len, device):
    """Split long contexts until the grid has about two programs per streaming multiprocessor."""
    if device.type != "cuda":
        return 1                                   # the interpreter runs programs one after another
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    worth_it = triton.cdiv(max_context_len, _TOKENS_PER_SPLIT)
    return max(1, min(wanted, worth_it, MAX_SPLITS))


def paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                           version=None, num_splits=None):
    """One new token per sequence attends to its cached context: query [num_seqs, num_heads, head_dim] ->
    [num_seqs, num_heads, head_dim]. version 1 or 2 (None picks 2, the faster; 1 is kept to compare);
    num_splits (version 2 only) cuts each context into that many runs (None picks from the GPU's size)."""
    _check_attention(query, key_cache, value_cache, block_tables, context_lens, "num_seqs")
    if query.shape[0] != context_lens.shape[0]:
        raise ValueError(f"query has {query.shape[0]} sequences but context_lens has {context_lens.shape[0]}")
    if version not in (None, 1, 2):
        raise ValueError(f"version must be 1, 2 or None, got {version!r}")
    if num_splits is not None:
        if version == 1:
            raise ValueError("num_splits applies to version 2 only (version 1 never splits a context)")
        if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if query.shape[0] == 0:
        return torch.empty_like(query)

    bad = _bad_table_entries(block_tables, context_lens, block_size, num_blocks).any()
    ctx_min, ctx_max, bad = torch.stack([context_lens.min(), context_lens.max(), bad.int()]).tolist()
    if ctx_min < 1:
        raise ValueError(f"context_lens must be >= 1 at decode (the new token is in the cache), "
                         f"got a minimum of {ctx_min}")
    _check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad)

    if version == 1:
        return paged_decode_v1(query, key_cache, value_cache, block_tables, context_lens, scale)
    if num_splits is None:
        num_splits = choose_num_splits(query.shape[0], key_cache.shape[2], ctx_max, query.device)
    return paged_decode_v2(query, key_cache, value_cache, block_tables, context_lens, scale, num_splits)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale):
    """The chunks of new tokens query [num_tokens, num_heads, head_dim] attend causally to their sequences'
    cached tokens and to themselves; sequence b's rows are query_start_loc[b]:query_start_loc[b + 1] and sit at
    the last query_len positions of its context_lens[b]. Returns [num_tokens, num_heads, head_dim]."""
    _check_attention(query, key_cache, value_cache, block_tables, context_lens, "num_tokens")
    num_seqs = context_lens.shape[0]
    if (query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,)
            or query_start_loc.device != query.device):
        raise ValueError(f"query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}] on {query.device}, "
                         f"got {query_start_loc.dtype} of shape {tuple(query_start_loc.shape)} "
                         f"on {query_start_loc.device}")
    if num_seqs == 0:
        if query.shape[0]:
            raise ValueError(f"query has {query.shape[0]} tokens but there are no sequences")
        return torch.empty_like(query)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]

    query_lens = query_start_loc[1:] - query_start_loc[:-1]                          # [num_seqs]
    bad = _bad_table_entries(block_tables, context_lens, block_size, num_blocks).any()
    stats = torch.stack([context_lens.max(), query_start_loc[0], query_start_loc[-1],
                         query_lens.min(), query_lens.max(), (context_lens - query_lens).min(), bad.int()])
    ctx_max, first, last, qlen_min, qlen_max, prefix_min, bad = stats.tolist()
    if first != 0 or last != query.shape[0] or qlen_min < 0:
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens = {query.shape[0]} without falling, "
                         f"got {query_start_loc.tolist()}")
    if prefix_min < 0:
        seq = int(torch.argmin(context_lens - query_lens))
        raise ValueError(f"context_lens[{seq}] = {int(context_lens[seq])} is shorter than its query length "
                         f"{int(query_lens[seq])}: context_lens must count the new tokens too")
    _check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad)
    return paged_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, qlen_max)
