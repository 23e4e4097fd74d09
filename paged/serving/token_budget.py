"""The token budget a server's steps run under, sized for the machine (guide §12, §13).

Every stream in the batch waits for the whole step before its next token, so the longest step is the worst gap a
reader sees. A step's time grows with the tokens it computes, about linearly once there are a few dozen of them:

    step_time(n) ~ fixed + n * per_token       (fixed: reading the weights once, launching the step's work)

With chunked prefill and decodes scheduled first, `max_num_batched_tokens` caps n for every step, so it caps the
gap. `size_token_budget` times two steps of this engine on this machine (one token, then a prompt of
`CALIBRATION_TOKENS`), fits the line, and returns the largest whole number of blocks of tokens whose step is
expected to fit in `target` seconds, kept within [max_num_seqs, MAX_TOKEN_BUDGET]. A faster machine or a smaller
model gets a larger budget; on a laptop CPU it is several hundred tokens to a thousand, on a GPU the upper bound.

The target trades one tail for the other. A small budget cuts a prompt into many chunks: the worst gap shrinks, but
the prompt's first token waits through all of its steps, each of which also pays the fixed cost and computes every
running decode again; the streams' tokens come no sooner on average either, since the prompt's tokens are computed
all the same. STEP_TARGET_S, a second, keeps both tails in view: a prompt within the budget that arrives just as a
full step begins waits out that step and is computed in the next, so its first token comes within two seconds (the
TTFT objective `make bench-serve` counts goodput by), and no reader waits more than a second for the next token.
"""

import time
from dataclasses import dataclass

import numpy as np

from paged.sampling_params import SamplingParams

CALIBRATION_TOKENS = 512  # the prompt timed as one step
MAX_TOKEN_BUDGET = 8192  # vLLM's server default on a large GPU; more gains nothing on one step
STEP_TARGET_S = 1.0  # the step time a full budget should take: the worst gap, half the worst first token


@dataclass(frozen=True)
class TokenBudget:
    budget: int  # max_num_batched_tokens
    fixed: float  # seconds of a one-token step
    per_token: float  # seconds each further token adds

    def step_time(self, num_tokens: int) -> float:
        """The modelled time of a step computing num_tokens."""
        return self.fixed + (num_tokens - 1) * self.per_token


def time_step(engine, num_tokens: int, seed: int, repeats: int = 2) -> float:
    """The shortest of `repeats` timings of one step computing a fresh prompt of num_tokens random tokens."""
    rng = np.random.default_rng(seed)
    vocab_size = engine.config.vocab_size
    best = float("inf")
    for _ in range(repeats):
        prompt = rng.integers(0, vocab_size, num_tokens).tolist()  # fresh ids: nothing in the prefix cache
        request = engine.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        engine.add_request(request)
        start = time.perf_counter()
        engine.step()  # the whole prompt and its one token, which ends the request: the budget holds it
        best = min(best, time.perf_counter() - start)
    return best


def size_token_budget(engine, target: float = STEP_TARGET_S) -> TokenBudget:
    """Time this engine's steps and return the budget whose step takes about `target` seconds. The engine must be
    idle, and its budget must hold CALIBRATION_TOKENS (or its whole context, if shorter) in one step."""
    engine.require_idle("size_token_budget")
    prompt_tokens = min(CALIBRATION_TOKENS, engine.max_model_len - 1)
    if engine.config.max_num_batched_tokens < prompt_tokens:
        raise ValueError(
            f"size_token_budget times a step of {prompt_tokens} tokens; the engine's "
            f"max_num_batched_tokens ({engine.config.max_num_batched_tokens}) must hold it"
        )
    time_step(engine, 1, seed=0)  # warm-up: first calls allocate and compile
    fixed = time_step(engine, 1, seed=1)
    per_token = max(time_step(engine, prompt_tokens, seed=2) - fixed, 0.0) / (prompt_tokens - 1)
    fits = MAX_TOKEN_BUDGET if per_token == 0 else int((target - fixed) / per_token) + 1
    block_size = engine.config.block_size
    budget = min(max(fits // block_size * block_size, engine.config.max_num_seqs), MAX_TOKEN_BUDGET)
    return TokenBudget(budget, fixed, per_token)
