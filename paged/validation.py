"""What the engine accepts (guide §11): prompts, token ids and numeric settings, checked before anything is queued.

Every check raises a `ValueError` that names the argument and the limit, so the caller learns what to change,
and a refused call leaves nothing behind in the engine.

Prompts:
  - a string is text: the tokenizer turns it into token ids (so "123" is the text "123", not token 123);
  - a list or tuple of token ids is taken as it is: Python ints, or integer scalars of numpy or torch, never bools
    or floats (a float is not silently truncated);
  - `generate` takes one prompt or a list of prompts; an empty list is an empty batch.
"""

import math
import numbers
import operator
import os


def integer(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """value as a Python int if it is an integer (not a bool) within [low, high]; else a ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # numpy's and torch's integer scalars too; not an array of several
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def block_size_of(block_size) -> int:
    """block_size as an int if it is a positive power of two (a block's slots, as the kernels index them)."""
    block_size = integer("block_size", block_size, low=1)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")
    return block_size


def real(name: str, value) -> float:
    """value as a float if it is a finite real number (not a bool); else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def token_id_list(name: str, values) -> list[int]:
    """A list or tuple of integer token ids >= 0 -> list[int]."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(values).__name__}")
    return [integer(f"{name}[{i}]", v, low=0) for i, v in enumerate(values)]


def as_prompt_list(prompts) -> list:
    """One prompt (a string or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got "
                         f"{type(prompts).__name__} (for an array or tensor of ids, pass .tolist())")
    if prompts and not isinstance(prompts[0], (str, list, tuple)):
        return [prompts]  # a single prompt of token ids
    return list(prompts)


def prompt_token_ids(prompt, tokenizer) -> list[int]:
    """The token ids of one prompt: a string through the tokenizer, a list of ids checked one by one."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is a string but the engine has no tokenizer; pass token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:   # a lone UTF-16 surrogate: not text any tokenizer takes
            raise ValueError(f"prompt holds a lone UTF-16 surrogate at character {error.start}, which is not "
                             f"text; pass valid Unicode") from None
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return token_id_list("prompt", prompt)


def available_memory(device=None) -> int | None:
    """Bytes a new allocation may take: on a GPU its free memory; on the host Linux's MemAvailable (free memory
    plus what the page cache would give back), else the free pages, else all of memory (sysconf); None if the
    system says nothing. Sizes the user gives (tiers, LoRA slots) are checked against it before they are
    allocated, so a typo gets a ValueError instead of an allocator's error."""
    if device is not None:
        import torch
        if torch.device(device).type == "cuda":
            return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            continue
    return None
