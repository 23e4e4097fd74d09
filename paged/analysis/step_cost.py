"""What one engine step costs, as a function of its shape (guide §13): the model the simulated clock runs on.

A step of the engine is one forward pass over its batched tokens. `StepCost` prices it from four numbers of the
step (a constant, its batched tokens, its scheduled sequences, the (query, key) pairs attention computes), fitted
by least squares to steps timed on a machine (`StepCost.fit`, benchmarks/step_cost.py). paged/engine/metrics.py's
replay driver charges each step this cost on its simulated clock; paged/analysis/speculative_cost.py prices a verify step
with it.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds of one engine step:

        fixed + per_token * batched tokens + per_seq * scheduled sequences + per_pair * attended (query, key) pairs

    per_token is the weight matmuls every token goes through; per_seq is each sequence's own work (its attention
    call, its block table, its logits); per_pair is attention proper: a chunk of n tokens ending at position e
    attends n*e - n*(n-1)/2 pairs, so a decode costs its context and a long prefill grows quadratically.
    """

    fixed: float
    per_token: float
    per_seq: float
    per_pair: float

    def __call__(self, num_batched_tokens: int, num_seqs: int, num_pairs: int) -> float:
        return self.fixed + self.per_token * num_batched_tokens + self.per_seq * num_seqs + self.per_pair * num_pairs

    @classmethod
    def fit(cls, steps: list) -> "StepCost":
        """Least squares over steps timed with the real clock (paged.engine.metrics.StepRecord: a duration and the three
        counts), on relative errors (each row divided by its duration), so that a 40 ms decode step counts as
        much as a 2 s prefill."""
        features = np.array([[1, s.num_batched_tokens, s.num_seqs, s.num_pairs] for s in steps], dtype=float)
        durations = np.array([s.duration for s in steps])  # [num_steps]
        coef, *_ = np.linalg.lstsq(features / durations[:, None], np.ones_like(durations), rcond=None)
        return cls(*(float(c) for c in coef))


# SmolLM2-135M in fp32 through this engine's torch path on a 2-core CPU, fitted once by benchmarks/step_cost.py
# (47 step shapes, median error 8 %). Measured there: one decode 0.045 s, 64 decodes at context 33 0.17 s,
# a 512-token prefill 0.61 s, a 1,024-token prefill 1.50 s.
SMOLLM2_CPU = StepCost(fixed=0.053, per_token=8.9e-4, per_seq=1.2e-3, per_pair=1.13e-6)
