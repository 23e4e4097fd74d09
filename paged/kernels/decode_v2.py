"""Paged decode attention, version 2: GQA-grouped and split-KV (flash-decoding) (guide §7 "the paged kernel").

Version 1 has two costs on a real GPU. With GQA (SmolLM2: 9 query heads share 3 KV heads; Llama-3-70B: 64 share
8) the query heads of a group each load the same K/V blocks again. And a batch of a few long sequences makes
only num_seqs * num_heads programs, each walking thousands of tokens alone, while most of the GPU idles.

Version 2 changes the grid to (sequence, KV head, split):

  * GQA grouping. One program serves all GROUP query heads of its KV head. It loads a tile of K (and of V) once
    and multiplies it with the [GROUP, head_dim] block of queries, so K/V bytes are read once per KV head instead
    of once per query head. Older Triton releases refuse a tl.dot with a dimension under 16, so the group is
    padded to BLOCK_G >= 16 rows; the padding rows hold zeros and are never stored.
  * Split-KV. Each sequence's context is cut into NUM_SPLITS equal runs of tiles; each program computes an
    ordinary online softmax over its run and writes a partial output (already divided by its own sum) and the
    log-sum-exp of its scores, lse = m + log2(l). A second, tiny kernel merges the splits of every head:

        w_i = 2 ** (lse_i - max_j lse_j)        out = sum_i w_i * out_i / sum_i w_i

    which is exactly the softmax over the whole context, because out_i carries weight l_i * 2**m_i before it
    was normalised. A split with no tokens (a short sequence, many splits) has lse = -inf and weight 0.
    With one split the kernel writes the final output directly and the merge is skipped.
  * Tiles independent of the block size. A tile is BLOCK_N = max(block_size, 32) tokens. Token n of the
    sequence lives in logical block n // block_size, so the tile loads its BLOCK_N / block_size table entries
    (a broadcast load when the tile is one block: still one int32 per block) and gathers K/V row by row.

Shapes (NHD layout):
    query, out              [num_seqs, num_heads, head_dim]
    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables            int32 [num_seqs, max_blocks_per_seq]
    context_lens            int32 [num_seqs]
    partial_out             fp32 [num_seqs, num_heads, num_splits, head_dim]   (the output itself when 1 split)
    partial_lse             fp32 [num_seqs, num_heads, num_splits]             (log2 units)
"""

import torch

from paged.kernels.interpreter import tl, triton  # Triton, in its interpreter where there is no GPU

LOG2E = 1.4426950408889634
MIN_TILE = 32  # tokens per K/V tile when blocks are smaller than this
MAX_SPLITS = 64


@triton.jit
def decode_v2_split_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim]
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits]
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens_ptr,  # int32 [num_seqs]
    qk_scale,  # scale * log2(e)
    stride_ps,
    stride_ph,
    stride_pp,
    stride_pd,
    stride_ls,
    stride_lh,
    stride_lp,
    stride_qs,
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two)
    BLOCK_N: tl.constexpr,  # tokens per tile, a multiple of BLOCK_SIZE, >= 16
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two, >= 16
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two, >= 16
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(
        query_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_G], -float("inf"), tl.float32)  # running max (log2 units)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # running sum of p @ V
    for tile in range(tile_lo, tile_hi):
        token = tile * BLOCK_N + n  # [BLOCK_N] positions
        in_context = token < context_len  # tail mask
        physical = tl.load(
            block_tables_ptr + seq * stride_bts + (token // BLOCK_SIZE) * stride_btb, mask=in_context, other=0
        ).to(tl.int64)  # [BLOCK_N] block ids
        offs = (
            physical[:, None] * stride_cb
            + (token % BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + d[None, :] * stride_cd
        )  # [BLOCK_N, BLOCK_D]
        kv_mask = in_context[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(in_context[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every tile holds >= 1 token
        alpha = tl.exp2(m - m_new)  # [BLOCK_G]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)  # an empty split keeps l = 0, acc = 0
    out = acc / l_safe[:, None]  # [BLOCK_G, BLOCK_D]
    lse = m + tl.log2(l_safe)  # -inf for an empty split
    out_mask = g_mask[:, None] & d_mask[None, :]
    tl.store(
        partial_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pp + d[None, :] * stride_pd,
        out.to(partial_out_ptr.dtype.element_ty),
        mask=out_mask,
    )
    tl.store(partial_lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lp, lse, mask=g_mask)


@triton.jit
def decode_v2_merge_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim]
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits]
    stride_os,
    stride_oh,
    stride_od,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_pd,
    stride_ls,
    stride_lh,
    stride_lp,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < NUM_SPLITS
    d_mask = d < head_dim
    lse = tl.load(
        partial_lse_ptr + seq * stride_ls + head * stride_lh + p * stride_lp, mask=p_mask, other=-float("inf")
    )  # [BLOCK_P]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite
    w = w / tl.sum(w, axis=0)
    part = tl.load(
        partial_out_ptr + seq * stride_ps + head * stride_ph + p[:, None] * stride_pp + d[None, :] * stride_pd,
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_P, BLOCK_D]
    out = tl.sum(w[:, None] * part, axis=0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def paged_decode_v2(query, key_cache, value_cache, block_tables, context_lens, scale, num_splits):
    """Launch the split kernel on a (num_seqs, num_kv_heads, num_splits) grid, then merge if num_splits > 1.

    Inputs are assumed valid (see paged.kernels.paged_decode_attention)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)  # [num_seqs, num_heads, head_dim]
    if num_splits == 1:
        partial_out = out.unsqueeze(2)  # [num_seqs, num_heads, 1, head_dim]
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    decode_v2_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * LOG2E,
        *partial_out.stride(),
        *partial_lse.stride(),
        *query.stride(),
        *key_cache.stride(),
        *block_tables.stride(),
        head_dim,
        GROUP=group,
        NUM_SPLITS=num_splits,
        BLOCK_SIZE=block_size,
        BLOCK_N=max(block_size, MIN_TILE),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
    )
    if num_splits > 1:
        decode_v2_merge_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            *out.stride(),
            *partial_out.stride(),
            *partial_lse.stride(),
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_P=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
