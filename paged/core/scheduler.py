"""The scheduler: which sequences run in the next engine step, and how many tokens each (guide §11, §12).

Every step it fills a token budget (`max_num_batched_tokens`; in a step with no decode, optionally stretched to hold
the first prompt whole, `max_idle_prefill_tokens`):
  1. running sequences first: decodes (one token each), then the next chunks of prompts being prefilled;
     if the pool has no block for one of them, the most recently admitted running sequence not yet scheduled
     is preempted (its blocks freed, to be recomputed later) until there is room;
  2. then waiting sequences in arrival order, admitted while the block manager answers OK and their seats fit
     `max_num_seqs` (a request with n completions takes n seats: its forks run as soon as its prompt is done);
     a prompt whose leading blocks are in the prefix cache starts past them; with LoRA, only while the running
     sequences then use at most `max_loras` distinct adapters (guide §16). With chunked prefill a prompt may
     take only part of the remaining budget; a preempted sequence is recomputed in chunks in any case, since its
     prompt and output together may exceed the budget.
With `preemption_mode="swap"` (guide §15, §17) a preempted sequence's blocks are copied out to a swap tier instead
of dropped, when it holds them alone and the tier has room (else it is recomputed); it waits in a `swapped` queue
beside `waiting` and `running`, and swapped sequences come back, their blocks copied in, before any waiting one is
admitted. With a prefix-cache tier, a prompt's leading blocks that miss the pool may be found there and copied in.
The scheduler only names the copies; the engine makes them (`offload.py`).
A KV connector (`kv_connector.py`, guide §15) may serve a prompt's tokens past its prefix-cache hit with K/V computed
by another engine: the admission asks it how many, allocates their blocks like any others, and tells it which blocks
to fill. When a sequence finishes, the connector may ask to keep its blocks until it has saved them (to send them to
another engine); they are freed when it says so (`update_from_kv_xfer_finished`).
Scheduling happens every iteration, so a finished sequence's slot is reused at the very next step.

The scheduler owns every sequence's state, as vLLM V1's does (guide §17): `schedule()` says what a step computes,
and after the forward pass and the sampler `update_from_output(plan, sampled)` advances each scheduled sequence's
`num_computed_tokens`, starts the completions a finished prompt forks (n > 1), rolls a verify back over its rejected
drafts, appends the sampled tokens, checks the stop conditions, and frees the sequences that finished. Beam search's
forks and chosen tokens go through it too.
"""

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from paged.config import EngineConfig
from paged.core.block_manager import AllocStatus, BlockManager
from paged.core.sequence import Request, Sequence, SequenceStatus
from paged.kv_connector import KVConnector, KVConnectorMetadata


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens to compute)
    batch: list[tuple[Sequence, int]] = field(default_factory=list)  # scheduled, in the forward pass's order
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the step
    cached_blocks: list = field(default_factory=list)  # blocks this step enters in the prefix cache
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (pool block, swap slot), before all
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap slot, pool block)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)  # (prefix-tier slot, pool block)
    num_computed: dict[int, int] = field(default_factory=dict)  # seq_id -> its tokens computed before the step
    decodes: set[int] = field(default_factory=set)  # seq_ids computing their newest token, an output token
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child): a prompt this step
    # ends forks its request's other completions; they sample from its logits row and run from the next step
    kv_connector_metadata: KVConnectorMetadata | None = None  # the K/V the connector loads before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class SchedulerState:
    """The scheduler's queues and counts as an engine step found them (Scheduler.checkpoint)."""

    running: list[Sequence]
    waiting: deque[Sequence]
    swapped: deque[Sequence]
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int
    next_seq_id: int
    sending: dict[str, list[int]]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        swap_space=None,
        prefix_tier=None,
        device: torch.device | str = "cpu",
        kv_connector: KVConnector | None = None,
    ):
        """config: the limits (EngineConfig, checked when it was made); swap_space, prefix_tier: offload.py's;
        kv_connector: kv_connector.py's (None: one that moves nothing)."""
        self.config = config
        self.block_manager = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_loras = config.max_loras if config.enable_lora else None  # distinct adapters at once; None: no LoRA
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted with their blocks in swap_space (offload.SwapSpace)
        self.swap_space = swap_space
        self.prefix_tier = prefix_tier  # offload.PrefixTier, or None
        self.kv_connector = kv_connector or KVConnector()
        self.sending: dict[str, list[int]] = {}  # request_id -> seq_ids of finished sequences whose blocks are kept
        self.prefix_hit_tokens = 0  # prompt tokens admitted with their K/V already in the prefix cache
        self.prefix_query_tokens = 0  # prompt tokens admitted
        self.num_preemptions = 0
        self.device = torch.device(device)  # where seeded sequences' sampling generators live
        self.next_seq_id = 0

    # ---- sequences in ---------------------------------------------------------------------------------------

    def new_sequence(self, request: Request) -> Sequence:
        """The request's next completion, not yet in any queue; seeded requests give each its own generator."""
        index = len(request.seqs)
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(request.params.seed + index)
        seq = Sequence(self.next_seq_id, request, index, generator)
        self.next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def add_request(self, request: Request) -> None:
        """Queue the request's first sequence; its other completions fork when its prompt is done."""
        self.waiting.append(self.new_sequence(request))

    def fork(self, parent: Sequence, child: Sequence | None = None) -> Sequence:
        """A running copy of parent's accepted state (child, or a new completion of its request) that shares its
        blocks; the first write to a shared block copies it. Parent may have drafts in flight: the copy has its
        real tokens and their K/V only."""
        child = child or self.new_sequence(parent.request)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens - len(parent.spec_token_ids)
        child.status = SequenceStatus.RUNNING
        self.block_manager.fork(parent.seq_id, child.seq_id, child.num_computed_tokens)
        self.running.append(child)
        return child

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        if not decoding:
            budget = self._idle_budget(budget, prefilling)
        for seq in decoding + prefilling:  # decodes first, then the running prompts' next chunks
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older sequence
            if seq.spec_token_ids:
                self._fit_lookahead(seq, budget)
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new, scheduled_ids, out):
                continue
            self.block_manager.allocate(
                seq.seq_id, seq.num_computed_tokens + num_new, write_from=seq.num_computed_tokens
            )
            self._schedule(seq, num_new, out)
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        seats = sum(seq.num_seats for seq in self.running)
        if not out.preempted:
            budget, seats = self._swap_in(out, budget, seats)
        while self.waiting and not self.swapped and not out.preempted and budget > 0:
            seq = self.waiting[0]  # waiting sequences have nothing computed (new, or preempted and dropped)
            if seats + seq.num_seats > self.max_num_seqs or not self._adapter_fits(seq):
                break
            hits, tier_hits, num_external = [], [], 0  # a request that skips reading the cache computes it all
            if not seq.request.params.skips_prefix_cache:
                hits = self.block_manager.find_cached_prefix(seq.token_ids, seq.request.cache_key)
                tier_hits = (
                    []
                    if self.prefix_tier is None
                    else self.prefix_tier.find(seq.token_ids, seq.request.cache_key, skip=len(hits))
                )
                num_external = self.kv_connector.get_num_new_matched_tokens(  # K/V it loads before the step
                    seq.request, (len(hits) + len(tier_hits)) * self.block_manager.block_size
                )
            num_cached = (len(hits) + len(tier_hits)) * self.block_manager.block_size + num_external
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not (self.enable_chunked_prefill or seq.num_preemptions > 0):
                    break
                num_new = budget
            if self.block_manager.can_allocate(num_cached + num_new, seq.seq_id, hits) is not AllocStatus.OK:
                break  # first come, first served: nobody overtakes the head of the queue
            table = self.block_manager.allocate(seq.seq_id, num_cached + num_new, hits)
            if num_external:
                self.kv_connector.update_state_after_alloc(seq.request, list(table), num_external)
            if tier_hits:  # copied in before the step, and named in the pool's cache at once
                loads, loaded = self.prefix_tier.load(seq.seq_id, len(hits), tier_hits)
                out.blocks_to_load += loads
                out.cached_blocks += loaded
            self.waiting.popleft()
            seq.num_computed_tokens = seq.request.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, num_new, out)
            budget -= num_new
            seats += seq.num_seats
            self.prefix_hit_tokens += len(hits) * self.block_manager.block_size
            self.prefix_query_tokens += seq.num_tokens
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        out.kv_connector_metadata = self.kv_connector.build_connector_meta()
        out.batch = sorted(out.scheduled, key=self._batch_order)
        for seq, num_new in out.batch:  # a prompt this step ends forks the other completions
            if seq.num_computed_tokens + num_new == seq.num_tokens + len(seq.spec_token_ids):
                out.forks += [(seq, self.new_sequence(seq.request)) for _ in range(seq.num_seats - 1)]
        return out

    def _idle_budget(self, budget: int, prefilling: list[Sequence]) -> int:
        """The budget of a step in which no sequence decodes. The budget caps a step's length because every stream
        waits for the whole step before its next token; with no stream, nobody waits, and cutting a prompt into
        chunks only makes its first token later (each chunk reads the weights again). So the first prompt in line
        (a running one's rest, else the head of the queue) may run whole, up to max_idle_prefill_tokens."""
        cap = self.config.max_idle_prefill_tokens
        first = prefilling[0] if prefilling else self.waiting[0] if self.waiting and not self.swapped else None
        if cap is None or first is None:
            return budget
        return max(budget, min(first.num_tokens - first.num_computed_tokens, cap))

    def _batch_order(self, item: tuple[Sequence, int]) -> tuple[bool, int]:
        """The forward pass's order: single-token decodes first, then the chunks of more tokens, the layout
        AttentionMetadata describes; with LoRA, each adapter's sequences side by side within both (guide §16)."""
        seq, num_new = item
        return num_new > 1, seq.request.lora_int_id if self.max_loras is not None else 0

    def _swap_in(self, out: SchedulerOutput, budget: int, seats: int) -> tuple[int, int]:
        """Swapped sequences come back first, in order, while the pool and the seats hold them; each is scheduled
        at once for its next tokens. Returns what is left of the budget and the seats taken."""
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if (
                seats + seq.num_seats > self.max_num_seqs
                or not self._adapter_fits(seq)
                or self.block_manager.can_allocate(seq.num_computed_tokens + num_new) is not AllocStatus.OK
            ):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.swap_space.swap_in(seq.seq_id, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, num_new, out)
            budget -= num_new
            seats += seq.num_seats
        return budget, seats

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether seq's adapter is already running or a slot is left for it, so a step never needs more adapters
        than there are slots."""
        lora_id = seq.request.lora_int_id
        if self.max_loras is None or not lora_id:
            return True
        running = {s.request.lora_int_id for s in self.running} - {0}
        return lora_id in running or len(running) < self.max_loras

    def _schedule(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Put seq in this step and register the blocks the step fills in the prefix cache now, as vLLM does:
        every layer writes the step's K/V before any attention reads them, so a request admitted later in the
        same step can already share them."""
        out.scheduled.append((seq, num_new))
        out.num_computed[seq.seq_id] = seq.num_computed_tokens
        if num_new == 1 and seq.num_prompt_tokens <= seq.num_computed_tokens == seq.num_tokens - 1:
            out.decodes.add(seq.seq_id)
        num_real = seq.num_computed_tokens + num_new - len(seq.spec_token_ids)  # draft tokens are not cached
        out.cached_blocks += self.block_manager.cache_full_blocks(
            seq.seq_id, seq.token_ids, num_real, seq.request.cache_key
        )

    def _fit_lookahead(self, seq: Sequence, budget: int) -> None:
        """A verify of k drafts costs 1 + k tokens of the budget and 1 + k slots (speculative decoding, guide §14):
        keep the drafts the budget pays for, and none if the pool has no room for them; nobody is preempted
        to make room for a guess."""
        del seq.spec_token_ids[max(0, budget - 1) :]
        if (
            self.block_manager.can_allocate(
                seq.num_tokens + len(seq.spec_token_ids), seq.seq_id, write_from=seq.num_computed_tokens
            )
            is not AllocStatus.OK
        ):
            seq.spec_token_ids.clear()

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences not yet scheduled this step until seq can hold num_tokens.
        Returns False if seq itself had to go."""
        while (
            self.block_manager.can_allocate(num_tokens, seq.seq_id, write_from=seq.num_computed_tokens)
            is not AllocStatus.OK
        ):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled_ids)
            self.running.remove(victim)
            if not self._swap_out(victim, out):
                self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _swap_out(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Swap preemption: seq's computed blocks are to be copied out and are freed; it waits in `swapped`.
        False, to recompute it instead, if swap is off, the tier has no room, or seq shares a block."""
        if self.swap_space is None or not self.swap_space.can_swap_out(seq.seq_id, seq.num_computed_tokens):
            return False
        out.blocks_to_swap_out += self.swap_space.swap_out(seq.seq_id, seq.num_computed_tokens)
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.SWAPPED
        self.swapped.appendleft(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the sequence's blocks; it will prefill prompt + output again."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def checkpoint(self) -> "SchedulerState":
        """The queues and counts, for a step that may be undone (engine/journal.py); the sequences in the
        queues are kept by their requests."""
        return SchedulerState(
            list(self.running),
            self.waiting.copy(),
            self.swapped.copy(),
            self.prefix_hit_tokens,
            self.prefix_query_tokens,
            self.num_preemptions,
            self.next_seq_id,
            {request_id: list(seq_ids) for request_id, seq_ids in self.sending.items()},
        )

    def may_change(self):
        """The sequences a step can change: the running and swapped ones, and the waiting ones it could admit
        (each takes a seat), not the whole queue behind them."""
        return itertools.chain(
            self.running, self.swapped, itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running)))
        )

    def restore(self, record: "SchedulerState", lost: set[int]) -> None:
        """Put the queues and counts back as checkpoint found them; then the sequences in lost (ids), whose K/V
        the undone step overwrote, go to the head of the queue to be recomputed, as after a preemption."""
        self.running, self.waiting, self.swapped = list(record.running), record.waiting.copy(), record.swapped.copy()
        self.prefix_hit_tokens, self.prefix_query_tokens = record.prefix_hit_tokens, record.prefix_query_tokens
        self.num_preemptions, self.next_seq_id = record.num_preemptions, record.next_seq_id
        self.sending = {request_id: list(seq_ids) for request_id, seq_ids in record.sending.items()}
        for seq in [seq for seq in self.swapped if seq.seq_id in lost][::-1]:
            self.swapped.remove(seq)
            self.swap_space.discard(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        for seq in [seq for seq in self.running if seq.seq_id in lost][::-1]:
            self.running.remove(seq)
            self._preempt(seq)

    # ---- after the forward pass ------------------------------------------------------------------------------

    def update_from_output(
        self, plan: SchedulerOutput, sampled: list[tuple[Sequence, list[int]]], now: float | None = None
    ) -> list[Sequence]:
        """Advance the sequences plan scheduled past the tokens the step computed, start its forks, and append
        what the sampler chose: sampled holds (sequence, tokens), one token, or the 1..k + 1 a verify of k drafts
        accepts. A verify rolls back over its rejected drafts first (their blocks go back to the pool). Each
        token is checked against the stop conditions; returns the sequences that finished, their blocks freed.
        now: the engine's clock, for the requests' token times (None records none)."""
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
        for parent, child in plan.forks:
            self.fork(parent, child)
        finished = []
        for seq, tokens in sampled:
            if seq.spec_token_ids:
                self._accept(seq, tokens)
            metrics = seq.request.metrics
            if now is not None:
                metrics.first_token_time = metrics.first_token_time or now
            for token in tokens:
                seq.token_ids.append(token)
                if now is not None:
                    metrics.token_times.append(now)
                if self.check_stop(seq, token):
                    finished.append(seq)
                    break
        self.finish(finished)
        return finished

    def _accept(self, seq: Sequence, tokens: list[int]) -> None:
        """seq verified its drafts and appends tokens (the accepted drafts and one more): it rolls back over the
        rejected drafts, whose K/V stay in the pool unread until overwritten, and blocks holding only those go."""
        seq.num_computed_tokens -= len(seq.spec_token_ids) - (len(tokens) - 1)
        self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
        seq.spec_token_ids, seq.spec_draft_probs = [], None

    def check_stop(self, seq: Sequence, token: int) -> bool:
        """Whether seq, which just appended token, is done: "stop" at EOS or a stop token, "length" at max_tokens
        or the model's length."""
        params = seq.params
        if (token in self.config.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or (
            self.config.max_model_len is not None and seq.num_tokens >= self.config.max_model_len
        ):
            seq.finish_reason = "length"
        else:
            return False
        seq.status = SequenceStatus.FINISHED
        return True

    def finish(self, seqs: list[Sequence]) -> None:
        """Free the blocks of sequences that just finished and drop them from the running list; blocks the KV
        connector asks to keep stay in their table until update_from_kv_xfer_finished."""
        for seq in seqs:
            table = self.block_manager.block_tables.get(seq.seq_id, [])
            if self.kv_connector.request_finished(seq.request, list(table)):
                self.sending.setdefault(seq.request.request_id, []).append(seq.seq_id)
            else:
                self.block_manager.free(seq.seq_id)
        self.running = [seq for seq in self.running if not seq.is_finished]

    def update_from_kv_xfer_finished(self, request_ids) -> None:
        """The KV connector has saved the kept blocks of these requests (get_finished): free them."""
        for request_id in request_ids:
            for seq_id in self.sending.pop(request_id):
                self.block_manager.free(seq_id)

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.swapped:
                self.swapped.remove(seq)
                self.swap_space.discard(seq.seq_id)
        self.finish(seqs)
