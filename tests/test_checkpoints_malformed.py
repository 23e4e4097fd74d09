"""Malformed checkpoint folders: every broken safetensors header, index or config is a ValueError that names the
file and what is wrong with it, never a TypeError, KeyError, AttributeError, MemoryError or OverflowError from
deep inside the reader."""

import json
import struct
from pathlib import Path

import pytest
import torch
from test_checkpoints import copy_folder, random_model, save

from paged import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """{"single": a folder with model.safetensors, "sharded": one with an index and bf16 shards}."""
    root, model = tmp_path_factory.mktemp("good"), random_model("llama-1to1-hd64")
    return {"single": save(model, root / "single"), "sharded": save(model, root / "sharded", torch.bfloat16, True)}


def rewrite_header(path: Path, change) -> None:
    """Replace a safetensors file's header by change(header) (a JSON value, or raw bytes), data kept."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = change(json.loads(blob[8 : 8 + length]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + length :])


def first_tensor(header: dict) -> str:
    return next(name for name in header if name != "__metadata__")


def set_entry(key, value):
    def change(header):
        header[first_tensor(header)][key] = value
        return header

    return change


def replace_length(path: Path, length: int) -> None:
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", length) + blob[8:])


SINGLE = "model.safetensors"
HEADERS = {  # what is done to model.safetensors -> what the message must say
    "length past the end": (lambda p: replace_length(p, 2**63), "header length .* runs past the file's end"),
    "length of 2**64 - 1": (lambda p: replace_length(p, 2**64 - 1), "runs past the file's end"),
    "eight bytes only": (lambda p: p.write_bytes(p.read_bytes()[:8]), "runs past the file's end"),
    "four bytes only": (lambda p: p.write_bytes(p.read_bytes()[:4]), "not a readable safetensors file"),
    "header not utf-8": (lambda p: rewrite_header(p, lambda h: b"\xff\xfe" + b" " * 10), "not a readable"),
    "header not JSON": (lambda p: rewrite_header(p, lambda h: b"{oops"), "not a readable"),
    "header a list": (lambda p: rewrite_header(p, lambda h: [1, 2]), "header is not a JSON object"),
    "header nested deep": (lambda p: rewrite_header(p, lambda h: b"[" * 100_000 + b"]" * 100_000), "not a readable"),
    "entry a number": (lambda p: rewrite_header(p, lambda h: {**h, first_tensor(h): 5}), "described by int"),
    "no dtype": (lambda p: rewrite_header(p, set_entry("dtype", None)), "has no dtype name"),
    "shape a string": (lambda p: rewrite_header(p, set_entry("shape", "abc")), "has shape 'abc'"),
    "negative size": (lambda p: rewrite_header(p, set_entry("shape", [-1, 64])), "has shape \\[-1, 64\\]"),
    "size a bool": (lambda p: rewrite_header(p, set_entry("shape", [True])), "has shape \\[True\\]"),
    "size huge": (lambda p: rewrite_header(p, set_entry("shape", [2**70, 2**70])), "has shape"),
    "offsets one": (lambda p: rewrite_header(p, set_entry("data_offsets", [0])), "data_offsets \\[0\\]"),
    "offsets reversed": (lambda p: rewrite_header(p, set_entry("data_offsets", [8, 4])), "data_offsets \\[8, 4\\]"),
    "offsets negative": (lambda p: rewrite_header(p, set_entry("data_offsets", [-4, 4])), "data_offsets"),
    "offsets floats": (lambda p: rewrite_header(p, set_entry("data_offsets", [0.0, 4.0])), "data_offsets"),
    "offsets past the end": (lambda p: rewrite_header(p, set_entry("data_offsets", [0, 2**62])), "truncated"),
    "offsets missing": (lambda p: rewrite_header(p, set_entry("data_offsets", None)), "data_offsets None"),
}


@pytest.mark.parametrize("problem", HEADERS)
def test_a_malformed_safetensors_header_is_a_value_error_naming_the_file(good, tmp_path, problem):
    folder = copy_folder(good["single"], tmp_path / "model")
    change, message = HEADERS[problem]
    change(folder / SINGLE)
    with pytest.raises(ValueError, match=f"{SINGLE}.*{message}"):
        LLM(model=str(folder), device="cpu")


INDEX = "model.safetensors.index.json"
INDEXES = {  # what model.safetensors.index.json holds instead
    "not JSON": ("{weight_map", "is malformed"),
    "a list": ("[]", "weight_map must map"),
    "no weight_map": ('{"metadata": {}}', "weight_map must map"),
    "weight_map a list": ('{"weight_map": ["a"]}', "weight_map must map"),
    "a file name a number": ('{"weight_map": {"model.norm.weight": 3}}', "weight_map must map"),
    "a file outside the folder": (
        '{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
        "weight_map must map",
    ),
    "not UTF-8": (b"\xff\xfe\x00", "is malformed"),
}


@pytest.mark.parametrize("problem", INDEXES)
def test_a_malformed_index_is_a_value_error_naming_it(good, tmp_path, problem):
    folder = copy_folder(good["sharded"], tmp_path / "model")
    content, message = INDEXES[problem]
    (folder / INDEX).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=f"{INDEX}.*{message}"):
        LLM(model=str(folder), device="cpu")


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "{not json", '{"model_type": 5}'])
def test_a_malformed_config_is_a_value_error_naming_it(good, tmp_path, content):
    folder = copy_folder(good["single"], tmp_path / "model")
    (folder / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(folder), device="cpu")
