"""Linear layers whose weights are packed once for the CPU's matmul kernel (guide §11: a decode step of a small
batch is mostly the model's matmuls, each reading every weight of the model once for the whole batch).

`F.linear` takes a weight as a plain row-major [out, in] tensor. On a CPU it calls a BLAS routine, which copies
panels of that weight into the order its innermost loop reads them, on every call, and for a batch of a few tokens
that copying is a large share of the matmul. oneDNN can reorder a weight once, ahead of time:
`torch.ops.mkldnn._reorder_linear_weight` returns it in oneDNN's blocked layout (an opaque tensor of layout
`torch._mkldnn`, same shape and dtype), and `torch.ops.mkldnn._linear_pointwise` multiplies by it as it is. vLLM's
CPU backend does the same to every unquantized linear layer (`dispatch_cpu_unquantized_gemm`, through a oneDNN
handle of its own). The products equal F.linear's up to the order of the additions.

`pack` is used on x86-64 CPUs, where its effect was measured (benchmarks/step_profile.py --no-packed-weights shows
it), for the dtypes oneDNN can pack there: fp32 on any of them, bf16 only with AVX-512 or AVX-NE-CONVERT. Anywhere
else, or with PAGED_PACK_WEIGHTS=0 in the environment, a weight stays as it is and `linear` is F.linear.
"""

import os
import platform

import torch
import torch.nn.functional as F

def can_pack(weight: torch.Tensor) -> bool:
    """Read when a model is set up, so PAGED_PACK_WEIGHTS=0 set then applies to the models made after it."""
    return (os.environ.get("PAGED_PACK_WEIGHTS", "1") != "0" and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and platform.machine().lower() in ("x86_64", "amd64"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] reordered for oneDNN's matmul, or weight itself where it cannot be packed."""
    if not can_pack(weight):
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:   # a dtype this CPU's oneDNN does not pack (bf16 without AVX-512 or AVX-NE-CONVERT)
        return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight^T [in, out] (+ bias [out]), for a packed weight or a plain one."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
