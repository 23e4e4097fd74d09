"""LoRA shrink and expand over segments of tokens (guide §16): Punica's and S-LoRA's SGMV in Triton.

A step's tokens come in segments, each a run of consecutive tokens under one adapter, whose weights sit in a slot
of the stacked A [num_slots, rank, in] and B [num_slots, out, rank]. The update of a LoRA projection is two
skinny matmuls per segment: shrink y = x A^T down to the rank, then expand out += y B^T back up. Both kernels
launch one grid over every segment at once:

    axis 0: blocks of BLOCK_M tokens within a segment (enough for the longest; shorter segments mask the rest)
    axis 1: blocks of output columns (the rank for shrink, out_features for expand)
    axis 2: the segment, which names the slot whose weights its programs read

so a batch mixing adapters costs one launch per half, not one per adapter. Expand adds into out in place, and
out may be a column slice of a fused projection's output (q, k, v in one; gate and up in another): strides carry
the slice. Accumulation is in fp32. The torch reference is paged.lora.sgmv_shrink / sgmv_expand; tests compare
the two in Triton's interpreter (fp32 there: it has no bf16 dot).

Shapes:
    x       [num_tokens, in]            lora_a  [num_slots, rank, in]        -> y [num_tokens, rank]
    y       [num_tokens, rank]          lora_b  [num_slots, out, rank]       out [num_tokens, out] += y B^T
    segment starts, ends, slots: int32 [num_segments]
"""

import torch

from paged.kernels.interpreter import tl, triton  # Triton, in its interpreter where there is no GPU

_BLOCK_M = 16  # tokens per program (older Triton releases need at least 16 for tl.dot)
_BLOCK_N = 64  # output columns per program
_BLOCK_K = 32  # reduction step


@triton.jit
def sgmv_kernel(
    in_ptr,
    weight_ptr,
    out_ptr,  # in [num_tokens, K], weight [num_slots, N, K], out [num_tokens, N]
    seg_start_ptr,
    seg_end_ptr,
    seg_slot_ptr,  # int32 [num_segments]
    N,
    K,
    stride_im,
    stride_ik,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    ACCUMULATE: tl.constexpr,  # expand adds into out; shrink overwrites it
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(seg_start_ptr + segment)
    end = tl.load(seg_end_ptr + segment)
    slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token indices
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    row_mask, col_mask = rows < end, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            in_ptr + rows[:, None] * stride_im + ks[None, :] * stride_ik,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            weight_ptr + slot * stride_ws + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(w.dtype), w, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(inputs, weight, out, segments, accumulate: bool) -> None:
    num_slots, n, k = weight.shape
    grid = (triton.cdiv(segments.max_len, _BLOCK_M), triton.cdiv(n, _BLOCK_N), len(segments.starts))
    sgmv_kernel[grid](
        inputs,
        weight,
        out,
        segments.start_tensor,
        segments.end_tensor,
        segments.slot_tensor,
        n,
        k,
        inputs.stride(0),
        inputs.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        out.stride(1),
        ACCUMULATE=accumulate,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, rank, in] -> y [num_tokens, rank] on the segments' tokens
    (paged.lora.Segments; rows outside every segment are left unset)."""
    y = x.new_empty(x.shape[0], lora_a.shape[1])
    _launch(x, lora_a, y, segments, accumulate=False)
    return y


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, segments) -> None:
    """out [num_tokens, out_features] += y [num_tokens, rank] @ B_slot^T per segment, in place;
    lora_b [num_slots, out_features, rank]; out may be a column slice of a wider tensor."""
    _launch(y, lora_b, out, segments, accumulate=True)
