"""What the engine accepts (guide §11): prompts, token ids and numeric settings, checked before anything is queued.

Every check raises an `ArgumentError`, a `ValueError` whose message names the argument and the limit, so the caller
learns what to change, and whose `.argument` names it for a program (the server's OpenAI error `param`); a refused
call leaves nothing behind in the engine.

Prompts:
  - a string is text: the tokenizer turns it into token ids (so "123" is the text "123", not token 123);
  - a list or tuple of token ids is taken as it is: Python ints, or integer scalars of numpy or torch, never bools
    or floats (a float is not silently truncated);
  - `generate` takes one prompt or a list of prompts; an empty list is an empty batch.
"""

import math
import numbers
import operator

import psutil


class ArgumentError(ValueError):
    """A bad argument: the message says what is wrong, `argument` names the argument (a request's field) it is about.
    Picklable with its argument, since the engine core's errors cross a pipe to the server."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument

    def __reduce__(self):
        return type(self), (self.argument, str(self))


def integer(name: str, value, low: int | None = None, high: int | None = None, argument: str | None = None) -> int:
    """value as a Python int if it is an integer (not a bool) within [low, high]; else an ArgumentError naming it.
    argument: the argument the error is about, when name is one of its elements ("prompt" for "prompt[3]")."""
    argument = argument or name
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # numpy's and torch's integer scalars too; not an array of several
    except TypeError:
        raise ArgumentError(argument, f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if low is not None and value < low:
        raise ArgumentError(argument, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ArgumentError(argument, f"{name} must be <= {high}, got {value}")
    return value


def block_size_of(block_size) -> int:
    """block_size as an int if it is a positive power of two (a block's slots, as the kernels index them)."""
    block_size = integer("block_size", block_size, low=1)
    if block_size & (block_size - 1):
        raise ArgumentError("block_size", f"block_size must be a power of two, got {block_size!r}")
    return block_size


def real(name: str, value) -> float:
    """value as a float if it is a finite real number (not a bool); else an ArgumentError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ArgumentError(name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def token_id_list(name: str, values) -> list[int]:
    """A list or tuple of integer token ids >= 0 -> list[int]."""
    if not isinstance(values, (list, tuple)):
        raise ArgumentError(name, f"{name} must be a list of token ids, got {type(values).__name__}")
    return [integer(f"{name}[{i}]", v, low=0, argument=name) for i, v in enumerate(values)]


def as_prompt_list(prompts) -> list:
    """One prompt (a string or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ArgumentError(
            "prompts",
            f"prompts must be a string, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__} (for an array or tensor of ids, pass .tolist())",
        )
    if prompts and not isinstance(prompts[0], (str, list, tuple)):
        return [prompts]  # a single prompt of token ids
    return list(prompts)


def prompt_token_ids(prompt, tokenizer) -> list[int]:
    """The token ids of one prompt: a string through the tokenizer, a list of ids checked one by one."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ArgumentError("prompt", "prompt is a string but the engine has no tokenizer; pass token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone UTF-16 surrogate: not text any tokenizer takes
            raise ArgumentError(
                "prompt",
                f"prompt holds a lone UTF-16 surrogate at character {error.start}, which "
                f"is not text; pass valid Unicode",
            ) from None
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, (list, tuple)):
        raise ArgumentError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return token_id_list("prompt", prompt)


def available_memory(device=None) -> int | None:
    """Bytes a new allocation may take: on a GPU its free memory; on the host what psutil counts as available (on
    Linux /proc/meminfo's MemAvailable: free memory plus what the page cache would give back); None if the system
    says nothing. Sizes the user gives (tiers, LoRA slots) are checked against it before they are allocated, so a
    typo gets a ValueError instead of an allocator's error."""
    if device is not None:
        import torch

        if torch.device(device).type == "cuda":
            return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        return psutil.virtual_memory().available
    except (OSError, RuntimeError):
        return None
