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
"""

import torch


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """target_tokens: the argmax of each of the k + 1 rows. Returns the 1..k + 1 tokens to append."""
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return target_tokens[:num_accepted + 1]


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """target_probs [k + 1, vocab] (p, filtered); draft_probs [k, vocab] (q) or None for a one-hot proposer.
    Returns the 1..k + 1 tokens to append."""
    out = []
    for j, token in enumerate(draft_tokens):
        p = target_probs[j]                                                   # [vocab]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_token < float(p[token]):                                     # u < p(d) / q(d)
            out.append(token)
            continue
        q = torch.zeros_like(p).index_fill_(0, torch.tensor([token], device=p.device), 1.0) \
            if draft_probs is None else draft_probs[j]
        residual = (p - q).clamp_min_(0)                                      # [vocab]
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection had probability ~0
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)))
    return out
