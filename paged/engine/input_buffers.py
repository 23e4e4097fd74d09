"""The tensors a forward pass reads, made once and filled in place every step (guide §11), as vLLM V1's model runner
keeps them (vllm/v1/worker/gpu_model_runner.py: input_ids, positions, the block table, seq_lens, query_start_loc,
slot_mapping).

A step writes its token ids, positions, slots, block tables and lengths into the first rows of these tensors and
hands the forward pass views of them. The tensors' addresses never change, so a CUDA graph captured over them reads
the next step's inputs when it is replayed (engine/cuda_graphs.py).

A decode batch may be padded up to a captured batch size. A padding row computes one token at position 0, attends to
one slot of block 0, and its logits are dropped: the real rows' results do not depend on it. Its K and V go nowhere:
an eager forward pass leaves padding rows out of its K/V write, and a captured graph's write skips their slot,
PAD_SLOT_ID (-1).
"""

import torch

from paged.model.llama import AttentionMetadata

PAD_SLOT_ID = -1  # vLLM's name: a slot_mapping entry whose token's K and V are not written


class InputBuffers:
    """One step's inputs, up to max_num_tokens tokens of max_num_seqs sequences whose block tables hold at most
    max_blocks_per_seq blocks."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        int32, int64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self.positions = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self.slot_mapping = torch.full((max_num_tokens,), PAD_SLOT_ID, **int64)  # [max_num_tokens]
        self.logits_indices = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **int32)  # [max_num_seqs, max_blocks]
        self.context_lens = torch.zeros(max_num_seqs, **int32)  # [max_num_seqs]
        self.query_start_loc = torch.zeros(max_num_seqs + 1, **int32)  # [max_num_seqs + 1], prefills'

    def fits(self, num_tokens: int, num_seqs: int, num_blocks: int) -> bool:
        """Whether a step of num_tokens tokens of num_seqs sequences, the longest table num_blocks long, fits."""
        max_num_seqs, max_blocks = self.block_tables.shape
        return num_tokens <= self.input_ids.shape[0] and num_seqs <= max_num_seqs and num_blocks <= max_blocks

    def fill(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        logits_indices: list[int],
        tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        num_decodes: int,
        num_pad: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Write one step's lists into the buffers' first rows (the decodes first; num_pad of them, the last ones,
        padding) and return views of them: input_ids, positions int64 [num_tokens], AttentionMetadata, logits_indices
        int64 [num_logits]. Rows past a table's last block keep what an earlier step left: attention never reads
        them."""
        num_tokens, num_seqs = len(input_ids), len(tables)
        width = max((len(row) for row in tables), default=0)
        self.input_ids[:num_tokens].copy_(torch.tensor(input_ids))
        self.positions[:num_tokens].copy_(torch.tensor(positions))
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots))
        self.logits_indices[: len(logits_indices)].copy_(torch.tensor(logits_indices))
        if width:
            self.block_tables[:num_seqs, :width].copy_(torch.tensor([row + [0] * (width - len(row)) for row in tables]))
        self.context_lens[:num_seqs].copy_(torch.tensor(context_lens))
        prefill_starts = [0]
        for query_len in query_lens[num_decodes:]:
            prefill_starts.append(prefill_starts[-1] + query_len)
        self.query_start_loc[: len(prefill_starts)].copy_(torch.tensor(prefill_starts))
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            num_decode_tokens=num_decodes,
            decode_block_tables=self.block_tables[:num_decodes],
            decode_context_lens=self.context_lens[:num_decodes],
            prefill_block_tables=self.block_tables[num_decodes:num_seqs],
            prefill_query_start_loc=self.query_start_loc[: len(prefill_starts)],
            prefill_context_lens=self.context_lens[num_decodes:num_seqs],
            decode_max_context_len=max(context_lens[:num_decodes], default=0),
            prefill_max_query_len=max(query_lens[num_decodes:], default=0),
            prefill_max_context_len=max(context_lens[num_decodes:], default=0),
            num_pad_tokens=num_pad,
        )
        return (
            self.input_ids[:num_tokens],
            self.positions[:num_tokens],
            meta,
            self.logits_indices[: len(logits_indices)],
        )
