"""Tensor parallelism (guide §1, §8, §15): one model split across N ranks, Megatron-style, over torch.distributed.

A model too big for one device is cut so that every rank holds 1/N of every layer and does 1/N of its work:

    q, k, v, gate, up   column-parallel: rank r holds its own query heads (and their KV heads), its own slice of
                        the MLP's intermediate features; it computes them without talking to anyone
    o, down             row-parallel: rank r multiplies its heads' (its features') part of the input by its columns,
                        which gives a partial sum of the whole hidden vector; one all-reduce adds the N partial sums
    embedding, LM head  vocabulary-parallel: rank r holds the rows of its slice of the vocabulary; a lookup gives
                        zeros for the other tokens (one all-reduce), and each rank's logits are gathered on rank 0

So a layer costs two all-reduces of [num_tokens, hidden], and each rank's KV pool holds only the K and V of its own
KV heads: num_kv_heads / N of them. Where N is larger than num_kv_heads, each KV head is copied on N / num_kv_heads
ranks (as vLLM does), so the pool per rank stops shrinking. The block tables are the same on every rank: one
scheduler, on rank 0, decides them for all.

The attention kernels need no change: they read whatever number of heads the pool holds, and the q heads of a
rank map onto its KV heads by the same ratio as in the whole model. RMSNorm, RoPE and the per-head q/k norms work
on whole hidden vectors or whole heads, which every rank has: they are copied, not split.
"""

import datetime
import pickle
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from paged.model.architectures import head_dim

# A rank waiting for the next step may wait as long as the engine is idle; a rank that dies closes its connections,
# which its peers see at once, so this limit only ends a wait that nothing will ever answer.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds, as ranges of the whole model's indices."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # the vocabulary rows this rank holds (the last rank's may run short)
    vocab_per_rank: int  # every rank's slice padded to this many rows, so the logits gather in equal parts
    vocab_size: int  # the whole vocabulary


