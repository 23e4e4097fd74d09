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
import torch.nn.functional as F

from paged.core.block_manager import BlockManager
from paged.core.sequence import Sequence
from paged.model.llama import AttentionMetadata


@dataclass
class StepInputs:
    """A step's forward-pass inputs, and the sequences whose next token is due with the first of their logits
    rows: one row, or 1 + k for a sequence verifying k drafts. A prompt chunk whose request asks for prompt
    logprobs also has a row for each of its positions that predicts a prompt token (prompt_rows)."""
    input_ids: torch.Tensor           # int64 [num_tokens]
    positions: torch.Tensor           # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor      # int64 [num_rows]
    sampled: list[tuple[Sequence, int]]  # (sequence, its first row), in row order
    prompt_rows: list[tuple[Sequence, int, int]]  # (sequence, first row, count): rows predicting prompt tokens


def step_inputs(block_manager: BlockManager, batch: list[tuple[Sequence, int]], device: torch.device) -> StepInputs:
    """batch [(sequence, new tokens)] in the forward pass's order -> the step's inputs. A sequence's chunk runs
    from its computed tokens on; one that reaches its last token (and its drafts) wants logits for each, and one
    whose request asks for prompt logprobs wants those of the positions before its last prompt token that it
    has not scored yet (a sequence recomputed after preemption has scored them all)."""
    chunks, sampled, prompt_rows, num_rows = [], [], [], 0
    for seq, num_new in batch:
        tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        num_logits = 1 + len(seq.spec_token_ids) if end == len(tokens) else 0
        if seq.request.params.prompt_logprobs is not None:   # positions p predict prompt token p + 1
            first = max(start, len(seq.request.prompt_logprobs))
            num_scored = max(0, min(end, seq.num_prompt_tokens - 1) - first)
            if num_scored:   # they run up to the chunk's end, or to the last prompt token's row
                num_logits = end - first
                prompt_rows.append((seq, num_rows, num_scored))
        chunks.append((seq.seq_id, tokens, start, end, num_logits))
        if end == len(tokens):
            sampled.append((seq, num_rows + num_logits - 1 - len(seq.spec_token_ids)))
        num_rows += num_logits
    return StepInputs(*prepare_inputs(block_manager, chunks, device), sampled, prompt_rows)


def prepare_inputs(block_manager: BlockManager, chunks: list[tuple[int, list[int], int, int, int]],
                   device: torch.device):
    """Returns input_ids, positions int64 [num_tokens], AttentionMetadata, logits_indices int64 [num_logits]."""
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

    def table_tensor(rows):  # int32 [len(rows), longest row], padded with block 0
        width = max((len(r) for r in rows), default=0)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)

    int32 = dict(dtype=torch.int32, device=device)
    prefill_query_lens = torch.tensor(query_lens[num_decodes:], **int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=num_decodes,
        decode_block_tables=table_tensor(tables[:num_decodes]),
        decode_context_lens=torch.tensor(context_lens[:num_decodes], **int32),
        prefill_block_tables=table_tensor(tables[num_decodes:]),
        prefill_query_start_loc=F.pad(prefill_query_lens.cumsum(0), (1, 0)).to(torch.int32),
        prefill_context_lens=torch.tensor(context_lens[num_decodes:], **int32),
        decode_max_context_len=max(context_lens[:num_decodes], default=0),
        prefill_max_query_len=max(query_lens[num_decodes:], default=0),
        prefill_max_context_len=max(context_lens[num_decodes:], default=0))
    return (torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta, torch.tensor(logits_indices, dtype=torch.int64, device=device))
