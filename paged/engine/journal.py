"""The engine step's undo journal (guide §11, the engine step): a step happens whole or not at all.

`LLMEngine.step` (and each step of a beam search) runs between `StepJournal.begin` and `commit`. If anything in it
raises, KeyboardInterrupt included, `rollback` puts the engine back as it was at `begin`, and the exception goes
on: the requests in flight, their sequences and metrics, the scheduler's queues, the block manager (tables, ref
counts, free blocks in their order, the prefix cache's names), the offload tiers' indexes, the draft pool, the LoRA
slots, the KV connector's queues, the sampling generators and every count.

Every participant takes part the same way: `checkpoint()` returns a small frozen record of its state (its own
dataclass: SequenceState, RequestState, SchedulerState, BlockManagerState, SwapSpaceState, PrefixTierState,
SpeculatorState, LoRAState, the connector's), and `restore(record)` puts it back. Lists a step only appends to are
kept by their lengths; the block manager and the tiers, whose free lists are too large to copy every step, log their
changes into their record instead (`stop_logging` closes the logs when the step commits) and undo them newest first.

K/V tensors are not copied: a step writes past the computed tokens of every sequence it began with, except in blocks
and tier slots it took for fresh use. If the step got as far as writing (the model runner's `kv_written`), those lose their cached
names, and a sequence it preempted whose blocks or slots it gave to another is recomputed (the scheduler puts it
back at the head of the waiting queue).
"""

from dataclasses import dataclass

import torch

from paged.core.block_manager import BlockManagerState
from paged.core.scheduler import SchedulerState
from paged.core.sequence import Request, RequestState
from paged.lora import LoRAState
from paged.offload import PrefixTierState, SwapSpaceState
from paged.speculative import SpeculatorState


@dataclass(frozen=True)
class EngineState:
    """Everything a step may change, as it found it: the engine's own state and each participant's record."""

    requests: dict[str, Request]
    request_states: tuple[tuple[Request, RequestState], ...]  # the requests whose sequences the step may change
    num_steps: int
    last_schedule: object
    generator_state: torch.Tensor
    scheduler: SchedulerState
    block_manager: BlockManagerState
    swap_space: SwapSpaceState | None
    prefix_tier: PrefixTierState | None
    speculator: SpeculatorState | None
    kv_connector: object
    lora: LoRAState | None


class StepJournal:
    """The undo log of one engine step: begin() before it, then commit() if it returned or rollback() if it
    raised."""

    def __init__(self, engine):
        self.engine = engine
        self._record: EngineState | None = None

    def begin(self) -> None:
        """Snapshot every participant; the block manager and the tiers log their changes from now on."""
        engine = self.engine
        engine.model_runner.kv_written = False
        touched = {seq.request.request_id: seq.request for seq in engine.scheduler.may_change()}
        self._record = EngineState(
            requests=dict(engine.requests),
            request_states=tuple((request, request.checkpoint()) for request in touched.values()),
            num_steps=engine.num_steps,
            last_schedule=engine.last_schedule,
            generator_state=engine.generator.get_state(),
            scheduler=engine.scheduler.checkpoint(),
            block_manager=engine.block_manager.checkpoint(),
            swap_space=None if engine.swap_space is None else engine.swap_space.checkpoint(),
            prefix_tier=None if engine.prefix_tier is None else engine.prefix_tier.checkpoint(),
            speculator=None if engine.speculator is None else engine.speculator.checkpoint(),
            kv_connector=engine.kv_connector.checkpoint(),
            lora=None if engine.lora is None else engine.lora.checkpoint(),
        )

    def commit(self) -> None:
        """The step stands: close the logs and drop the record."""
        engine = self.engine
        for part in (engine.block_manager, engine.swap_space, engine.prefix_tier, engine.speculator):
            if part is not None:
                part.stop_logging()
        self._record = None

    def rollback(self) -> None:
        """Put every participant back as begin found it, and drop the record. Sequences whose K/V the step
        overwrote (blocks or tier slots it gave to another) go back to be recomputed."""
        engine, record, self._record = self.engine, self._record, None
        written = engine.model_runner.kv_written
        engine.requests, engine.num_steps, engine.last_schedule = (
            dict(record.requests),
            record.num_steps,
            record.last_schedule,
        )
        for request, state in record.request_states:
            request.restore(state)
        lost = set(engine.block_manager.restore(record.block_manager, written))
        if engine.swap_space is not None:
            lost.update(engine.swap_space.restore(record.swap_space, written))
        if engine.prefix_tier is not None:
            engine.prefix_tier.restore(record.prefix_tier, written)
        if engine.speculator is not None:
            engine.speculator.restore(record.speculator)
        engine.kv_connector.restore(record.kv_connector)
        engine.scheduler.restore(record.scheduler, lost)
        engine.generator.set_state(record.generator_state)
        if engine.lora is not None:
            engine.lora.restore(record.lora)
