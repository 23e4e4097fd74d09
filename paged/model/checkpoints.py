"""Bring your own model: the checkpoint folder's format, for a Llama, Mistral, Qwen2 or Qwen3 (guide §2).

    LLM(model="/path/to/Qwen3-0.6B")        a folder in transformers' format
    LLM(model="Qwen/Qwen3-0.6B")            a model already in the local Hugging Face cache (never downloaded)

A folder holds config.json, the weights as safetensors (model.safetensors, or shards named by
model.safetensors.index.json) and the tokenizer's files. This module reads that format: where the folder is, its
config and architecture, its weight files and their headers, one tensor's bytes, its tokenizer; model/loader.py
reads the weights into the engine's layout with it. A safetensors file is an 8-byte header length, a JSON header
(each tensor's dtype, shape and byte range) and the raw little-endian bytes; reading those bytes with readinto,
rather than through a memory map, keeps the process holding the weights once: a mapped file's pages would count as
the process's memory until the file is closed.

Everything wrong with a folder is a ValueError naming it: no config.json, an architecture the engine does not run,
a missing, unexpected or misshapen tensor, a tokenizer that cannot be read.
"""

import json
import os
import struct
from pathlib import Path

import torch

from paged.model.architectures import check_supported

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer older Llama checkpoints carry; the table is recomputed


def resolve_folder(model: str, argument: str = "model") -> Path:
    """A folder, or a name ("org/name") of a model in the local Hugging Face cache, read offline."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as error:  # not downloaded; not a valid repository name
        raise ValueError(
            f"{argument} must be 'smollm2', a model folder or the name of a model downloaded to the "
            f"Hugging Face cache; {model!r} is none of them (looked in {constants.HF_HUB_CACHE}; nothing "
            f"is ever downloaded: fetch it first, e.g. `hf download {model}`)"
        ) from error


def read_config(folder: Path, argument: str = "model"):
    """transformers' config for the folder, and the description of its architecture (model/architectures.py)."""
    from transformers import AutoConfig

    if not (folder / CONFIG).is_file():
        raise ValueError(f"model folder {str(folder)!r} has no {CONFIG}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:  # an unknown model_type, bad JSON
        raise ValueError(f"{CONFIG} in {str(folder)!r} cannot be read: {error}") from None
    names = getattr(config, "architectures", None) or [f"(none; model_type {config.model_type!r})"]
    return config, check_supported(names[0], config, f"{argument} {str(folder)!r}")


def read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: where the data starts, and {name: {dtype, shape, data_offsets}}, each entry
    checked to be well formed and to lie within the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header length ({length} bytes) runs past the file's end ({size} bytes)")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError, RecursionError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a readable safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        problem = entry_problem(entry, size - 8 - length)
        if problem is not None:
            raise ValueError(f"{path} is not a readable safetensors file: tensor {name!r} {problem}")
    return 8 + length, header


def entry_problem(entry, data_bytes: int) -> str | None:
    """What is wrong with a header's entry for one tensor, given the bytes of data after the header; None if
    nothing is."""

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(entry, dict):
        return f"is described by {type(entry).__name__}, not a JSON object"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(entry.get("dtype"), str):
        return f"has no dtype name (got {entry.get('dtype')!r})"
    if not isinstance(shape, list) or not all(map(count, shape)):
        return f"has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(count, offsets)) and offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not a range of bytes [begin, end]"
    if offsets[1] > data_bytes:
        return f"ends at byte {offsets[1]} of data, past the file's {data_bytes}: the file is truncated"
    return None


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the shards its index names, or its one file."""
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise ValueError(f"{INDEX} in {str(folder)!r} is malformed: {error}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and name and Path(name).name == name for name in weight_map.values()
        ):
            raise ValueError(
                f"{INDEX} in {str(folder)!r} is malformed: its weight_map must map each tensor to the "
                f"name of a file in the folder"
            )
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise ValueError(
            f"model folder {str(folder)!r} has neither {SINGLE_FILE} nor {INDEX} "
            f"(the engine reads safetensors weights only)"
        )
    for path in files:
        if not path.is_file():
            raise ValueError(f"{INDEX} in {str(folder)!r} names {path.name}, which is missing")
    return files


def read_tensor(f, start: int, name: str, entry: dict, out: torch.Tensor, path: Path) -> None:
    """Read one checkpoint tensor's bytes into `out` (contiguous rows of an engine tensor), converting its dtype."""
    source_dtype = DTYPES.get(entry["dtype"])
    if source_dtype is None:
        raise ValueError(
            f"tensor {name!r} in {path.name} has dtype {entry['dtype']}; the engine reads "
            f"{', '.join(DTYPES)} weights only"
        )
    begin, end = entry["data_offsets"]
    direct = out.device.type == "cpu" and out.dtype == source_dtype
    buffer = out if direct else torch.empty(out.shape, dtype=source_dtype)
    if end - begin != buffer.nbytes:
        raise ValueError(
            f"tensor {name!r} in {path.name} holds {end - begin} bytes, not the {buffer.nbytes} of its shape"
        )
    f.seek(start + begin)
    if f.readinto(buffer.view(-1).view(torch.uint8).numpy()) != buffer.nbytes:
        raise ValueError(f"{path.name} is truncated: tensor {name!r} runs past its end")
    if not direct:
        out.copy_(buffer)


def checkpoint_dtype(folder: Path) -> torch.dtype:
    """The dtype the checkpoint stores its embedding in."""
    for path in weight_files(folder):
        entry = read_header(path)[1].get("model.embed_tokens.weight")
        if entry is not None:
            return DTYPES.get(entry["dtype"], torch.float32)
    raise ValueError(f"model folder {str(folder)!r} is missing tensor 'model.embed_tokens.weight'")


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises many kinds (OSError, ValueError, TypeError, JSON errors)
        raise ValueError(
            f"the tokenizer in {str(folder)!r} cannot be read ({type(error).__name__}: {error}); "
            f"pass tokenizer= to use another"
        ) from None
