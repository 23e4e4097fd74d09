"""How much KV memory sharing blocks saves (guide §10): parallel sampling and beam search against no sharing.

The paper (arXiv 2309.06180, §6.3, Fig. 15) serves OPT-13B on its Alpaca and ShareGPT traces and reports the
memory saving "computed by the number of blocks we saved by sharing divided by the number of total blocks without
sharing": 6.1-9.8 % (Alpaca) and 16.2-30.5 % (ShareGPT) for parallel sampling with n = 2, 4, 6 completions,
37.6-55.2 % and 44.3-66.3 % for beam search with widths 2, 4, 6.

Our definition: the same ratio, summed over time. At every forward pass, "without sharing" is the number of
block-table entries of the request's sequences (each would hold its own copy of every block) and "with sharing" is
the number of distinct physical blocks behind them, both counted when the step holds its memory: after the
scheduler has grown the tables and made the step's copy-on-write copies. Summing over every step of every request
gives block-steps (memory x time), and the saving is 1 - physical / logical. A request's block-steps do not depend
on what runs beside it (barring preemption), so this is also the saving of a pool serving the whole trace in any
order. The paper does not say when or how it averages over time; a per-step mean would weight quiet steps as much
as busy ones.

How each figure is obtained, and where it differs from the paper:

- Parallel sampling (`parallel_sampling_saving`) needs no model: it drives the real `BlockManager` the way the
  engine does. One sequence prefills the prompt (without sharing, n requests would each hold a copy), forks n - 1
  children that share all its blocks, then every decode step grows each sequence by one token with
  `allocate(..., write_from=...)`, which copies a shared block on its first write (the prompt's partial last
  block). Every completion runs the trace's output length, as in a benchmark that ignores EOS; if each stopped at
  its own EOS, sharing would last shorter and save less.
- Beam search (`beam_search_saving`) needs a model, because which beams survive shapes the tree of shared blocks.
  It runs the engine's own `LLM.beam_search` on prompts of the trace's input lengths for each request's output
  length, and sums `BeamSearchOutput.block_usage`, which the engine records at every forward pass as defined
  above: by then a child forked at the previous step holds its own copy of its parent's partial last block.
  The model is whatever `llm` holds: a tiny random Llama (fast, random-token prompts, but its beams are not those of
  a trained model) or SmolLM2 (trained, 135 M parameters; the paper used OPT-13B).
- We use the paper's block size (16) and our seeded traces (`paged.analysis.traces`), which match the datasets' mean
  lengths but not their exact distributions.
"""

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from paged.analysis.traces import TraceRequest
from paged.core.block_manager import BlockManager
from paged.geometry import cdiv

WIDTHS = (2, 4, 6)  # the paper's n and beam widths

# (method, trace) -> the paper's range of savings over n or beam width 2..6
PAPER_SAVINGS = {
    ("parallel sampling", "alpaca"): (0.061, 0.098),
    ("parallel sampling", "sharegpt"): (0.162, 0.305),
    ("beam search", "alpaca"): (0.376, 0.552),
    ("beam search", "sharegpt"): (0.443, 0.663),
}


@dataclass(frozen=True)
class BlockSteps:
    """Blocks held, summed over engine steps: with sharing (physical) and without (one copy per table entry)."""

    physical: int = 0
    logical: int = 0

    @classmethod
    def of(cls, tables: Iterable[list[int]]) -> "BlockSteps":
        """One step: the distinct physical blocks behind these block tables, and the tables' entries."""
        tables = list(tables)
        return cls(len({block for table in tables for block in table}), sum(map(len, tables)))

    def __add__(self, other: "BlockSteps") -> "BlockSteps":
        return BlockSteps(self.physical + other.physical, self.logical + other.logical)

    @property
    def saving(self) -> float:
        """Share of the KV memory (x time) that sharing saves: 1 - physical / logical, in [0, 1)."""
        return 1 - self.physical / self.logical


