"""The paged attention kernels (guide §5-§7), each checked against the torch reference in paged.model.attention.

    triton_ops.py    the Triton kernels' entry points: reshape_and_cache, paged_decode_attention,
                     paged_prefill_attention (checked), launch_decode, launch_prefill, write_cache (unchecked)
    cache_write.py, decode_v1.py, decode_v2.py, prefill.py   the Triton kernels themselves
    lora.py          LoRA's shrink and expand over segments of tokens in Triton (guide §16)
    cpu.py           the same three attention operations for a CPU, in C++ (cpu_attention.cpp), with the same checks
    checks.py        the input checks every kernel shares
    interpreter.py   importing Triton, and its interpreter where there is no GPU

Triton is optional (pip has it for Linux only): importing this package imports neither Triton nor the C++ library.
`paged.kernels.paged_decode_attention` and the other Triton entry points load triton_ops.py on first use; where
Triton is not installed that raises ModuleNotFoundError with the line triton_missing() returns.
"""

import importlib
import importlib.util

_TRITON_OPS = (
    "reshape_and_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "launch_decode",
    "launch_prefill",
    "write_cache",
    "MAX_SPLITS",
)


def triton_missing() -> str | None:
    """None where Triton can be imported; otherwise one line that says why its kernels cannot run here."""
    if importlib.util.find_spec("triton") is not None:
        return None
    return (
        "Triton is not installed here (pip has it for Linux only), so the Triton kernels cannot run; the "
        "engine attends with the C++ kernel or the torch reference instead"
    )


def __getattr__(name: str):
    if name in _TRITON_OPS:
        return getattr(importlib.import_module("paged.kernels.triton_ops"), name)
    raise AttributeError(f"module 'paged.kernels' has no attribute {name!r}")
