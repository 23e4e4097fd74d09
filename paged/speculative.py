"""Speculative decoding on paged memory (guide §14): propose k tokens cheaply, verify them in one target pass.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    LLM(..., speculative_config={"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3,
                                 "draft_layers": 8})   # draft_layers: an early-exit self-draft (see below)

A step with speculation:
  1. propose: before scheduling, every decoding sequence gets up to k draft tokens (`seq.spec_token_ids`);
     a sequence near max_tokens or max_model_len proposes fewer, so a verify never runs past either;
  2. schedule: a verify costs 1 + k tokens of the budget and 1 + k slots of the pool (vLLM's lookahead tokens);
     the scheduler trims the drafts when the budget is short and drops them when the pool has no room;
  3. verify: the target runs the last real token and the drafts as one prefill-shaped chunk over the paged cache,
     in the same forward pass as the sequences without drafts, writing every draft's K/V into the sequence's blocks;
  4. accept (`engine/rejection_sampler.py`): 1..k + 1 tokens are appended. Greedy and seeded rows keep the drafts equal to
     the token plain decoding picks at their position (a seeded row with that position's noise), so their tokens do
     not depend on the drafts, hence not on the pool or the batch; unseeded rows use rejection sampling. The
     sequence rolls back over the rejected drafts (`num_computed_tokens`), and blocks holding only rejected tokens
     go back to the pool at once (`BlockManager.truncate`). The prefix cache only ever registers blocks full of
     accepted tokens.

Proposers:
  - ngram (prompt lookup): find the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) earlier in
    prompt + output, the most recent occurrence, and propose the tokens that followed it. No second model.
  - draft model: a model of the target's family and vocabulary (a smaller Qwen3 for a Qwen3) runs k cheap steps
    on its own paged KV pool, with its own block tables, grown for the k steps and truncated back with the
    target's. The target's own model as its draft ("smollm2" for the bundled model, the same folder, the same
    object) is the target itself, sharing its weights: every greedy draft must be accepted. `draft_layers: L`
    keeps only the draft's first L layers, with its final norm and head: an early-exit self-draft, L / num_layers
    of the cost, untrained. A seeded sequence's draft samples with the noise the target will draw at each
    position (coupled drafting): from a copy of the sequence's generator, which the draft does not move on.
"""

import copy
import os
from dataclasses import dataclass

import numpy as np
import torch

from paged.config import SpeculativeConfig
from paged.core.block_manager import AllocStatus, BlockManager, BlockManagerState
from paged.engine.kv_cache import KVCache
from paged.engine.model_inputs import prepare_inputs
from paged.engine.rejection_sampler import greedy_accept, rejection_sample, seeded_accept
from paged.engine.sampler import exponential_noise, filter_logits, filter_params, greedy_tokens, seeded_token
from paged.model.llama import PagedLlama


def resolve_draft(config: SpeculativeConfig, target: PagedLlama, backend: str) -> PagedLlama:
    """The draft model as a PagedLlama on the target's device and dtype, sharing weights with the target where
    it is the target (or its first layers): the same model object, "smollm2" twice, or the same folder."""
    from paged.model.loader import load_model

    argument, model = "speculative_config['model']", config.model
    if isinstance(model, (str, os.PathLike)) and model != "smollm2":
        from paged.model.checkpoints import resolve_folder

        model = str(resolve_folder(os.fspath(model), argument).resolve())
    if model is target.source or (isinstance(model, str) and model == target.source):
        draft = copy.copy(target)
    else:
        draft, _ = load_model(model, None, target.device, target.dtype, backend, argument, with_tokenizer=False)
    if draft.embed_tokens.shape[0] != target.embed_tokens.shape[0]:
        raise ValueError(
            f"speculative_config['model'] has a vocabulary of {draft.embed_tokens.shape[0]} tokens, "
            f"the target {target.embed_tokens.shape[0]}: a draft must share the target's tokenizer"
        )
    if draft.max_position < target.max_position:
        raise ValueError(
            f"speculative_config['model'] holds {draft.max_position} positions, fewer than the "
            f"target's max_model_len ({target.max_position})"
        )
    if config.draft_layers is not None:
        if config.draft_layers > len(draft.layers):
            raise ValueError(
                f"speculative_config['draft_layers'] ({config.draft_layers}) must be <= the draft's "
                f"{len(draft.layers)} layers"
            )
        draft.layers = draft.layers[: config.draft_layers]
    return draft


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, longest n first."""
    tokens = np.asarray(token_ids)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [len - n, n], all but the suffix
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@dataclass(frozen=True)
class DrafterState:
    """The draft pool as an engine step found it (DraftModelProposer.checkpoint)."""

    block_manager: BlockManagerState
    num_computed: dict[int, int]


@dataclass(frozen=True)
class SpeculatorState:
    """The speculator's counts and draft pool as an engine step found them (Speculator.checkpoint)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    drafter: DrafterState | None


