"""What a valid paged-attention call is (guide §5-§7): the input checks every kernel wrapper shares.

The Triton wrappers (__init__.py) and the CPU kernel's (cpu.py) call these before launching, so
the same bad input gets the same ValueError, naming the argument and the limit, whichever kernel it was meant for.
The engine calls the kernels without them; with PAGED_CHECK_KERNELS=1 it runs them once per step
(paged.model.llama.AttentionMetadata.check).
Shapes and dtypes are checked without touching the data; the values (every context fits its block table, every
block id it uses is in the pool) with one device-to-host copy per call.
"""

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_kv_cache(key_cache, value_cache):
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(
            f"value_cache must have key_cache's shape and strides {tuple(key_cache.shape)}, "
            f"{key_cache.stride()}; got {tuple(value_cache.shape)}, {value_cache.stride()}"
        )
    if value_cache.dtype != key_cache.dtype or value_cache.device != key_cache.device:
        raise ValueError(
            f"value_cache ({value_cache.dtype}, {value_cache.device}) must match key_cache "
            f"({key_cache.dtype}, {key_cache.device})"
        )
    if key_cache.dtype not in FLOATS:
        raise ValueError(f"key_cache dtype must be one of {FLOATS}, got {key_cache.dtype}")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size (key_cache.shape[1]) must be a power of two, got {block_size}")


def check_attention(query, key_cache, value_cache, block_tables, context_lens, query_rows):
    """Checks shared by decode and prefill that need no device-to-host copy."""
    check_kv_cache(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [{query_rows}, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} must equal key_cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads {num_heads} (query.shape[1]) must be a multiple of "
            f"num_kv_heads {num_kv_heads} (key_cache.shape[2])"
        )
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} must equal key_cache dtype {key_cache.dtype}")
    for name, t in (("query", query), ("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks_per_seq], "
            f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or context_lens.dim() != 1:
        raise ValueError(
            f"context_lens must be int32 [num_seqs], got {context_lens.dtype} of shape {tuple(context_lens.shape)}"
        )
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but context_lens has {context_lens.shape[0]} sequences"
        )


def bad_table_entries(block_tables, context_lens, block_size, num_blocks):
    """[num_seqs, max_blocks_per_seq] bool: entries a sequence uses that point outside the pool."""
    used = (context_lens.long() + block_size - 1) // block_size  # [num_seqs]
    j = torch.arange(block_tables.shape[1], device=block_tables.device)
    in_use = j[None, :] < used[:, None]
    return in_use & ((block_tables < 0) | (block_tables >= num_blocks))


def check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad):
    capacity = block_tables.shape[1] * block_size
    if ctx_max > capacity:
        seq = int(torch.argmax(context_lens))
        raise ValueError(
            f"context_lens[{seq}] = {ctx_max} is longer than its block table can hold: "
            f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity} tokens"
        )
    if bad:
        seq, j = (int(x) for x in bad_table_entries(block_tables, context_lens, block_size, num_blocks).nonzero()[0])
        raise ValueError(
            f"block_tables[{seq}, {j}] = {int(block_tables[seq, j])} is outside the pool "
            f"[0, {num_blocks}) (num_blocks = key_cache.shape[0])"
        )


def check_decode(query, key_cache, value_cache, block_tables, context_lens) -> int | None:
    """All of a decode call's checks; returns the longest context, or None when there is no sequence."""
    check_attention(query, key_cache, value_cache, block_tables, context_lens, "num_seqs")
    if query.shape[0] != context_lens.shape[0]:
        raise ValueError(f"query has {query.shape[0]} sequences but context_lens has {context_lens.shape[0]}")
    if query.shape[0] == 0:
        return None
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    bad = bad_table_entries(block_tables, context_lens, block_size, num_blocks).any()
    ctx_min, ctx_max, bad = torch.stack([context_lens.min(), context_lens.max(), bad.int()]).tolist()
    if ctx_min < 1:
        raise ValueError(
            f"context_lens must be >= 1 at decode (the new token is in the cache), got a minimum of {ctx_min}"
        )
    check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad)
    return ctx_max


def check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens) -> int | None:
    """All of a prefill call's checks; returns the longest chunk, or None when there is no sequence."""
    check_attention(query, key_cache, value_cache, block_tables, context_lens, "num_tokens")
    num_seqs = context_lens.shape[0]
    if (
        query_start_loc.dtype != torch.int32
        or query_start_loc.shape != (num_seqs + 1,)
        or query_start_loc.device != query.device
    ):
        raise ValueError(
            f"query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}] on {query.device}, "
            f"got {query_start_loc.dtype} of shape {tuple(query_start_loc.shape)} "
            f"on {query_start_loc.device}"
        )
    if num_seqs == 0:
        if query.shape[0]:
            raise ValueError(f"query has {query.shape[0]} tokens but there are no sequences")
        return None
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_seqs]
    bad = bad_table_entries(block_tables, context_lens, block_size, num_blocks).any()
    stats = torch.stack(
        [
            context_lens.max(),
            query_start_loc[0],
            query_start_loc[-1],
            query_lens.min(),
            query_lens.max(),
            (context_lens - query_lens).min(),
            bad.int(),
        ]
    )
    ctx_max, first, last, qlen_min, qlen_max, prefix_min, bad = stats.tolist()
    if first != 0 or last != query.shape[0] or qlen_min < 0:
        raise ValueError(
            f"query_start_loc must rise from 0 to num_tokens = {query.shape[0]} without falling, "
            f"got {query_start_loc.tolist()}"
        )
    if prefix_min < 0:
        seq = int(torch.argmin(context_lens - query_lens))
        raise ValueError(
            f"context_lens[{seq}] = {int(context_lens[seq])} is shorter than its query length "
            f"{int(query_lens[seq])}: context_lens must count the new tokens too"
        )
    check_table_values(block_tables, context_lens, block_size, num_blocks, ctx_max, bad)
    return qlen_max


def check_cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """A cache write's checks: key and value [num_tokens, num_kv_heads, head_dim], slots in the pool or -1."""
    check_kv_cache(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != key_cache.shape[2:]:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], "
                f"got shape {tuple(t.shape)}"
            )
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"slot_mapping must be int32 or int64 [num_tokens={key.shape[0]}], "
            f"got {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but key_cache is on {key_cache.device}")
    if key.shape[0] == 0:
        return
    lo, hi = torch.aminmax(slot_mapping)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < -1 or hi >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping values must be -1 (skip) or in [0, {num_blocks * block_size}) "
            f"(num_blocks x block_size), got min {lo} and max {hi}"
        )
