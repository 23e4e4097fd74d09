"""Sampling parameters and the batched sampler: greedy, temperature, min-p, top-k, top-p (vLLM's names and meanings).

The filters run in the order of vLLM V1's sampler (`Sampler.sample` in vllm/v1/sample/sampler.py): temperature; then
min-p, which vLLM runs as an argmax-invariant logits processor (`MinPLogitsProcessor` in
vllm/v1/sample/logits_processor/builtin.py) before top-k and top-p; then top-k; then top-p, measured over what top-k
left, renormalised (`apply_top_k_top_p_pytorch` in vllm/v1/sample/ops/topk_topp_sampler.py). A filter a row does not
ask for (top_k 0 or -1, top_p 1, min_p 0) leaves every probability of that row exactly as it was.

One call samples the next token of every sequence in the step. Rows that ask for a seed draw from their own
generator, seeded with seed + i for completion i, and draw from it exactly once per output position: position p's
token is argmax(probs / E_p), E_p the generator's p-th vector of Exp(1) noise over the vocabulary (`seeded_token`).
That is the exponential race, Gumbel-max in other clothes (argmax(log probs - log E_p), and -log E is Gumbel), an
exact sample of probs; it is also what torch.multinomial(probs, 1) computes, so the tokens are the ones a plain
multinomial draw gives. A seeded completion's text is thus a function of its seed, its index and the model: not of
which other requests share the batch, of preemptions, or of speculative decoding, whose verify draws the same noise
position by position (`rejection_sampler.seeded_accept`, guide §14). A request with `logprobs` also
gets each sampled token's log-probability and its `logprobs` most likely alternatives (`token_logprobs`), taken, as
vLLM does by default, from the model's raw logits: before temperature, top-k or top-p reshape them.
"""

import math
from dataclasses import dataclass

import torch

from .validation import integer, real, token_id_list

GREEDY_TEMPERATURE = 1e-5   # below it, sampling is greedy
MAX_SEED = 2**63 - 1        # a generator's seed; completion i of a request draws from seed + i
MAX_LOGPROBS = 20           # alternatives per token at most (vLLM's default max_logprobs; OpenAI's top_logprobs)


@dataclass
class SamplingParams:
    n: int = 1                        # completions per prompt
    temperature: float = 1.0          # 0 (or below 1e-5) means greedy
    top_p: float = 1.0                # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0                    # keep the k most likely tokens; 0 (or -1) keeps all
    min_p: float = 0.0                # drop tokens less likely than min_p x the most likely one's probability
    max_tokens: int = 16              # new tokens at most
    ignore_eos: bool = False          # keep going past the end-of-sequence token
    seed: int | None = None           # per-request random seed
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None   # strings that end a completion when its text contains one (stop_strings.py)
    include_stop_str_in_output: bool = False   # the text ends after the stop string rather than before it
    logprobs: int | None = None       # per output token: its log-probability and this many most likely others
    prompt_logprobs: int | None = None    # per prompt token: its log-probability given the tokens before it, and
    #                                       this many most likely others (RequestOutput.prompt_logprobs)
    skip_reading_prefix_cache: bool | None = None   # None: skip it exactly when prompt_logprobs asks for a prefill

    def __post_init__(self):
        self.n = integer("n", self.n, low=1)
        self.max_tokens = integer("max_tokens", self.max_tokens, low=1)
        self.temperature = real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = integer("top_k", self.top_k, low=-1)
        self.min_p = real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None:
            self.seed = integer("seed", self.seed, low=0, high=MAX_SEED)
        self.stop_token_ids = token_id_list(
            "stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        stop = [self.stop] if isinstance(self.stop, str) else ([] if self.stop is None else self.stop)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")
        if self.logprobs is not None:
            self.logprobs = integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be True, False or None, got "
                             f"{self.skip_reading_prefix_cache!r}")
        if self.prompt_logprobs is not None and self.skip_reading_prefix_cache is False:
            raise ValueError("skip_reading_prefix_cache must not be False with prompt_logprobs: a prompt token "
                             "found in the prefix cache is not computed, so it has no logits")
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 with greedy sampling (temperature < {GREEDY_TEMPERATURE}): its {self.n} "
                             f"completions would all be the same; got n={self.n}")

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
    decoded_token: str | None = None   # the token's own text, as the tokenizer decodes it alone


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[dict[int, Logprob]]:
    """For each row: the chosen token's log-probability and rank, then the num_top[row] most likely tokens', in
    rank order (the chosen one is not repeated when it is among them).

    logits [rows, vocab], raw (no temperature); token_ids, num_top: one per row.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)                                  # [rows, vocab]
    chosen = torch.tensor(token_ids, device=logits.device)[:, None]                       # [rows, 1]
    chosen_logprobs = logprobs.gather(1, chosen)                                          # [rows, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1                                  # [rows]
    top_logprobs, top_ids = logprobs.topk(max(num_top), dim=-1)                           # [rows, max k]
    entries = []
    for row, (token, logprob, rank, k) in enumerate(zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks.tolist(),
                                                        num_top)):
        entry = {token: Logprob(logprob, rank)}
        for i, (other, other_logprob) in enumerate(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist())):
            entry.setdefault(other, Logprob(other_logprob, i + 1))
        entries.append(entry)
    return entries


def decode_logprobs(entries: list[dict[int, Logprob]], tokenizer) -> None:
    """Fill in each Logprob's decoded_token: its token's text alone (left None without a tokenizer)."""
    if tokenizer is None:
        return
    for entry in entries:
        for token_id, logprob in entry.items():
            logprob.decoded_token = tokenizer.decode([token_id])


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Each row's sampling distribution: its logits divided by its temperature, then min-p, top-k and top-p applied
    in that order (vLLM V1's), each removed token given probability zero.

    logits [rows, vocab]; temperature, top_p, min_p float [rows]; top_k int64 [rows], 1..vocab (vocab for "all").
    Returns probabilities [rows, vocab], fp32.
    """
    rows, vocab = logits.shape
    scaled = logits.float() / temperature[:, None]                              # [rows, vocab]
    if bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]           # [rows, 1]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        ascending, order = scaled.sort(dim=-1)                                   # [rows, vocab], smallest first
        kth_largest = ascending.gather(1, (vocab - top_k)[:, None])              # [rows, 1]
        ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))  # ties with the k-th stay
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)                    # of the top-k, renormalised
        drop = mass_up_to <= (1 - top_p)[:, None]  # the least likely tokens while what is left still reaches top_p
        drop[:, -1] = False                                                      # the most likely token stays
        scaled = torch.empty_like(scaled).scatter_(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)