@contextmanager
def on_forward(engine, callback):
    """Call callback(plan) just before each of the engine's forward passes, while the block tables are as that
    step uses them: grown by the scheduler, with the step's copy-on-write copies decided."""
    engine.forward_observers.append(callback)
    try:
        yield
    finally:
        engine.forward_observers.remove(callback)


def parallel_sampling_usage(input_len: int, output_len: int, n: int, block_size: int = 16) -> BlockSteps:
    """Block-steps of one request with n completions of output_len tokens each, on a fresh BlockManager.

    Step 0 prefills the prompt in one sequence, which then forks the other n - 1; step k (1 <= k < output_len)
    writes the K/V of each completion's k-th token. (The last token is sampled but never written, as in the
    engine.) Without sharing, each completion would hold its own copy of the prompt from step 0 on.
    """
    if n < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"n, input_len and output_len must be >= 1, got {n}, {input_len}, {output_len}")
    manager = BlockManager(n * (cdiv(input_len + output_len, block_size) + 1), block_size)
    manager.allocate(0, input_len)
    for child in range(1, n):
        manager.fork(0, child)
    total = BlockSteps.of(manager.block_tables[0] for _ in range(n))  # step 0: n prompt copies without sharing
    for k in range(1, output_len):
        for seq_id in range(n):  # the first write into a shared block copies it (copy-on-write)
            manager.allocate(seq_id, input_len + k, write_from=input_len + k - 1)
        total += BlockSteps.of(manager.block_tables.values())
    return total


def parallel_sampling_saving(trace: list[TraceRequest], n: int, block_size: int = 16) -> BlockSteps:
    """Block-steps of every request of a trace served with n completions each."""
    total = BlockSteps()
    for request in trace:
        total += parallel_sampling_usage(request.input_len, request.output_len, n, block_size)
    return total


def trace_prompts(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids with the trace's input lengths (the traces carry lengths, not text)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (r.input_len,), generator=generator).tolist() for r in trace]


def beam_search_saving(llm, prompts: list, output_lens: list[int], beam_width: int) -> BlockSteps:
    """Block-steps of `llm.beam_search` over prompts, one at a time, each for its own number of new tokens,
    counted at every forward pass (prefill included): the sum of each output's `block_usage`. llm's engine must
    have nothing else running."""
    total = BlockSteps()
    for prompt, output_len in zip(prompts, output_lens):
        for physical, logical in llm.beam_search([prompt], beam_width, output_len)[0].block_usage:
            total += BlockSteps(physical, logical)
    return total


def _row(method: str, model: str, trace: str, n: int, usage: BlockSteps) -> dict:
    return {
        "method": method,
        "model": model,
        "trace": trace,
        "n": n,
        "saving": usage.saving,
        "paper": PAPER_SAVINGS.get((method, trace)),
    }


def parallel_sampling_rows(traces: dict[str, list[TraceRequest]], widths=WIDTHS, block_size: int = 16) -> list[dict]:
    """One row of the savings table per (trace, n): every request of the trace, n completions each."""
    return [
        _row("parallel sampling", "none (BlockManager)", name, n, parallel_sampling_saving(trace, n, block_size))
        for name, trace in traces.items()
        for n in widths
    ]


def beam_search_rows(
    llm, model: str, traces: dict[str, list[TraceRequest]], widths=WIDTHS, seed: int = 0
) -> list[dict]:
    """One row of the savings table per (trace, beam width): llm's beam search over random-token prompts with the
    trace's input lengths, each for its request's output length. model names llm's model in the table."""
    vocab_size = llm.engine.model.vocab_size
    rows = []
    for name, trace in traces.items():
        prompts, output_lens = trace_prompts(trace, vocab_size, seed), [r.output_len for r in trace]
        rows += [
            _row("beam search", model, name, width, beam_search_saving(llm, prompts, output_lens, width))
            for width in widths
        ]
    return rows
