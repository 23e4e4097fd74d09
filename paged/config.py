"""The engine's settings in one place (guide §11): `EngineConfig`, checked once when it is made.

    config = EngineConfig(block_size=16, max_num_seqs=8, enable_prefix_caching=True)
    engine = LLMEngine(model, tokenizer, config)          # or LLMEngine(model, tokenizer, block_size=16, ...)

Every limit on the settings and its error message live here: a bad value is a ValueError naming the argument, raised
before any engine part is built. `LLM` builds one from its keyword arguments (vLLM's names where vLLM has the
setting), `LLMEngine`, its `Scheduler` and the disaggregation workers share it; it is a plain dataclass, so it pickles
into a worker process. `for_model` completes it with what the model decides (its length, vocabulary, end-of-sequence
tokens and the pool's block count), and `check_prompt` then holds every check a request must pass to be served.
The settings of the chapters' mechanisms live here too (`OffloadConfig`, `SpeculativeConfig`, the LoRA limits), as
they do in vLLM's `vllm/config/` package: the modules that carry them out import their settings, not the other way.
"""

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from paged.geometry import GiB, cdiv
from paged.validation import ArgumentError, available_memory, block_size_of, integer, real

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes of K/V pool when num_blocks is not given
PREEMPTION_MODES = ("recompute", "swap")
MAX_LORAS = 64  # adapter slots on the device at most
MAX_LORA_RANK = 512  # the largest max_lora_rank vLLM offers
MAX_SPECULATIVE_TOKENS = 16
METHOD_KEYS = {"ngram": {"prompt_lookup_max", "prompt_lookup_min"}, "draft_model": {"model", "draft_layers"}}


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


# ---- the settings of the chapters' mechanisms (guide §14, §15) -------------------------------------------