def filter_params(params: list[SamplingParams], vocab: int, device) -> tuple[torch.Tensor, ...]:
    """The filter_logits tensors for one row per params: temperature, top_k (vocab for "all"), top_p, min_p."""
    return (torch.tensor([p.temperature for p in params], device=device),
            torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): each row's first maximum (a NaN counts as the maximum, as in argmax), in two passes.

    torch's argmax on a CPU walks a row one element at a time, while its max reduction (amax) runs on vector lanes; at
    batch 64 with a 49,152-token vocabulary that is the difference between a few milliseconds a step and a fraction
    of one. So each row is cut into chunks: the first chunk whose maximum is the row's, then the first maximum in it.
    logits [rows, vocab] -> int64 [rows].
    """
    rows, vocab = logits.shape
    chunk = math.gcd(vocab, 256)                                 # a chunk size that divides the vocabulary
    if chunk < 64:                                               # none worth the second pass: argmax itself
        return logits.argmax(dim=-1)
    chunks = logits.unflatten(-1, (vocab // chunk, chunk))       # [rows, vocab / chunk, chunk], a view
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)              # [rows]
    within = chunks[torch.arange(rows, device=logits.device), best_chunk].argmax(dim=-1)  # [rows]
    return best_chunk * chunk + within


def exponential_noise(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A seeded sequence's noise for its next output position: Exp(1) per token, drawn from its generator.
    probs [vocab] -> noise [vocab], of probs' dtype and device. One draw per position, always of this shape: the
    draw is a function of the generator's state and the shape, so position p's noise is the p-th draw."""
    return torch.empty_like(probs).exponential_(generator=generator)


def seeded_token(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """The token of the exponential race: argmax(probs / noise), probs [vocab], noise [vocab] from exponential_noise.
    P(token = x) = probs[x], exactly: of independent exponential clocks with rates probs (ringing at noise / probs),
    x rings first with probability probs[x]."""
    return int((probs / noise).argmax())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> list[int]:
    """logits [rows, vocab] fp32, one row per sequence; returns one token id per row. Unseeded rows share
    default_generator in one multinomial draw; a seeded row draws its position's noise from its own generator."""
    tokens = greedy_tokens(logits)                                              # [rows]; right for greedy rows
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filter_logits(logits[rows], *filter_params([params[i] for i in random_rows], logits.shape[-1],
                                                            logits.device))
        shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if shared:
            picked = torch.multinomial(probs[shared], 1, generator=default_generator)[:, 0]
            tokens[rows[shared]] = picked
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                tokens[i] = seeded_token(probs[j], exponential_noise(probs[j], generators[i]))
    return tokens.tolist()
