"""Linear layers whose weights are packed once for the CPU's matmul kernel (guide §11, the engine step: a decode step
of a small batch is mostly the model's matmuls, each reading every weight of the model once for the whole batch).

`F.linear` takes a weight as a plain row-major [out, in] tensor. On a CPU it calls a BLAS routine, which, for more
than one token, copies panels of that weight into the order its innermost loop reads them, on every call. oneDNN
can reorder a weight once, ahead of time: `torch.ops.mkldnn._reorder_linear_weight` returns it in oneDNN's blocked
layout (an opaque tensor of layout `torch._mkldnn`, same shape and dtype), and `torch.ops.mkldnn._linear_pointwise`
multiplies by it as it is. vLLM's CPU backend does the same to every unquantized linear layer
(`dispatch_cpu_unquantized_gemm`, through a oneDNN handle of its own). The products equal F.linear's up to the order
of the additions.

bf16: a CPU without bf16 matmul instructions (before AVX-512 on x86) has no fast bf16 kernel at all; torch falls
back to a generic loop several times slower than its fp32 matmul, and oneDNN refuses to pack bf16. There a bf16
weight is packed as fp32 (exactly: every bf16 number is an fp32 number) and the input is widened to fp32: bf16
inputs, fp32 products and sums, one rounding of the output to bf16, which is what a bf16 matmul unit does, at the
speed of the fp32 kernel, for twice the weights' bf16 memory.

Packing is used on x86-64 CPUs, where its effect was measured (benchmarks/step_profile.py --no-packed-weights);
anywhere else, or with PAGED_PACK_WEIGHTS=0 in the environment, a weight stays as it is and `linear` is F.linear.
"""

import os
import platform

import torch
import torch.nn.functional as F


def can_pack(weight: torch.Tensor) -> bool:
    """Read when a model is set up, so PAGED_PACK_WEIGHTS=0 set then applies to the models made after it."""
    return (
        os.environ.get("PAGED_PACK_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] reordered for oneDNN's matmul (fp32 for a bf16 weight on a CPU without bf16 matmuls), or
    weight itself where it cannot be packed."""
    if not can_pack(weight):
        return weight
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        weight = weight.float()
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight^T [in, out] (+ bias [out]), for a packed weight or a plain one."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if weight.dtype != x.dtype:  # a bf16 layer whose weight pack() holds in fp32
        bias = None if bias is None else bias.float()
        return torch.ops.mkldnn._linear_pointwise(x.float(), weight, bias, "none", [], "").to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