class DraftModelProposer:
    """k greedy or sampled steps of a draft model over its own paged KV pool, batched over sequences."""

    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int):
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size)
        self.kv_cache = KVCache(
            len(model.layers),
            model.num_kv_heads,
            model.head_dim,
            num_blocks,
            block_size,
            dtype=model.dtype,
            device=model.device,
        )
        self.num_computed: dict[int, int] = {}  # seq_id -> leading tokens whose K/V the draft pool holds

    def propose(self, seqs, lengths: list[int], default_generator) -> None:
        """Sets seq.spec_token_ids (and spec_draft_probs for unseeded sampled rows) for each seq, up to lengths[i]
        tokens. A seeded row's draft j is the exponential race over q_j with the noise of the target's j-th next
        position, drawn from a copy of its generator (coupled drafting; rejection_sampler.seeded_accept)."""
        active = []
        for seq, k in zip(seqs, lengths):
            # K/V for the real tokens and drafts 1..k-1 (draft k is proposed, never fed)
            if self.block_manager.can_allocate(seq.num_tokens + k - 1, seq.seq_id) is AllocStatus.OK:
                self.block_manager.allocate(seq.seq_id, seq.num_tokens + k - 1)
                active.append((seq, k))
        drafts = {seq.seq_id: [] for seq, _ in active}
        probs = {seq.seq_id: [] for seq, _ in active}
        lookahead = {seq.seq_id: copy_generator(seq.generator) for seq, _ in active if seq.generator is not None}
        for j in range(max((k for _, k in active), default=0)):
            chunks, order = [], []
            for seq, k in active:
                if k <= j:
                    continue
                tokens = seq.token_ids + drafts[seq.seq_id]
                start = min(self.num_computed.get(seq.seq_id, 0), seq.num_tokens - 1) if j == 0 else len(tokens) - 1
                chunks.append((seq.seq_id, tokens, start, len(tokens), 1))
                order.append(seq)
            decodes_first = sorted(range(len(chunks)), key=lambda i: chunks[i][3] - chunks[i][2] > 1)
            chunks, order = [chunks[i] for i in decodes_first], [order[i] for i in decodes_first]
            input_ids, positions, meta, logits_indices = prepare_inputs(self.block_manager, chunks, self.model.device)
            logits = self.model.forward(input_ids, positions, meta, self.kv_cache, logits_indices)  # [seqs, vocab]
            greedy = greedy_tokens(logits).tolist()  # [seqs]
            for row, seq in enumerate(order):
                params = seq.params
                if params.greedy:
                    token = greedy[row]
                else:
                    q = filtered_probs(logits[row : row + 1], params)[0]  # [vocab]
                    if seq.seq_id in lookahead:
                        token = seeded_token(q, exponential_noise(q, lookahead[seq.seq_id]))
                    else:
                        token = int(torch.multinomial(q, 1, generator=default_generator))
                        probs[seq.seq_id].append(q)
                drafts[seq.seq_id].append(token)
        for seq, _ in active:
            seq.spec_token_ids = drafts[seq.seq_id]
            seq.spec_draft_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None
            self.num_computed[seq.seq_id] = seq.num_tokens  # the drafts' K/V are overwritten next time
            self.block_manager.truncate(seq.seq_id, seq.num_tokens)

    def release(self, live_seq_ids: set[int]) -> None:
        """Free the draft tables of sequences that finished, were aborted or preempted."""
        for seq_id in [s for s in self.block_manager.block_tables if s not in live_seq_ids]:
            self.block_manager.free(seq_id)
            self.num_computed.pop(seq_id, None)

    def checkpoint(self) -> "DrafterState":
        return DrafterState(self.block_manager.checkpoint(), dict(self.num_computed))

    def stop_logging(self) -> None:
        self.block_manager.stop_logging()

    def restore(self, record: "DrafterState") -> None:
        """Back to checkpoint; a sequence whose draft blocks went to another meanwhile computes its draft K/V
        again."""
        lost = self.block_manager.restore(record.block_manager, written=True)
        self.num_computed = dict(record.num_computed)
        for seq_id in lost:
            self.block_manager.free(seq_id)
            self.num_computed.pop(seq_id, None)


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A generator in generator's state, to draw ahead from without moving generator on."""
    copied = torch.Generator(device=generator.device)
    copied.set_state(generator.get_state())
    return copied


def filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """logits [rows, vocab] of one sequence -> its filtered probabilities [rows, vocab], as plain sampling filters
    them (temperature, min-p, top-k, top-p), so what verification keeps is distributed as plain decoding's."""
    rows, vocab = logits.shape
    return filter_logits(logits, *filter_params([params] * rows, vocab, logits.device))


class Speculator:
    """The engine's hooks: propose before scheduling, verify after the forward pass, and the counts."""

    def __init__(self, config: SpeculativeConfig, draft: PagedLlama | None, num_blocks: int, block_size: int):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(
                f"speculative_config['method'] {config.method!r} needs a draft model exactly when it "
                f"is 'draft_model' (resolve_draft makes it)"
            )
        self.config = config
        self.k = config.num_speculative_tokens
        self.drafter = DraftModelProposer(draft, num_blocks, block_size) if draft is not None else None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    def propose(self, running, max_model_len: int, default_generator) -> None:
        seqs, lengths = [], []
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None  # drafts of a step that did not run are stale
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue  # still prefilling
            room = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
            if min(self.k, room) > 0:  # a verify appends up to k + 1 tokens: no more than the sequence may take
                seqs.append(seq)
                lengths.append(min(self.k, room))
        if self.drafter is not None:
            self.drafter.propose(seqs, lengths, default_generator)
            return
        cfg = self.config
        for seq, k in zip(seqs, lengths):
            seq.spec_token_ids = ngram_propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            seq.spec_draft_probs = None

    def verify(self, seq, logits: torch.Tensor, default_generator) -> list[int]:
        """logits [1 + k, vocab]: the target's rows for seq's last real token and its k drafts.
        Returns the 1..k + 1 tokens to append: greedy and seeded rows exactly plain decoding's, unseeded sampled
        rows by rejection sampling with the engine's generator."""
        drafts = seq.spec_token_ids
        if seq.params.greedy:
            return greedy_accept(greedy_tokens(logits).tolist(), drafts)
        if seq.generator is not None:
            return seeded_accept(filtered_probs(logits, seq.params), drafts, seq.generator)
        draft_probs = None if seq.spec_draft_probs is None else seq.spec_draft_probs[: len(drafts)]
        return rejection_sample(filtered_probs(logits, seq.params), drafts, draft_probs, default_generator)

    def record(self, seq, tokens: list[int]) -> None:
        """Count a verify of seq's drafts that appends tokens."""
        drafts = seq.spec_token_ids
        accepted = len(tokens) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        seq.request.metrics.num_draft_tokens += len(drafts)
        seq.request.metrics.num_accepted_tokens += accepted

    def release(self, live_seq_ids: set[int]) -> None:
        if self.drafter is not None:
            self.drafter.release(live_seq_ids)

    def checkpoint(self) -> "SpeculatorState":
        """Open the engine step's transaction: the counts and the draft pool can be put back as they are now."""
        return SpeculatorState(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.num_accepted_tokens_per_pos),
            None if self.drafter is None else self.drafter.checkpoint(),
        )

    def stop_logging(self) -> None:
        if self.drafter is not None:
            self.drafter.stop_logging()

    def restore(self, record: "SpeculatorState") -> None:
        self.num_drafts, self.num_draft_tokens = record.num_drafts, record.num_draft_tokens
        self.num_accepted_tokens = record.num_accepted_tokens
        self.num_accepted_tokens_per_pos = list(record.num_accepted_tokens_per_pos)
        if self.drafter is not None:
            self.drafter.restore(record.drafter)

    def stats(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
