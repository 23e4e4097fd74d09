"""The physical KV pool (guide §6): for every layer, one K and one V tensor of shape
[num_blocks, block_size, num_kv_heads, head_dim] (NHD layout), allocated once when the engine starts.

Block i of every layer's pool belongs to whichever sequence's block table holds i; `core/block_manager.py` decides that.
The pool is zero-filled so that a slot never written holds a finite number (masked attention multiplies it by 0).
"""

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)  # [K/V, layer, block, slot, head, dim]

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.storage[0, layer]  # [num_blocks, block_size, num_kv_heads, head_dim]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.storage[1, layer]  # [num_blocks, block_size, num_kv_heads, head_dim]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer's K and V (copy-on-write, guide §10)."""
        if src:
            self.storage[:, :, dst] = self.storage[:, :, src]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
