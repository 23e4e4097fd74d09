"""What a request asks of the sampler (guide §13), with vLLM's names and meanings: `SamplingParams`, and the
`Logprob` entries a request with `logprobs` gets back.

The settings are checked once, when a request is made: a bad value raises an `ArgumentError` (a `ValueError`) that
names the field and its limit. How the engine draws a token from them is `paged/engine/sampler.py`.
"""

from dataclasses import dataclass

from paged.validation import ArgumentError, integer, real, token_id_list

GREEDY_TEMPERATURE = 1e-5  # below it, sampling is greedy
MAX_SEED = 2**63 - 1  # a generator's seed; completion i of a request draws from seed + i
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs; OpenAI's top_logprobs)


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability
    max_tokens: int = 16  # new tokens at most
    ignore_eos: bool = False  # keep going past the end-of-sequence token
    seed: int | None = None  # per-request random seed
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = (
        None  # strings that end a completion when its text contains one (engine/stop_strings.py)
    )
    include_stop_str_in_output: bool = False  # the text ends after the stop string rather than before it
    logprobs: int | None = None  # per output token: its log-probability and this many most likely others
    prompt_logprobs: int | None = None  # per prompt token: its log-probability given the tokens before it, and
    #                                       this many most likely others (RequestOutput.prompt_logprobs)
    skip_reading_prefix_cache: bool | None = None  # None: skip it exactly when prompt_logprobs asks for a prefill

    def __post_init__(self):
        self.n = integer("n", self.n, low=1)
        self.max_tokens = integer("max_tokens", self.max_tokens, low=1)
        self.temperature = real("temperature", self.temperature)
        if self.temperature < 0:
            raise ArgumentError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ArgumentError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = integer("top_k", self.top_k, low=-1)
        self.min_p = real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ArgumentError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ArgumentError("ignore_eos", f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None:
            self.seed = integer("seed", self.seed, low=0, high=MAX_SEED)
        self.stop_token_ids = token_id_list(
            "stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids
        )
        stop = [self.stop] if isinstance(self.stop, str) else ([] if self.stop is None else self.stop)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ArgumentError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ArgumentError(
                "include_stop_str_in_output",
                f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}",
            )
        if self.logprobs is not None:
            self.logprobs = integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ArgumentError(
                "skip_reading_prefix_cache",
                f"skip_reading_prefix_cache must be True, False or None, got {self.skip_reading_prefix_cache!r}",
            )
        if self.prompt_logprobs is not None and self.skip_reading_prefix_cache is False:
            raise ArgumentError(
                "skip_reading_prefix_cache",
                "skip_reading_prefix_cache must not be False with "
                "prompt_logprobs: a prompt token found in the prefix cache is not computed, so it "
                "has no logits",
            )
        if self.greedy and self.n > 1:
            raise ArgumentError(
                "n",
                f"n must be 1 with greedy sampling (temperature < {GREEDY_TEMPERATURE}): its "
                f"{self.n} completions would all be the same; got n={self.n}",
            )

    @property
    def skips_prefix_cache(self) -> bool:
        """skip_reading_prefix_cache; None means exactly when prompt_logprobs asks for them, since only a prefill
        computes a prompt token's logits (vLLM's rule)."""
        if self.skip_reading_prefix_cache is None:
            return self.prompt_logprobs is not None
        return self.skip_reading_prefix_cache

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy, as in vLLM: dividing logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class Logprob:
    """One token's log-probability under the model (vLLM's Logprob). rank 1 is the model's most likely token."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # the token's own text, as the tokenizer decodes it alone
