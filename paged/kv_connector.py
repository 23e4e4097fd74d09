"""The KV connector (guide §15, §17): the seam through which K/V leave an engine for another one or arrive from one,
after vLLM V1's `KVConnectorBase_V1` (vllm/distributed/kv_transfer/kv_connector/v1/base.py), under its names.

A connector has two halves, each called at fixed points of an engine step:

  the scheduler half, from Scheduler.schedule() and Scheduler.finish()
    get_num_new_matched_tokens(request, num_computed_tokens)   prompt tokens past the local prefix-cache hit whose
                                                                K/V it can load instead of the step computing them
    update_state_after_alloc(request, block_ids, num_external_tokens)   the blocks the scheduler allocated for them
    build_connector_meta()                                      the step's loads, handed to the worker half
    request_finished(request, block_ids)                        True: keep the blocks until they are saved
  the worker half, from LLMEngine.step() around the forward pass
    start_load_kv(kv_cache, metadata)   before the forward pass: the loaded tokens' blocks copied into the pool
    wait_for_save(kv_cache)             after the step: the blocks request_finished kept, saved
    get_finished()                      the requests saved since the last call; the scheduler frees their blocks

Disaggregated prefill and decode (`disagg.py`) puts one connector at each end, V1's kv_role "kv_producer" and
"kv_consumer":
  KVProducer, on the prefill engine: a request marked for decoding elsewhere (kv_transfer_params
    {"do_remote_decode": True}) that finishes after its first token keeps its blocks; at the end of that step they
    are copied out, every layer's K and V of the prompt's blocks as one tensor, and freed. The caller sends them.
  KVConsumer, on the decode engine: K/V received for a request wait until the scheduler admits it; then they fill
    the blocks allocated past its prefix-cache hit. The prompt's last token is computed again there, as V1's decode
    side does, since its logits give the first output token.
A request handed over is admitted like any other: the token budget, the seats, the pool, the prefix cache (the
loaded blocks enter it, so a later prompt with the same prefix loads fewer) and the LoRA slots treat it alike, and
it can be preempted (it is then recomputed locally).

What V1 has and this engine does without: V1 runs the scheduler half in the engine core and a worker half in each
GPU worker and passes the metadata between them; here both live in one object. Its loads may run while other
requests are scheduled, and its saves layer by layer as the forward pass computes them (wait_for_layer_load,
save_kv_layer); here both are whole-step copies.
"""

from dataclasses import dataclass, field

import torch

from paged.geometry import cdiv


