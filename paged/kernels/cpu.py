"""The CPU paged-attention kernel (guide §7): cpu_attention.cpp, built on first use and cached.

    reshape_and_cache        write a step's K/V into the pools through the slot mapping
    paged_decode_attention   one new token per sequence attends to its context, read in place in the pool
    paged_prefill_attention  a chunk of new tokens per sequence attends causally to its context and itself

The Triton kernels' arguments (less their version and split choices), semantics and input checks (checks.py),
so the same bad input raises the same ValueError. The same library holds three small per-layer ops of the Llama block,
fused (cpu_layer_ops.cpp: RMSNorm after the residual add, RoPE in place, SiLU-and-multiply), which the engine
uses beside the kernel.

The C++ files are compiled by torch's extension machinery (torch.utils.cpp_extension) the first time they are needed,
with OpenMP so that at::parallel_for runs on torch's own threads (Apple's clang has no -fopenmp: there the library is
built without it, and its loops may run on one thread, with the same results), and for the vector instructions torch
itself uses on this CPU; the library is kept under torch's extension cache ($TORCH_EXTENSIONS_DIR where it is set),
named by a hash of the sources and the flags, and later processes load it in milliseconds. Its ops are torch ops (torch.ops.paged_cpu.*): the profiler names
them, and the engine calls them per layer without the Python checks (the C++ still keeps every access inside its
tensor).

Where there is no C++ compiler, or the build fails, `load()` returns None after one warning that says why, and
the engine uses the torch reference (paged.model.attention) instead.
"""

import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from paged.kernels.checks import check_cache_write, check_decode, check_prefill

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_attention.cpp", "cpu_layer_ops.cpp")]
ISA_FLAGS = {  # torch's own vector level on this CPU -> the compiler flags that allow the same instructions
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
}
OPENMP = [] if sys.platform == "darwin" else ["-fopenmp"]  # Apple's clang rejects -fopenmp

_ops = None  # torch.ops.paged_cpu once loaded
_failure = None  # why it could not be built, once known


def build_flags() -> list[str]:
    # -ffp-contract=off: a * b + c keeps its two roundings, as in torch's own elementwise ops
    return ["-O3", *OPENMP, "-ffp-contract=off", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


def library_name() -> str:
    """A name that changes whenever the sources, the flags or torch change, so a cached build is never stale."""
    digest = hashlib.sha256(
        b"".join(source.read_bytes() for source in SOURCES) + " ".join(build_flags() + [torch.__version__]).encode()
    )
    return f"paged_cpu_attention_{digest.hexdigest()[:12]}"


def compiler() -> str | None:
    """The path of the C++ compiler torch's extension machinery would use ($CXX, else c++), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def load():
    """torch.ops.paged_cpu, compiled on the first call of all (with a message) and loaded from the cache after;
    None, with one warning, where it cannot be built."""
    global _ops, _failure
    if _ops is not None or _failure is not None:
        return _ops
    from torch.utils import cpp_extension

    name = library_name()
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    library = build_dir / f"{name}.so"
    try:
        if library.is_file():
            torch.ops.load_library(str(library))
        else:
            if compiler() is None:
                raise RuntimeError(
                    f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r}; set CXX to name one)"
                )
            print(
                f"Building the CPU paged-attention kernel ({', '.join(s.name for s in SOURCES)}; once, "
                f"about a minute)...",
                file=sys.stderr,
                flush=True,
            )
            build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name,
                [str(s) for s in SOURCES],
                extra_cflags=build_flags(),
                extra_ldflags=OPENMP,
                build_directory=str(build_dir),
                is_python_module=False,
            )
            print(f"Built and cached in {build_dir}", file=sys.stderr, flush=True)
    except Exception as error:  # no compiler, no ninja, a failed build: say so once and let the caller fall back
        _failure = _reason(error)
        warnings.warn(
            f"the CPU paged-attention kernel could not be built ({_failure}); the engine attends with "
            f"the torch reference (paged.model.attention) instead, which is slower",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    _ops = torch.ops.paged_cpu
    return _ops


def missing() -> str | None:
    """None where the library is built (or loads from the cache); otherwise one line that says why it is not."""
    with warnings.catch_warnings():  # the line returned says it instead
        warnings.simplefilter("ignore", RuntimeWarning)
        if load() is not None:
            return None
    return f"the C++ kernel could not be built here ({_failure}); the engine attends with the torch reference instead"


def _reason(error: Exception) -> str:
    """The lines of a build failure that say what went wrong (a compiler's output is long), or its message."""
    lines = str(error).splitlines()
    errors = [line.strip() for line in lines if "error" in line.lower() and not line.startswith(("c++", "[", "FAILED"))]
    return "; ".join(errors[:3]) or (lines[0] if lines else type(error).__name__)


def _require():
    ops = load()
    if ops is None:
        raise RuntimeError(f"the CPU paged-attention kernel is not available: {_failure}")
    return ops


def _check_on_cpu(key_cache):
    if key_cache.device.type != "cpu":
        raise ValueError(
            f"key_cache is on {key_cache.device}: this kernel runs on the CPU "
            f"(the Triton kernels in `paged.kernels` serve a GPU)"
        )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write key, value [num_tokens, num_kv_heads, head_dim] into the pools at slot_mapping [num_tokens], in place;
    slot = block_id * block_size + offset, -1 skips a token. Keys and values are cast to the pool's dtype."""
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    _check_on_cpu(key_cache)
    _require().reshape_and_cache(
        key.to(key_cache.dtype), value.to(key_cache.dtype), key_cache, value_cache, slot_mapping
    )


def paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale):
    """query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]: each sequence's one new token
    attends to its context_lens[s] cached tokens, read through block_tables[s] where they lie in the pool."""
    check_decode(query, key_cache, value_cache, block_tables, context_lens)
    _check_on_cpu(key_cache)
    return _require().decode(query, key_cache, value_cache, block_tables, context_lens, scale)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale):
    """query [num_tokens, num_heads, head_dim], sequence b's rows query_start_loc[b]:query_start_loc[b + 1], the
    last query_len of its context_lens[b] positions: each row attends causally. Returns [num_tokens, H, D]."""
    check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    _check_on_cpu(key_cache)
    return _require().prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)
