"""When speculative decoding pays (guide §14), modelled and measured.

A verify step appends E(a, k) = 1 + a + ... + a^k tokens per sequence on average (`expected_tokens`) for the price
of one forward pass over k + 1 tokens per sequence; a plain decode step appends one token for a pass over one.
`verify_speedup` prices both passes with a step-cost model (paged/analysis/step_cost.py) and `crossover_batch` finds the
batch size where speculation stops paying; `measure_step` times the same two passes on the engine's own model, and
`break_even_acceptance` turns a timed verify cost into the acceptance a proposer needs to pay at it.
Two acceptances are kept apart: the per-position probability a of the model above, and the rate r = accepted /
drafted that vLLM reports, with r = (a + a^2 + ... + a^k) / k under the model (`rate_of_acceptance`).
The mechanism itself (proposers, verify, rollback) is paged/speculative.py.
"""

import time

from paged.engine.model_inputs import prepare_inputs
from paged.geometry import cdiv


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens one verify appends when each of num_drafts drafts is accepted with probability `acceptance`,
    independently, and the verify stops at the first rejection: 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a).

    The 1 is the token the target always adds (the correction at the first rejection, or the bonus token after k
    acceptances). 75 % over 5 drafts gives 3.29, neither 0.75 * 5 + 1 (4.75) nor 4.
    """
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if num_drafts < 0:
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    return float(num_drafts + 1) if acceptance == 1 else (1 - acceptance ** (num_drafts + 1)) / (1 - acceptance)


def rate_of_acceptance(acceptance: float, num_drafts: int) -> float:
    """The accepted / drafted rate r that a per-position acceptance a gives over num_drafts >= 1 drafts:
    (a + a^2 + ... + a^k) / k, since the j-th draft is accepted only if the j - 1 before it were."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    return (expected_tokens(acceptance, num_drafts) - 1) / num_drafts


def acceptance_of_rate(rate: float, num_drafts: int) -> float:
    """The per-position acceptance a whose accepted / drafted rate is `rate` (the inverse of rate_of_acceptance)."""
    if not 0 <= rate <= 1:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    low, high = 0.0, 1.0
    for _ in range(60):  # bisection: r grows with a
        middle = (low + high) / 2
        low, high = (middle, high) if rate_of_acceptance(middle, num_drafts) < rate else (low, middle)
    return (low + high) / 2


def break_even_acceptance(verify_cost: float, num_drafts: int) -> tuple[float, float] | None:
    """(a, r): the per-position acceptance and the accepted / drafted rate at which a free proposer's verify, costing
    verify_cost decode steps, appends as many tokens as those decode steps would, E(a, k) = 1 + k r = verify_cost.
    Speculation pays above them. None if it cannot pay (verify_cost > k + 1, more than E ever reaches)."""
    if verify_cost > num_drafts + 1:
        return None
    rate = max(0.0, (verify_cost - 1) / num_drafts)
    return acceptance_of_rate(rate, num_drafts), rate


def verify_speedup(
    step_cost, batch: int, num_drafts: int, acceptance: float, context: int, draft_cost: float = 0.0
) -> float:
    """Modelled speedup of speculation for `batch` sequences decoding at `context` tokens: E(a, k) tokens per
    verify step against one token per plain decode step, each step priced by step_cost(num_batched_tokens,
    num_seqs, num_pairs) (a paged.analysis.step_cost.StepCost). A verify scores k + 1 tokens per sequence; draft_cost is one
    draft step's cost relative to a plain decode step (0 for prompt lookup).

    While a step is dominated by its fixed cost (reading the weights once, Python), k + 1 tokens cost about what
    one does and speculation pays; as the batch grows the per-token work takes over, a verify costs more and
    more decodes, and speculation stops paying once that exceeds E(a, k)."""
    q = num_drafts + 1
    decode = step_cost(batch, batch, batch * (context + 1))
    verify = step_cost(batch * q, batch, batch * (q * (context + q) - q * (q - 1) // 2))
    return expected_tokens(acceptance, num_drafts) * decode / (verify + num_drafts * draft_cost * decode)


def crossover_batch(
    step_cost, num_drafts: int, acceptance: float, context: int, draft_cost: float = 0.0, max_batch: int = 4096
) -> int | None:
    """The smallest batch size at which speculation stops paying (modelled speedup below 1): 1 if it never pays,
    None if it still pays at max_batch."""
    for batch in range(1, max_batch + 1):
        if verify_speedup(step_cost, batch, num_drafts, acceptance, context, draft_cost) < 1:
            return batch
    return None


def measure_step(engine, batch: int, tokens_per_seq: int, context: int, repeats: int = 3) -> float:
    """Seconds of one forward pass of the engine's model (fastest of `repeats`) over `batch` sequences that each
    compute tokens_per_seq new tokens after `context` cached ones: 1 is a plain decode step, k + 1 a verify. The
    measured counterpart of verify_speedup's step_cost. It borrows blocks of the engine's pool, which must be idle."""
    engine.require_idle("measure_step")
    manager, num_tokens = engine.block_manager, context + tokens_per_seq
    seq_ids = [-1 - i for i in range(batch)]  # engine sequences have ids >= 0
    if batch * cdiv(num_tokens, manager.block_size) > manager.num_free_blocks:
        raise ValueError(
            f"batch ({batch}) sequences of {num_tokens} tokens need more than the pool's "
            f"{manager.num_free_blocks} free blocks; raise num_blocks"
        )
    token_ids = [0] * num_tokens
    try:
        for seq_id in seq_ids:
            manager.allocate(seq_id, num_tokens)
        chunks = [(seq_id, token_ids, context, num_tokens, tokens_per_seq) for seq_id in seq_ids]
        inputs = prepare_inputs(manager, chunks, engine.device)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.model.forward(*inputs[:3], engine.kv_cache, inputs[3])
            seconds.append(time.perf_counter() - start)
    finally:
        for seq_id in seq_ids:
            manager.free(seq_id)
    return min(seconds)