@dataclass
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step."""

    # (request_id, pool block ids, i): the received blocks i, i + 1, ... go into those pool blocks, in order
    loads: list[tuple[str, list[int], int]] = field(default_factory=list)


class KVConnector:
    """A connector that moves nothing: every call is a no-op. KVProducer and KVConsumer override their part."""

    # ---- the scheduler half ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens of request's prompt past its num_computed_tokens (the local cache hit) that can be loaded.
        Asked while the request waits for admission, maybe more than once: it changes nothing."""
        return 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted with block_ids as its table; its num_external_tokens are to be loaded."""

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The loads of the step being scheduled, for start_load_kv; resets them."""
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """One of request's sequences finished, holding block_ids: whether the scheduler must keep those blocks
        until get_finished names the request. (V1's also returns what the other side needs to fetch them.)"""
        return False

    # ---- the worker half -------------------------------------------------------------------------------------

    def start_load_kv(self, kv_cache, metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: copy the K/V metadata names into the pool."""

    def wait_for_save(self, kv_cache) -> None:
        """After the step: save the blocks request_finished asked the scheduler to keep."""

    def get_finished(self) -> set[str]:
        """The requests whose kept blocks were saved since the last call: the scheduler may free them."""
        return set()

    # ---- an engine step is a transaction (engine/journal.py) ------------------------------------------------

    def checkpoint(self) -> object:
        """The connector's queues as an engine step found them, for restore; this one keeps none."""
        return None

    def restore(self, record: object) -> None:
        """Put the queues back as checkpoint found them."""


@dataclass
class SavedKV:
    """A finished prefill's K/V, ready to send: the request and its prompt's blocks."""

    request: object
    kv: torch.Tensor  # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class ProducerState:
    """A KVProducer's queues as an engine step found them."""

    to_save: list[tuple[object, list[int]]]
    saved: list[SavedKV]
    finished_saving: set[str]


class KVProducer(KVConnector):
    """The prefill side: keeps the blocks of a request handed over to a decode engine until they are copied out,
    at the end of the step that sampled its first token; take_saved() gives the copies to whoever sends them."""

    def __init__(self):
        self.to_save: list[tuple[object, list[int]]] = []  # (request, its prompt's blocks), kept by the scheduler
        self.saved: list[SavedKV] = []  # copied out, not yet taken
        self.finished_saving: set[str] = set()

    def request_finished(self, request, block_ids):
        """Keep the prompt's blocks of a request marked do_remote_decode whose first token did not end it."""
        params = request.kv_transfer_params or {}
        seq = request.seqs[0]
        if not params.get("do_remote_decode") or seq.finish_reason != "length" or request.params.n != 1:
            return False
        self.to_save.append((request, list(block_ids)))
        return True

    def wait_for_save(self, kv_cache):
        for request, block_ids in self.to_save:
            num_blocks = cdiv(len(request.prompt_token_ids), kv_cache.block_size)
            self.saved.append(SavedKV(request, kv_cache.storage[:, :, block_ids[:num_blocks]]))  # a copy
            self.finished_saving.add(request.request_id)
        self.to_save = []

    def get_finished(self):
        done, self.finished_saving = self.finished_saving, set()
        return done

    def take_saved(self) -> list[SavedKV]:
        """The K/V saved so far, oldest first; they leave the connector."""
        saved, self.saved = self.saved, []
        return saved

    def checkpoint(self) -> "ProducerState":
        return ProducerState(list(self.to_save), list(self.saved), set(self.finished_saving))

    def restore(self, record: "ProducerState") -> None:
        self.to_save, self.saved = list(record.to_save), list(record.saved)
        self.finished_saving = set(record.finished_saving)


@dataclass(frozen=True)
class ConsumerState:
    """A KVConsumer's received K/V and pending loads as an engine step found them."""

    received: dict[str, torch.Tensor]
    to_load: list[tuple[str, list[int], int]]


class KVConsumer(KVConnector):
    """The decode side: K/V received for a request wait here until the scheduler admits it, then fill its blocks."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}  # request_id -> [2, layers, blocks, block_size, heads, dim]
        self.to_load: list[tuple[str, list[int], int]] = []

    def receive(self, request_id: str, kv: torch.Tensor) -> None:
        """K/V computed elsewhere for the prompt of request_id, whole blocks from its first on; add the request
        to the engine after this."""
        self.received[request_id] = kv

    def _matched_end(self, request) -> int:
        """The tokens the received K/V serve: the whole prompt but its last token, computed here for its logits."""
        kv = self.received[request.request_id]
        return min(kv.shape[2] * kv.shape[3], len(request.prompt_token_ids) - 1)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id not in self.received:
            return 0  # nothing received, or loaded already (a preempted request is recomputed locally)
        return max(0, self._matched_end(request) - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens == 0:
            return
        block_size = self.received[request.request_id].shape[3]
        end = self._matched_end(request)
        first = (end - num_external_tokens) // block_size  # the local hit ends on a block boundary
        self.to_load.append((request.request_id, list(block_ids[first : cdiv(end, block_size)]), first))

    def build_connector_meta(self):
        metadata, self.to_load = KVConnectorMetadata(loads=self.to_load), []
        return metadata

    def request_finished(self, request, block_ids):
        self.received.pop(request.request_id, None)  # finished or aborted before it was admitted
        return False

    def start_load_kv(self, kv_cache, metadata):
        for request_id, block_ids, first in metadata.loads:
            kv = self.received.pop(request_id)
            kv_cache.storage[:, :, block_ids] = kv[:, :, first : first + len(block_ids)].to(kv_cache.storage.device)

    def checkpoint(self) -> "ConsumerState":
        return ConsumerState(dict(self.received), list(self.to_load))

    def restore(self, record: "ConsumerState") -> None:
        self.received, self.to_load = dict(record.received), list(record.to_load)
