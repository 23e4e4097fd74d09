"""The engine's settings in one place (guide §11): `EngineConfig`, checked once when it is made.

    config = EngineConfig(block_size=16, max_num_seqs=8, enable_prefix_caching=True)
    engine = LLMEngine(model, tokenizer, config)          # or LLMEngine(model, tokenizer, block_size=16, ...)

Every limit on the settings and its error message live here: a bad value is a ValueError naming the argument, raised
before any engine part is built. `LLM` builds one from its keyword arguments (vLLM's names where vLLM has the
setting), `LLMEngine`, its `Scheduler` and the disaggregation workers share it; it is a plain dataclass, so it pickles
into a worker process. `for_model` completes it with what the model decides (its length, vocabulary, end-of-sequence
tokens and the pool's block count), and `check_prompt` then holds every check a request must pass to be served.
"""

import dataclasses
from dataclasses import dataclass, field

from paged.core.block_manager import cdiv
from paged.lora import MAX_LORA_RANK, MAX_LORAS
from paged.offload import OffloadConfig
from paged.speculative import SpeculativeConfig
from paged.validation import ArgumentError, block_size_of, integer, real

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes of K/V pool when num_blocks is not given


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None              # None: as many as kv_cache_memory holds for the model
    kv_cache_memory: float = DEFAULT_KV_CACHE_MEMORY  # bytes of K/V pool when num_blocks is None
    max_num_seqs: int = 64                     # running sequences at most (a request with n completions takes n)
    max_num_batched_tokens: int = 2048         # tokens one step computes at most
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    seed: int = 0                              # the engine's sampling generator
    preemption_mode: str = "recompute"         # or "swap" (guide §15)
    swap_space: float = 1.0                    # GiB of swap tier
    kv_offloading_size: float | None = None    # GiB of prefix-cache tier; None: none
    kv_offload_dir: str | None = None          # a folder for the tiers as memory-mapped files; None: host memory
    speculative_config: dict | None = None     # vLLM's keys, and draft_layers (guide §14)
    enable_lora: bool = False                  # guide §16
    max_loras: int = 1
    max_lora_rank: int = 16
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
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}), or some running sequences could never be scheduled")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enable_lora"):
            flag(name, getattr(self, name))
        self.max_loras = integer("max_loras", self.max_loras, low=1, high=MAX_LORAS)
        self.max_lora_rank = integer("max_lora_rank", self.max_lora_rank, low=1, high=MAX_LORA_RANK)
        self.seed = integer("seed", self.seed)
        self.offload = OffloadConfig.from_args(self.preemption_mode, self.swap_space, self.kv_offloading_size,
                                               self.kv_offload_dir, self.enable_prefix_caching)
        self.speculative = None if self.speculative_config is None else \
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.max_model_len is not None:
            self.max_model_len = integer("max_model_len", self.max_model_len, low=2)
        self.eos_token_ids = frozenset(self.eos_token_ids)

    def for_model(self, max_model_len: int, vocab_size: int, eos_token_ids, num_blocks: int) -> "EngineConfig":
        """This config completed with the model's limits and the pool's size (num_blocks, when it was None)."""
        return dataclasses.replace(self, max_model_len=max_model_len, vocab_size=vocab_size,
                                   eos_token_ids=frozenset(eos_token_ids), num_blocks=num_blocks)

    def check_prompt(self, token_ids: list[int], max_tokens: int, n: int = 1, pool: str = "the KV pool") -> None:
        """Every limit a request of token_ids and up to max_tokens new tokens must fit, with n completions; a
        ValueError naming the one it breaks. Needs for_model's limits. pool: the pool's name in the message."""
        if not token_ids:
            raise ArgumentError("prompt", "prompt is empty: it must hold at least one token")
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise ArgumentError("prompt", f"prompt token ids must lie in [0, {self.vocab_size}) (the model's "
                                          f"vocabulary size)")
        if len(token_ids) >= self.max_model_len:
            raise ArgumentError("prompt", f"prompt has {len(token_ids)} tokens; the model holds at most "
                                          f"{self.max_model_len} (max_model_len) including at least one new token")
        longest = min(len(token_ids) + max_tokens, self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks:
            raise ArgumentError("prompt", f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {longest} "
                                          f"tokens can never fit {pool} of {self.num_blocks * self.block_size} tokens "
                                          f"({self.num_blocks} blocks of {self.block_size}); raise num_blocks or "
                                          f"lower max_tokens")
        if not self.enable_chunked_prefill and len(token_ids) > self.max_num_batched_tokens:
            raise ArgumentError("prompt", f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                                          f"({self.max_num_batched_tokens}); raise it or enable_chunked_prefill=True")
        if n > self.max_num_seqs:
            raise ArgumentError("n", f"n ({n}) is more than max_num_seqs ({self.max_num_seqs}): a request's "
                                     f"completions run together; raise max_num_seqs or lower n")


MODEL_LIMITS = ("max_model_len", "vocab_size", "eos_token_ids")
SETTINGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name not in MODEL_LIMITS)
