"""The per-layer ops around attention (guide §7, the engine step): RMSNorm after the residual add, RoPE, and
SiLU-and-multiply, in torch or fused by the C++ CPU library (paged/kernels/cpu.py), with the same bits.

vLLM has one kernel for each (`fused_add_rms_norm`, `rotary_embedding`, `silu_and_mul`); here they are torch code,
and the C++ library fuses them for fp32 and bf16 on the CPU (the fused RMSNorm only on x86 CPUs with AVX2 or
AVX-512, where its order of additions is torch's). Which ones a model runs is a `LayerOps`, chosen by
`get_layer_ops`: the fused ones go with the C++ attention kernel, the torch ones with every other backend.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As LlamaRMSNorm (x * rsqrt(mean(x^2) + eps) * weight), in one fused op; bit-equal to HF's in fp32."""
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta (the residual add, in place; skipped when delta is None), then rms_norm(hidden): vLLM's
    fused_add_rms_norm, written in torch."""
    if delta is not None:
        hidden += delta
    return rms_norm(hidden, weight, eps)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """HF's sin table [positions, head_dim] with its first half negated, for apply_rope."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos and signed_sine(sin) [num_tokens, head_dim], HF's tables.

    HF rotates x = [x1, x2] into x * cos + [-x2, x1] * sin. Rolling x by half a head gives [x2, x1]; the minus
    sign lives in signed_sin. The products are the same floats, so the result is bit-equal to HF's.
    """
    out = x * cos[:, None, :]
    return out.add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin[:, None, :]))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * intermediate] -> silu(gate) * up [num_tokens, intermediate], as HF's LlamaMLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


@dataclass(frozen=True)
class LayerOps:
    """The three ops a layer runs besides its matmuls and attention, each with the arguments of the torch one above."""

    # (hidden [num_tokens, hidden], delta [num_tokens, hidden] or None, weight [hidden], eps) -> [num_tokens, hidden]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]
    # (x [num_tokens, heads, head_dim], cos [num_tokens, head_dim], signed sin [num_tokens, head_dim]) -> like x
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # gate_up [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_LAYER_OPS = LayerOps(add_rms_norm=add_rms_norm, rope=apply_rope, silu_and_mul=silu_and_mul)


def get_layer_ops(attention_backend: str, dtype: torch.dtype) -> LayerOps:
    """The layer ops for a model of `dtype` attending with the backend named `attention_backend` (the name of the
    one get_attn_backend gave): the C++ library's fused ones beside its attention kernel ("cpu"), for fp32 and bf16
    (the fused RMSNorm only where the CPU has AVX2 or AVX-512), torch's everywhere else."""
    from paged.kernels import cpu

    ops = cpu.load() if attention_backend == "cpu" else None  # loaded already, by the "cpu" attention backend
    if ops is None:
        return TORCH_LAYER_OPS
    fused = dtype in (torch.float32, torch.bfloat16)  # the dtypes the fused layer ops are written for
    # the fused RMSNorm adds in the order of torch's sum on an x86 CPU with AVX2 (or AVX-512)
    fused_norm = fused and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return LayerOps(
        add_rms_norm=ops.rms_norm if fused_norm else add_rms_norm,
        rope=ops.rotary if fused else apply_rope,
        silu_and_mul=ops.silu_and_mul if fused else silu_and_mul,
    )
