"""Reference paged attention in plain torch (guide §5 "block tables", §7 "the paged kernel").

This is the readable oracle that the Triton kernels and the C++ CPU kernel in `paged/kernels/` are checked against,
and the path the engine takes where that kernel cannot be built, or with attention_backend="torch". Keys and values
never live in one contiguous tensor per sequence: they sit in a pool of fixed-size blocks, and a block table says
which physical blocks hold a sequence's tokens, in order.

Layout (NHD, as vLLM's flash backend):
    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables             int32 [num_seqs, max_blocks_per_seq]   entries past a sequence's last block are ignored
    context_lens             int32 [num_seqs]   tokens in the cache for each sequence, the new ones included
    slot_mapping             int   [num_tokens] slot = block_id * block_size + offset; -1 means "do not write"
The pools may have any strides the kernels accept (a layer sliced from a larger tensor, heads padded).

Everything is batched over sequences: one gather of the blocks a batch needs, then one masked attention
(torch's scaled_dot_product_attention).
No Python loop runs over sequences or blocks.
"""

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    may_skip: bool = True,
) -> None:
    """Scatter one step's keys and values into the pools. key, value: [num_tokens, num_kv_heads, head_dim].
    may_skip=False promises that no slot is -1, which saves reading the slots back from the device."""
    keep = slot_mapping >= 0
    if may_skip and not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    block, offset = slots // key_cache.shape[1], slots % key_cache.shape[1]  # [num_tokens] each
    key_cache.index_put_((block, offset), key.to(key_cache.dtype))  # any strides: a pool may be a view
    value_cache.index_put_((block, offset), value.to(value_cache.dtype))


def block_ids(block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """The physical blocks holding each sequence's first max_len tokens: int64 [num_seqs, ceil(max_len / bs)].

    Table entries past a sequence's last block may hold anything; they are replaced by block 0 so that the
    gather stays inside the pool (callers mask those positions).
    """
    num_table_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_table_blocks].long()
    owned = -(-context_lens.long() // block_size)  # [num_seqs] blocks each sequence owns
    return torch.where(torch.arange(num_table_blocks, device=table.device) < owned[:, None], table, 0)


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], ids [num_seqs, nb] from block_ids -> [num_seqs, max_len, Hkv, D].

    The cache may have any strides (padded heads, one layer of a larger tensor): whole blocks are selected along
    the first dimension, which never needs the pool to be viewed as one flat row per block."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    blocks = cache.index_select(0, ids.reshape(-1))  # [num_seqs * nb, block_size, Hkv, D]
    return blocks.view(ids.shape[0], -1, num_kv_heads, head_dim)[:, :max_len]


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Read the first max_len tokens of every sequence through its block table.

    Returns [num_seqs, max_len, num_kv_heads, head_dim]; positions at or past a sequence's context length hold
    whatever block 0 holds, so callers must mask them.
    """
    return gather_blocks(cache, block_ids(block_tables, context_lens, max_len, cache.shape[1]), max_len)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One new token per sequence attends to all of its cached tokens (max_context_len, the longest of
    context_lens, is read from the device unless the caller gives it).

    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]. GQA: query head h reads KV head
    h // (num_heads // num_kv_heads), as in Llama; the `group` query heads that share a KV head are handed to
    SDPA as `group` query rows of that KV head, so K and V are never repeated.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    ids = block_ids(block_tables, context_lens, max_len, key_cache.shape[1])  # the same for K and V
    keys = gather_blocks(key_cache, ids, max_len).transpose(1, 2)  # [S, Hkv, L, D]
    values = gather_blocks(value_cache, ids, max_len).transpose(1, 2)  # [S, Hkv, L, D]
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)  # [S, Hkv, G, D]
    in_context = torch.arange(max_len, device=query.device) < context_lens[:, None]  # [S, L]
    out = F.scaled_dot_product_attention(
        q, keys.float(), values.float(), attn_mask=in_context[:, None, None, :], scale=scale
    )  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per sequence attends causally to the sequence's cached tokens and to itself.

    query [num_tokens, num_heads, head_dim]: the sequences' new tokens, concatenated in order.
    query_start_loc int32 [num_seqs + 1]: sequence b's tokens are query[query_start_loc[b]:query_start_loc[b+1]].
    context_lens int32 [num_seqs]: cached tokens after this chunk was written, so the chunk's i-th token sits at
    position context_lens[b] - query_len[b] + i and sees keys 0..that position.
    Covers a whole prompt, a chunk of one (chunked prefill), and the tail after a prefix-cache hit.
    max_query_len and max_context_len, the longest chunk and context, are read from the device unless given.
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    starts = query_start_loc[:-1].long()  # [S]
    query_lens = query_start_loc[1:].long() - starts  # [S]
    max_q = int(query_lens.max()) if max_query_len is None else max_query_len
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len

    # Pad the ragged queries to [S, max_q]; padded rows are computed and thrown away.
    i = torch.arange(max_q, device=device)
    is_real = i[None, :] < query_lens[:, None]  # [S, max_q]
    token_index = (starts[:, None] + i[None, :]).clamp(max=num_tokens - 1)  # [S, max_q]
    q = query.float().index_select(0, token_index.view(-1)).view(num_seqs, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * group, head_dim)  # rows (query, group)
    q_pos = context_lens.long()[:, None] - query_lens[:, None] + i[None, :]  # [S, max_q]
    causal = torch.arange(max_len, device=device)[None, None, :] <= q_pos[:, :, None]  # [S, max_q, L]
    causal = causal.repeat_interleave(group, dim=1)[:, None]  # [S, 1, max_q * G, L]

    ids = block_ids(block_tables, context_lens, max_len, key_cache.shape[1])  # the same for K and V
    keys = gather_blocks(key_cache, ids, max_len).transpose(1, 2)  # [S, Hkv, L, D]
    values = gather_blocks(value_cache, ids, max_len).transpose(1, 2)  # [S, Hkv, L, D]
    out = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=causal, scale=scale)
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)  # [S, max_q, Hkv, G, D]
    return out.reshape(num_seqs, max_q, num_heads, head_dim)[is_real].to(query.dtype)  # [num_tokens, H, D]
