"""One forward pass's inputs (guide §11): the chunks of a step flattened into token ids, positions and slots, and
the block tables that attention reads.

A chunk is `(seq_id, token_ids, start, end, num_logits)`: tokens start..end-1 of a sequence are computed now, and
the logits of its last num_logits of them are wanted (1 to sample the next token, k + 1 to verify k speculative
tokens, 0 for a prompt chunk that does not reach the end). Single-token chunks come first, as AttentionMetadata
describes; the caller orders them so (the scheduler's `plan.batch` is in that order) and prepare_inputs checks it.
The engine (`step_inputs`, from a scheduler's plan) and a draft model (`speculative.py`) both build their steps
here, each over its own block manager.
"""

from dataclasses import dataclass

import torch

from paged.core.block_manager import BlockManager
from paged.core.sequence import Sequence
from paged.engine.input_buffers import PAD_SLOT_ID, InputBuffers
from paged.model.llama import AttentionMetadata


@dataclass
class StepInputs:
    """A step's forward-pass inputs, and the sequences whose next token is due with the first of their logits
    rows: one row, or 1 + k for a sequence verifying k drafts. A prompt chunk whose request asks for prompt
    logprobs also has a row for each of its positions that predicts a prompt token (prompt_rows)."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_rows]
    sampled: list[tuple[Sequence, int]]  # (sequence, its first row), in row order
    prompt_rows: list[tuple[Sequence, int, int]]  # (sequence, first row, count): rows predicting prompt tokens
    padded_size: int | None = None  # rows of a padded decode batch (logits for each); None: not padded


def step_inputs(
    block_manager: BlockManager,
    batch: list[tuple[Sequence, int]],
    device: torch.device,
    buffers: InputBuffers | None = None,
    pad_sizes: tuple[int, ...] = (),
) -> StepInputs:
    """batch [(sequence, new tokens)] in the forward pass's order -> the step's inputs, written into buffers when
    given. A batch of decodes only (one token each, each sampling its next) is padded up to the smallest of
    pad_sizes that holds it, if one does (engine/cuda_graphs.py). A sequence's chunk runs
    from its computed tokens on; one that reaches its last token (and its drafts) wants logits for each, and one
    whose request asks for prompt logprobs wants those of the positions before its last prompt token that it
    has not scored yet (a sequence recomputed after preemption has scored them all)."""
    chunks, sampled, prompt_rows, num_rows = [], [], [], 0
    for seq, num_new in batch:
        tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        num_logits = 1 + len(seq.spec_token_ids) if end == len(tokens) else 0
        if seq.request.params.prompt_logprobs is not None:  # positions p predict prompt token p + 1
            first = max(start, len(seq.request.prompt_logprobs))
            num_scored = max(0, min(end, seq.num_prompt_tokens - 1) - first)
            if num_scored:  # they run up to the chunk's end, or to the last prompt token's row
                num_logits = end - first
                prompt_rows.append((seq, num_rows, num_scored))
        chunks.append((seq.seq_id, tokens, start, end, num_logits))
        if end == len(tokens):
            sampled.append((seq, num_rows + num_logits - 1 - len(seq.spec_token_ids)))
        num_rows += num_logits
    padded_size = None
    if chunks and all(end - start == 1 and num_logits == 1 for _, _, start, end, num_logits in chunks):
        padded_size = next((size for size in pad_sizes if size >= len(chunks)), None)
    return StepInputs(
        *prepare_inputs(block_manager, chunks, device, buffers, padded_size), sampled, prompt_rows, padded_size
    )


def prepare_inputs(
    block_manager: BlockManager,
    chunks: list[tuple[int, list[int], int, int, int]],
    device: torch.device,
    buffers: InputBuffers | None = None,
    pad_decodes_to: int | None = None,
):
    """Returns input_ids, positions int64 [num_tokens], AttentionMetadata, logits_indices int64 [num_logits]: views
    of `buffers` (engine/input_buffers.py), or of tensors made for this step alone when none are given.
    pad_decodes_to: a step of decodes only, padded with rows that write nothing up to that many sequences, every
    row's logits wanted (a CUDA graph's batch size; the caller keeps the first rows' logits)."""
    input_ids, positions, slots, logits_indices = [], [], [], []
    tables, context_lens, query_lens = [], [], []
    for seq_id, token_ids, start, end, num_logits in chunks:
        input_ids += token_ids[start:end]
        positions += range(start, end)
        slots += block_manager.slot_mapping(seq_id, start, end)
        tables.append(block_manager.block_tables[seq_id])
        context_lens.append(end)
        query_lens.append(end - start)
        logits_indices += range(len(input_ids) - num_logits, len(input_ids))
    num_decodes = sum(1 for n in query_lens if n == 1)
    if query_lens[:num_decodes] != [1] * num_decodes:
        raise ValueError(f"chunks must put single-token decodes first (query lengths {query_lens})")
    num_pad = 0
    if pad_decodes_to is not None:
        if num_decodes != len(chunks) or not num_decodes <= pad_decodes_to:
            raise ValueError(
                f"pad_decodes_to ({pad_decodes_to}) pads a step of at most that many decodes only "
                f"(query lengths {query_lens})"
            )
        num_pad = pad_decodes_to - num_decodes
        input_ids += [0] * num_pad
        positions += [0] * num_pad
        slots += [PAD_SLOT_ID] * num_pad
        tables += [[0]] * num_pad
        context_lens += [1] * num_pad
        query_lens += [1] * num_pad
        logits_indices = list(range(pad_decodes_to))
        num_decodes = pad_decodes_to
    if buffers is None:
        buffers = InputBuffers(len(input_ids), len(tables), max((len(row) for row in tables), default=0), device)
    return buffers.fill(
        input_ids, positions, slots, logits_indices, tables, context_lens, query_lens, num_decodes, num_pad
    )