def check_tensor_parallel(config, size: int, argument: str = "tensor_parallel_size") -> None:
    """A ValueError naming `argument` unless `size` ranks can split the model as vLLM splits it: the query heads and
    the MLP's features evenly, the KV heads evenly or, where there are fewer KV heads than ranks, each on an equal
    number of ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{argument} must be a positive integer, got {size!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"{argument} ({size}) must divide the model's {heads} query heads")
    if kv_heads % size if size <= kv_heads else size % kv_heads:
        raise ValueError(
            f"{argument} ({size}) and the model's {kv_heads} KV heads: one must divide the other, so "
            f"that every rank holds the same number of KV heads"
        )
    if config.intermediate_size % size:
        raise ValueError(f"{argument} ({size}) must divide the model's intermediate_size ({config.intermediate_size})")


def plan_shard(config, vocab_size: int, rank: int, size: int) -> Shard:
    """The ranges rank `rank` of `size` holds (check_tensor_parallel first)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    q_per_rank = heads // size
    if size <= kv_heads:
        kv_per_rank = kv_heads // size
        kv = range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    else:  # fewer KV heads than ranks: the one KV head this rank's query heads read, copied here
        first = rank * q_per_rank // (heads // kv_heads)
        kv = range(first, first + 1)
    inter = config.intermediate_size // size
    vocab_per_rank = -(-vocab_size // size)
    return Shard(
        rank,
        size,
        range(rank * q_per_rank, (rank + 1) * q_per_rank),
        kv,
        range(rank * inter, (rank + 1) * inter),
        range(min(rank * vocab_per_rank, vocab_size), min((rank + 1) * vocab_per_rank, vocab_size)),
        vocab_per_rank,
        vocab_size,
    )


def shard_weights(weights, config, shard: Shard):
    """This rank's part of a ModelWeights (model/llama.py's layout), as tensors of its own (the whole model's can go)."""
    dim = head_dim(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    q_rows = torch.arange(shard.q_heads.start * dim, shard.q_heads.stop * dim)
    k_rows = heads * dim + torch.arange(shard.kv_heads.start * dim, shard.kv_heads.stop * dim)
    qkv_rows = torch.cat([q_rows, k_rows, k_rows + kv_heads * dim])
    inter = config.intermediate_size
    gate_up_rows = torch.cat(
        [
            torch.arange(shard.intermediate.start, shard.intermediate.stop),
            inter + torch.arange(shard.intermediate.start, shard.intermediate.stop),
        ]
    )

    def rows(tensor, index):  # column-parallel: the output features this rank computes
        return None if tensor is None else tensor.index_select(0, index.to(tensor.device))

    def columns(tensor, index):  # row-parallel: the input features this rank holds
        return tensor.index_select(1, index.to(tensor.device))

    def vocab_rows(table):  # [vocab_per_rank, hidden], zero rows past the vocabulary
        part = table.new_zeros(shard.vocab_per_rank, table.shape[1])
        part[: len(shard.vocab)] = table[shard.vocab.start : shard.vocab.stop]
        return part

    layers = [
        replace(
            layer,
            qkv=rows(layer.qkv, qkv_rows),
            qkv_bias=rows(layer.qkv_bias, qkv_rows),
            o=columns(layer.o, q_rows),
            gate_up=rows(layer.gate_up, gate_up_rows),
            down=columns(layer.down, gate_up_rows[: len(shard.intermediate)]),
            input_norm=layer.input_norm.clone(),
            post_norm=layer.post_norm.clone(),
        )
        for layer in weights.layers
    ]
    embed = vocab_rows(weights.embed_tokens)
    head = embed if weights.lm_head is weights.embed_tokens else vocab_rows(weights.lm_head)
    return replace(weights, embed_tokens=embed, lm_head=head, final_norm=weights.final_norm.clone(), layers=layers)


class TensorParallelGroup:
    """One rank's view of the N ranks: the collectives the forward pass needs (all_reduce, gather_logits) and the
    messages rank 0 sends every rank (broadcast_object / receive_object). On a CPU both go over one gloo group; on
    CUDA the tensors of the forward pass go over NCCL and the messages over gloo, as vLLM keeps a cpu_group beside
    its device_group."""

    def __init__(self, rank: int, size: int, store, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        self.shard: Shard | None = None  # set when the model is loaded (plan_shard)
        self.cpu_group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        self.device_group = self.cpu_group if device.type == "cpu" else dist.ProcessGroupNCCL(store, rank, size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor summed over the ranks, in place."""
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """input_ids [num_tokens] -> [num_tokens, hidden]: this rank's rows, zeros for tokens it does not hold,
        summed over the ranks (exactly the whole table's lookup: every other addend is zero)."""
        start, stop = self.shard.vocab.start, self.shard.vocab.stop
        mine = (input_ids >= start) & (input_ids < stop)
        hidden = torch.nn.functional.embedding((input_ids - start) * mine, table)
        return self.all_reduce(hidden.mul_(mine[:, None]))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, vocab_per_rank] of this rank's slice -> [rows, vocab_size], put together on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.device_group.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=1)[:, : self.shard.vocab_size]

    def broadcast_object(self, obj) -> None:
        """Rank 0 sends `obj` (pickled; tensors on the CPU) to every other rank."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.cpu_group.broadcast(torch.tensor([payload.numel()]), 0).wait()
        self.cpu_group.broadcast(payload, 0).wait()

    def receive_object(self):
        """What rank 0's broadcast_object sent."""
        length = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.broadcast(length, 0).wait()
        payload = torch.empty(int(length), dtype=torch.uint8)
        self.cpu_group.broadcast(payload, 0).wait()
        return pickle.loads(payload.numpy().tobytes())

    def send_to_driver(self, obj) -> None:
        """A rank's answer to rank 0 (collective_rpc)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.cpu_group.send([torch.tensor([payload.numel()])], 0, 0).wait()
        self.cpu_group.send([payload], 0, 1).wait()

    def receive_from(self, rank: int):
        length = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.recv([length], rank, 0).wait()
        payload = torch.empty(int(length), dtype=torch.uint8)
        self.cpu_group.recv([payload], rank, 1).wait()
        return pickle.loads(payload.numpy().tobytes())
