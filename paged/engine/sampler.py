"""The batched sampler: greedy, temperature, min-p, top-k, top-p (vLLM's names and meanings).

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

import torch

from paged.sampling_params import Logprob, SamplingParams


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[dict[int, Logprob]]:
    """For each row: the chosen token's log-probability and rank, then the num_top[row] most likely tokens', in
    rank order (the chosen one is not repeated when it is among them).

    logits [rows, vocab], raw (no temperature); token_ids, num_top: one per row.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = torch.tensor(token_ids, device=logits.device)[:, None]  # [rows, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [rows, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # [rows]
    top_logprobs, top_ids = logprobs.topk(max(num_top), dim=-1)  # [rows, max k]
    entries = []
    for row, (token, logprob, rank, k) in enumerate(
        zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks.tolist(), num_top)
    ):
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


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Each row's sampling distribution: its logits divided by its temperature, then min-p, top-k and top-p applied
    in that order (vLLM V1's), each removed token given probability zero.

    logits [rows, vocab]; temperature, top_p, min_p float [rows]; top_k int64 [rows], 1..vocab (vocab for "all").
    Returns probabilities [rows, vocab], fp32.
    """
    rows, vocab = logits.shape
    scaled = logits.float() / temperature[:, None]  # [rows, vocab]
    if bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [rows, 1]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        ascending, order = scaled.sort(dim=-1)  # [rows, vocab], smallest first
        kth_largest = ascending.gather(1, (vocab - top_k)[:, None])  # [rows, 1]
        ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))  # ties with the k-th stay
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)  # of the top-k, renormalised
        drop = mass_up_to <= (1 - top_p)[:, None]  # the least likely tokens while what is left still reaches top_p
        drop[:, -1] = False  # the most likely token stays
        scaled = torch.empty_like(scaled).scatter_(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)


def filter_params(params: list[SamplingParams], vocab: int, device) -> tuple[torch.Tensor, ...]:
    """The filter_logits tensors for one row per params: temperature, top_k (vocab for "all"), top_p, min_p."""
    return (
        torch.tensor([p.temperature for p in params], device=device),
        torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device),
        torch.tensor([p.min_p for p in params], device=device),
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): each row's first maximum (a NaN counts as the maximum, as in argmax), in two passes.

    torch's argmax on a CPU walks a row one element at a time, while its max reduction (amax) runs on vector lanes; at
    batch 64 with a 49,152-token vocabulary that is the difference between a few milliseconds a step and a fraction
    of one. So each row is cut into chunks: the first chunk whose maximum is the row's, then the first maximum in it.
    logits [rows, vocab] -> int64 [rows].
    """
    rows, vocab = logits.shape
    chunk = math.gcd(vocab, 256)  # a chunk size that divides the vocabulary
    if chunk < 64:  # none worth the second pass: argmax itself
        return logits.argmax(dim=-1)
    chunks = logits.unflatten(-1, (vocab // chunk, chunk))  # [rows, vocab / chunk, chunk], a view
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [rows]
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


def inverse_cdf_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row, drawn from its probabilities: a uniform number per row, found among the row's cumulative
    probabilities (the first token whose running total passes it; a token of probability zero never does).

    The same distribution as torch.multinomial(probs, 1), from one random number a row instead of one a token: on a
    CPU, drawing a random number for each of 49,152 tokens of 64 rows takes tens of milliseconds, more than the rest
    of the sampler. probs [rows, vocab] -> int64 [rows]."""
    totals = probs.cumsum(dim=-1)  # [rows, vocab]
    total = totals[:, -1:]  # [rows, 1]
    uniform = torch.rand(total.shape, generator=generator, device=probs.device) * total
    uniform = torch.minimum(uniform, torch.nextafter(total, torch.zeros_like(total)))  # below the total, always
    return torch.searchsorted(totals, uniform, right=True)[:, 0]


def rows_of(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] for rows in increasing order; tensor itself, not a copy, when they are all of its rows (a whole
    batch sampled alike, the common case: copying 64 rows of a 49,152-token vocabulary costs a millisecond)."""
    return tensor if len(rows) == tensor.shape[0] else tensor[rows]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    """logits [rows, vocab] fp32, one row per sequence; returns one token id per row. Unseeded rows share
    default_generator in one inverse-CDF draw; a seeded row draws its position's noise from its own generator."""
    tokens = greedy_tokens(logits)  # [rows]; right for greedy rows
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filter_logits(
            rows_of(logits, random_rows),
            *filter_params([params[i] for i in random_rows], logits.shape[-1], logits.device),
        )
        shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if shared:
            tokens[rows[shared]] = inverse_cdf_tokens(rows_of(probs, shared), default_generator)
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                tokens[i] = seeded_token(probs[j], exponential_noise(probs[j], generators[i]))
    return tokens.tolist()
