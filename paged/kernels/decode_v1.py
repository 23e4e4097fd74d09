"""Paged decode attention, version 1: one program per (sequence, query head) (guide §7 "the paged kernel").

This is the guide's §5 pseudocode, line for line. At decode time every sequence brings one new query vector per
head and must attend to all `context_len` keys and values it has cached. Those do not sit in one contiguous
array: they are scattered over fixed-size blocks of the pool, and the sequence's row of the block table lists
them in order. So the program walks its table:

    for each logical block j of the sequence:
        physical = block_tables[seq, j]             # the indirection: one int32 load per block
        K_j, V_j = key_cache[physical], value_cache[physical]   # [block_size, head_dim] for this KV head
        scores   = q . K_j * scale                  # [block_size]; positions past context_len masked to -inf
        update the running max m, the running sum l and the output accumulator acc (online softmax)
    out = acc / l

Online softmax keeps the softmax exact while reading each block once: when a new block raises the maximum from
m to m', everything accumulated so far is rescaled by exp(m - m'). Only the last block can be partly filled;
the mask `position < context_len` turns its empty slots into -inf so they get weight exp(-inf) = 0.
Exponentials are taken base 2 (exp2 is one instruction on a GPU): scores are pre-multiplied by log2(e).

Query head h reads KV head h // (num_heads // num_kv_heads) (GQA, as in Llama). With GQA every query head of a
group loads the same K/V blocks again; version 2 fixes that, and also splits long contexts over several programs.

Shapes (NHD layout):
    query, out              [num_seqs, num_heads, head_dim]
    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables            int32 [num_seqs, max_blocks_per_seq]
    context_lens            int32 [num_seqs]
"""

import torch

from paged.kernels.interpreter import tl, triton  # Triton, in its interpreter where there is no GPU

LOG2E = 1.4426950408889634


@triton.jit
def decode_v1_kernel(
    out_ptr,
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens_ptr,  # int32 [num_seqs]
    qk_scale,  # scale * log2(e)
    stride_os,
    stride_oh,
    stride_od,
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
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two)
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(query_ptr + seq * stride_qs + head * stride_qh + d * stride_qd, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale  # [BLOCK_D]

    s = tl.arange(0, BLOCK_SIZE)  # offsets inside a block
    m = tl.full([], -float("inf"), tl.float32)  # running max (log2 units)
    l = tl.full([], 0.0, tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of p * v
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    for j in range(0, num_blocks):
        physical = tl.load(block_tables_ptr + seq * stride_bts + j * stride_btb).to(tl.int64)
        offs = physical * stride_cb + s[:, None] * stride_cs + kv_head * stride_ch + d[None, :] * stride_cd
        in_context = j * BLOCK_SIZE + s < context_len  # [BLOCK_SIZE] tail mask
        kv_mask = in_context[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, BLOCK_D]
        v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.sum(q[None, :] * k, axis=1)  # [BLOCK_SIZE]
        scores = tl.where(in_context, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))  # finite: every walked block holds >= 1 token
        alpha = tl.exp2(m - m_new)  # rescales the old sum and accumulator
        p = tl.exp2(scores - m_new)  # [BLOCK_SIZE]
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [BLOCK_D]
        m = m_new

    out = acc / l
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def paged_decode_v1(query, key_cache, value_cache, block_tables, context_lens, scale):
    """Launch a (num_seqs, num_heads) grid. Inputs are assumed valid (see paged.kernels.paged_decode_attention)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)  # [num_seqs, num_heads, head_dim]
    decode_v1_kernel[(num_seqs, num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * LOG2E,
        *out.stride(),
        *query.stride(),
        *key_cache.stride(),
        *block_tables.stride(),
        head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
