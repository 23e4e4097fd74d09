"""Paged prefill attention: a chunk of new tokens attends to its cached prefix and to itself, causally
(guide §7 "the paged kernel", §9 prefix caching, §12 chunked prefill).

A prefill is no longer one contiguous prompt. With chunked prefill a long prompt arrives in pieces, and with a
prefix-cache hit the first blocks of the prompt are already in the pool and only the tail is new. In both cases
the new tokens (the chunk) have already been written to the cache by the cache-write kernel, and each of them
must attend to every earlier token of its sequence, which now lives in blocks the block table points at.

The kernel is flash attention with one change: keys and values are read through the block table instead of
from a contiguous [seq_len, head_dim] array, so no gather into a contiguous copy ever happens. One program
owns BLOCK_M query tokens of one sequence and one query head:

    prefix   = context_len - query_len          # tokens cached before this chunk
    q_pos[i] = prefix + i                       # absolute position of the chunk's i-th token
    for each tile of BLOCK_N keys up to the last position this program needs:
        look up the tile's physical blocks in the table (one int32 per block), load K and V
        scores = Q @ K^T * scale, masked where key position > q_pos (causal) or >= context_len
        online-softmax update of m, l, acc                  (as in decode, one row per query token)
    out = acc / l

Sequences are ragged: query_start_loc[b]..query_start_loc[b + 1] are sequence b's rows of `query`. The grid
is sized by the longest chunk; programs past the end of a shorter chunk return at once. Every row sees key 0,
so the first tile makes every running max finite. For clarity the causal mask is applied on every tile
(a faster kernel would skip it on tiles wholly below the diagonal). GQA: query head h reads KV head
h // (num_heads // num_kv_heads); prefill is compute-bound, so heads are not grouped here.

Shapes (NHD layout):
    query, out              [num_tokens, num_heads, head_dim]      the chunks of all sequences, concatenated
    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables            int32 [num_seqs, max_blocks_per_seq]
    query_start_loc         int32 [num_seqs + 1]
    context_lens            int32 [num_seqs]                       cached tokens after this chunk was written
"""

import torch

from paged.kernels.interpreter import tl, triton  # Triton, in its interpreter where there is no GPU

LOG2E = 1.4426950408889634
MIN_TILE = 32  # keys per K/V tile when blocks are smaller than this


@triton.jit
def prefill_kernel(
    out_ptr,
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    context_lens_ptr,  # int32 [num_seqs]
    qk_scale,  # scale * log2(e)
    stride_ot,
    stride_oh,
    stride_od,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bts,
    stride_btb,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two)
    BLOCK_M: tl.constexpr,  # query tokens per program, >= 16
    BLOCK_N: tl.constexpr,  # keys per tile, a multiple of BLOCK_SIZE, >= 16
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two, >= 16
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - query_len

    i = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of the chunk
    i_mask = i < query_len
    q_pos = prefix + i  # [BLOCK_M] absolute positions
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = i_mask[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + (q_start + i)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    kv_end = prefix + tl.minimum(q_tile * BLOCK_M + BLOCK_M, query_len)  # last key needed + 1
    n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile in range(0, tl.cdiv(kv_end, BLOCK_N)):
        token = tile * BLOCK_N + n  # [BLOCK_N] key positions
        in_range = token < kv_end
        physical = tl.load(
            block_tables_ptr + seq * stride_bts + (token // BLOCK_SIZE) * stride_btb, mask=in_range, other=0
        ).to(tl.int64)  # [BLOCK_N] block ids
        offs = (
            physical[:, None] * stride_cb
            + (token % BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + d[None, :] * stride_cd
        )  # [BLOCK_N, BLOCK_D]
        kv_mask = in_range[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (token[None, :] <= q_pos[:, None]) & in_range[None, :]  # causal and tail mask
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / l[:, None]
    tl.store(
        out_ptr + (q_start + i)[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len):
    """Launch a (num_seqs, cdiv(max_query_len, BLOCK_M), num_heads) grid.

    Inputs are assumed valid (see paged.kernels.paged_prefill_attention)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out
    block_m = 64 if query.is_cuda else 16  # small tiles keep the CPU interpreter quick
    prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale * LOG2E,
        *out.stride(),
        *query.stride(),
        *key_cache.stride(),
        *block_tables.stride(),
        head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=max(block_size, MIN_TILE),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out
