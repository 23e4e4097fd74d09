"""Verifying speculative tokens (guide §14): which of a sequence's k draft tokens the target keeps.

The target scores all k drafts in one forward pass: k + 1 rows of logits, row j predicting the token after draft j
(row 0 predicts the token after the sequence's last real token, row k the token after the last draft).

Greedy: keep the longest run of drafts that equal the target's argmax, then add the target's own argmax at the
first disagreement (or after the last draft: the bonus token). The tokens are exactly those greedy decoding
without speculation would produce, one step each.

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft j, drawn from the draft's distribution q_j, is kept with
probability min(1, p_j(d) / q_j(d)); at the first rejection the token is drawn from norm(max(0, p_j - q_j)) and the
rest are dropped; if all k are kept, the bonus token is drawn from p_k. Every emitted token is distributed
exactly as p: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) norm(max(0, p - q))(x)
= min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x). A proposer with no distribution (prompt lookup) proposes d with
certainty: q is one-hot, so d is kept with probability p(d) and a rejection draws from p with d removed.
p and q are both after temperature, min-p, top-k and top-p, so the filters apply to the target's distribution as usual.
(vLLM's rejection sampler, `apply_sampling_constraints` in vllm/v1/sample/rejection_sampler.py, applies temperature,
top-k and top-p to the target's logits but not min-p; here min-p applies too, so a verified token is distributed as
plain decoding's with every filter.)

Seeded sampling (a request with a seed, `seeded_accept`): the sequence's generator gives one noise vector per output
position, and plain decoding's token at a position is the exponential race over p with that position's noise
(`sampling.seeded_token`). Verification draws the same: at position j it draws the position's noise, picks the
race's token from p_j, and keeps draft j iff it is that token; at the first mismatch the picked token is emitted and
the rest are dropped; if all k are kept, the bonus token is the pick at position k. Every emitted token is the one
plain seeded decoding emits there, so the tokens are independent of the drafts (how many were proposed, trimmed by
the scheduler, or dropped when a pool is full) and of preemptions: the drafts only decide how many positions one
pass covers. It is lossless as plain sampling is: each position's noise is a fresh draw, so each token is an exact
sample of p given the tokens before it. The generator moves on by one draw per emitted token, never for a rejected
draft, so position n's noise stays the n-th draw. What it costs is acceptance, and only for a draft model: a draft d
proposed with certainty (prompt lookup) is kept with probability p(d), as above; a draft model samples its own q with
the noise the target will use (coupled drafting, `speculative.DraftModelProposer`), so where q is close to p the race
picks the same token: a draft is kept with probability between (1 - t) / (1 + t) and rejection sampling's 1 - t,
t the total variation distance between p and q (Daliri, Musco and Suresh 2024, "Coupling without communication and
drafter-invariant speculative decoding"), where a draft drawn with noise of its own would be kept with probability
sum_x p(x) q(x). A draft equal to the target is always kept. Unseeded rows share the engine's generator and use the
rejection sampling above.
"""

import torch

from paged.engine.sampler import exponential_noise, seeded_token


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """target_tokens: the argmax of each of the k + 1 rows. Returns the 1..k + 1 tokens to append."""
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return target_tokens[: num_accepted + 1]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """target_probs [k + 1, vocab] (p, filtered); draft_probs [k, vocab] (q) or None for a one-hot proposer.
    Returns the 1..k + 1 tokens to append."""
    out = []
    for j, token in enumerate(draft_tokens):
        p = target_probs[j]  # [vocab]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_token < float(p[token]):  # u < p(d) / q(d)
            out.append(token)
            continue
        q = (
            torch.zeros_like(p).index_fill_(0, torch.tensor([token], device=p.device), 1.0)
            if draft_probs is None
            else draft_probs[j]
        )
        residual = (p - q).clamp_min_(0)  # [vocab]
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection had probability ~0
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)))
    return out


def seeded_accept(target_probs: torch.Tensor, draft_tokens: list[int], generator: torch.Generator) -> list[int]:
    """A seeded sequence's verify: target_probs [k + 1, vocab] (p, filtered); generator: the sequence's, whose next
    draws are the noise of the positions verified, one per token emitted. Returns the 1..k + 1 tokens to append:
    the drafts that equal plain seeded sampling's token at their position, then its token at the next one."""
    out = []
    for j, p in enumerate(target_probs[: len(draft_tokens) + 1]):  # p: [vocab]
        out.append(seeded_token(p, exponential_noise(p, generator)))
        if j == len(draft_tokens) or out[j] != draft_tokens[j]:
            break
    return out