def gib(name: str, value) -> float:
    """A size in GiB: a finite number >= 0, else a ValueError naming it."""
    value = real(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (GiB), got {value}")
    return value


@dataclass(frozen=True)
class OffloadConfig:
    """The engine's offload settings, checked before anything is built."""

    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of swap tier, used when preemption_mode == "swap"
    kv_offloading_size: float | None = None  # GiB of prefix-cache tier; None: no tier
    kv_offload_dir: str | None = None  # None: tiers in host memory; a folder: memory-mapped files there

    @classmethod
    def from_args(
        cls,
        preemption_mode="recompute",
        swap_space=1.0,
        kv_offloading_size=None,
        kv_offload_dir=None,
        enable_prefix_caching=False,
    ) -> "OffloadConfig":
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        swap_space = gib("swap_space", swap_space)
        if kv_offloading_size is not None:
            kv_offloading_size = gib("kv_offloading_size", kv_offloading_size)
            if not enable_prefix_caching:
                raise ValueError(
                    "kv_offloading_size needs enable_prefix_caching=True: the tier keeps the prefix cache's blocks"
                )
        if kv_offload_dir is not None:
            if not isinstance(kv_offload_dir, (str, os.PathLike)):
                raise ValueError(f"kv_offload_dir must be a folder path or None, got {type(kv_offload_dir).__name__}")
            kv_offload_dir = os.fspath(kv_offload_dir)
            if not kv_offload_dir.strip():
                raise ValueError(
                    "kv_offload_dir must name a folder, got an empty path (None keeps the tiers in host memory)"
                )
        config = cls(preemption_mode, swap_space, kv_offloading_size, kv_offload_dir)
        config.check_room()
        return config

    def _tier_sizes(self) -> dict[str, float]:
        """GiB of each tier these settings build: "swap_space" and "kv_offloading_size"."""
        sizes = {"swap_space": self.swap_space} if self.preemption_mode == "swap" else {}
        if self.kv_offloading_size is not None:
            sizes["kv_offloading_size"] = self.kv_offloading_size
        return sizes

    def check_room(self) -> None:
        """The tiers must fit where they go: the host's available memory, or the free space of kv_offload_dir's
        disk; else a ValueError naming the tier, before anything is allocated."""
        sizes = self._tier_sizes()
        if not sizes:
            return
        if self.kv_offload_dir is None:
            room, where = available_memory(), "available host memory"
        else:
            folder = Path(self.kv_offload_dir).absolute()
            while not folder.exists() and folder != folder.parent:  # the folder is made when the tier is
                folder = folder.parent
            try:
                room, where = shutil.disk_usage(folder).free, f"free disk space under {folder}"
            except OSError:  # unreadable: making the file will say what is wrong
                room = None
        if room is not None and sum(sizes.values()) * GiB > room:
            asked = " + ".join(f"{name} {gib:g} GiB" for name, gib in sizes.items())
            raise ValueError(f"{asked} is more than the {where} ({room / GiB:.2f} GiB); lower {' or '.join(sizes)}")

    def check_blocks(self, block_bytes: int) -> None:
        """A prefix tier must hold at least one block of block_bytes (an empty one would keep nothing)."""
        if self.kv_offloading_size is not None and int(self.kv_offloading_size * GiB) < block_bytes:
            raise ValueError(
                f"kv_offloading_size ({self.kv_offloading_size:g} GiB) must hold at least one KV block "
                f"of {block_bytes} bytes ({block_bytes / GiB:.3g} GiB); raise it, or leave it None "
                f"for no tier"
            )


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    model: object = None  # draft_model: as LLM's model ("smollm2", a folder, a cached name, a model object)
    draft_layers: int | None = None

    @classmethod
    def from_dict(cls, config) -> "SpeculativeConfig":
        """Check the keys by name (vLLM's, and draft_layers of our own); the draft model itself is checked by
        resolve_draft."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(config).__name__}")
        method = config.get("method")
        if method not in METHOD_KEYS:
            raise ValueError(f"speculative_config['method'] must be one of {sorted(METHOD_KEYS)}, got {method!r}")
        for key in config:
            if key not in {"method", "num_speculative_tokens"} | METHOD_KEYS[method]:
                raise ValueError(f"speculative_config has an unknown key {key!r} for method {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config['num_speculative_tokens'] is required")
        k = integer(
            "speculative_config['num_speculative_tokens']",
            config["num_speculative_tokens"],
            low=1,
            high=MAX_SPECULATIVE_TOKENS,
        )
        out = cls(method, k)
        if method == "ngram":
            out.prompt_lookup_max = integer(
                "speculative_config['prompt_lookup_max']", config.get("prompt_lookup_max", 3), low=1
            )
            out.prompt_lookup_min = integer(
                "speculative_config['prompt_lookup_min']", config.get("prompt_lookup_min", 1), low=1
            )
            if out.prompt_lookup_min > out.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config['prompt_lookup_min'] ({out.prompt_lookup_min}) must be <= "
                    f"prompt_lookup_max ({out.prompt_lookup_max})"
                )
        else:
            if "model" not in config:
                raise ValueError("speculative_config['model'] is required for method 'draft_model'")
            out.model = config["model"]
            if config.get("draft_layers") is not None:
                out.draft_layers = integer("speculative_config['draft_layers']", config["draft_layers"], low=1)
        return out


# ---- the engine's -----------------------------------------------------------------------------------------


def capture_sizes(sizes, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes that get a CUDA graph, ascending: vLLM's list (1, 2, 4, multiples of 8 up to 256, then
    of 16) below max_num_seqs, and max_num_seqs itself, so that every decode batch pads to one; or the sizes given,
    each in [1, max_num_seqs] (a larger one could never be used). vLLM's list goes on to twice max_num_seqs, for
    decode batches that carry speculative tokens; this engine runs those eagerly."""
    if sizes is None:
        vllms = (1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs, 16))
        sizes = [size for size in vllms if size < max_num_seqs] + [max_num_seqs]
    elif isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"cudagraph_capture_sizes must be a list of batch sizes or None, got {sizes!r}")
    sizes = sorted(
        {
            integer(
                f"cudagraph_capture_sizes (max_num_seqs {max_num_seqs})",
                size,
                low=1,
                high=max_num_seqs,
                argument="cudagraph_capture_sizes",
            )
            for size in sizes
        }
    )
    if not sizes:
        raise ValueError("cudagraph_capture_sizes must hold at least one batch size (enforce_eager=True captures none)")
    return tuple(sizes)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds for the model
    kv_cache_memory: float = DEFAULT_KV_CACHE_MEMORY  # bytes of K/V pool when num_blocks is None
    max_num_seqs: int = 64  # running sequences at most (a request with n completions takes n)
    max_num_batched_tokens: int = 2048  # tokens one step computes at most (but see max_idle_prefill_tokens)
    max_idle_prefill_tokens: int | None = None  # a step with no decode: its first prompt whole up to this; None: off
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    seed: int = 0  # the engine's sampling generator
    preemption_mode: str = "recompute"  # or "swap" (guide §15)
    swap_space: float = 1.0  # GiB of swap tier
    kv_offloading_size: float | None = None  # GiB of prefix-cache tier; None: none
    kv_offload_dir: str | None = None  # a folder for the tiers as memory-mapped files; None: host memory
    speculative_config: dict | None = None  # vLLM's keys, and draft_layers (guide §14)
    enable_lora: bool = False  # guide §16
    max_loras: int = 1
    max_lora_rank: int = 16
    enforce_eager: bool | None = None  # None: CUDA graphs for decode on a GPU, none on a CPU (guide §11)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # decode batch sizes given a graph; None: vLLM's list
    # What the model decides, set by for_model: the longest sequence, the vocabulary, the end-of-sequence tokens.
    max_model_len: int | None = None
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    offload: OffloadConfig = field(init=False, repr=False)
    speculative: SpeculativeConfig | None = field(init=False, repr=False)

    def __post_init__(self):
        self.block_size = block_size_of(self.block_size)
        if self.num_blocks is not None:
            self.num_blocks = integer("num_blocks", self.num_blocks, low=1)
        self.kv_cache_memory = real("kv_cache_memory", self.kv_cache_memory)
        self.max_num_seqs = integer("max_num_seqs", self.max_num_seqs, low=1)
        self.max_num_batched_tokens = integer("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), or some running sequences could never be scheduled"
            )
        if self.max_idle_prefill_tokens is not None:
            self.max_idle_prefill_tokens = integer("max_idle_prefill_tokens", self.max_idle_prefill_tokens, low=1)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enable_lora"):
            flag(name, getattr(self, name))
        self.max_loras = integer("max_loras", self.max_loras, low=1, high=MAX_LORAS)
        self.max_lora_rank = integer("max_lora_rank", self.max_lora_rank, low=1, high=MAX_LORA_RANK)
        self.seed = integer("seed", self.seed)
        if self.enforce_eager is not None:
            flag("enforce_eager", self.enforce_eager)
        self.cudagraph_capture_sizes = capture_sizes(self.cudagraph_capture_sizes, self.max_num_seqs)
        self.offload = OffloadConfig.from_args(
            self.preemption_mode,
            self.swap_space,
            self.kv_offloading_size,
            self.kv_offload_dir,
            self.enable_prefix_caching,
        )
        self.speculative = (
            None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        )
        if self.max_model_len is not None:
            self.max_model_len = integer("max_model_len", self.max_model_len, low=2)
        self.eos_token_ids = frozenset(self.eos_token_ids)

    def for_model(self, max_model_len: int, vocab_size: int, eos_token_ids, num_blocks: int) -> "EngineConfig":
        """This config completed with the model's limits and the pool's size (num_blocks, when it was None)."""
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=frozenset(eos_token_ids),
            num_blocks=num_blocks,
        )

    def check_prompt(self, token_ids: list[int], max_tokens: int, n: int = 1, pool: str = "the KV pool") -> None:
        """Every limit a request of token_ids and up to max_tokens new tokens must fit, with n completions; a
        ValueError naming the one it breaks. Needs for_model's limits. pool: the pool's name in the message."""
        if not token_ids:
            raise ArgumentError("prompt", "prompt is empty: it must hold at least one token")
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise ArgumentError(
                "prompt", f"prompt token ids must lie in [0, {self.vocab_size}) (the model's vocabulary size)"
            )
        if len(token_ids) >= self.max_model_len:
            raise ArgumentError(
                "prompt",
                f"prompt has {len(token_ids)} tokens; the model holds at most "
                f"{self.max_model_len} (max_model_len) including at least one new token",
            )
        longest = min(len(token_ids) + max_tokens, self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks:
            raise ArgumentError(
                "prompt",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {longest} "
                f"tokens can never fit {pool} of {self.num_blocks * self.block_size} tokens "
                f"({self.num_blocks} blocks of {self.block_size}); raise num_blocks or "
                f"lower max_tokens",
            )
        if not self.enable_chunked_prefill and len(token_ids) > self.max_num_batched_tokens:
            raise ArgumentError(
                "prompt",
                f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}); raise it or enable_chunked_prefill=True",
            )
        if n > self.max_num_seqs:
            raise ArgumentError(
                "n",
                f"n ({n}) is more than max_num_seqs ({self.max_num_seqs}): a request's "
                f"completions run together; raise max_num_seqs or lower n",
            )


MODEL_LIMITS = ("max_model_len", "vocab_size", "eos_token_ids")
SETTINGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name not in MODEL_LIMITS)
