"""Small helpers the tests share: a tiny random Llama, random prompts, the empty-pool check, a player's frames."""

from collections import Counter

import torch
from ipywidgets.widgets.widget import _instances as live_widgets
from ipywidgets.widgets.widget_link import Link
from transformers import LlamaConfig, LlamaForCausalLM

from paged import LLM


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random Llama small enough to run hundreds of engine steps in a second (GQA 2:1)."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    tie_word_embeddings=True, eos_token_id=255, bos_token_id=0,
                    initializer_range=0.3)  # wide weights: peaked logits, so sampling follows the model
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def make_tiny_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 8)
    return LLM(model=model, device="cpu", dtype=torch.float32, **kwargs)


def random_prompts(count: int, seed: int = 0, low: int = 1, high: int = 60) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(1, 250, (n,), generator=generator).tolist() for n in lengths]


def assert_ref_counts_exact(manager) -> None:
    """Each block's ref count is the number of block tables holding it, and a block is in the free queue, once,
    exactly when nobody holds it."""
    holders = Counter(b for table in manager.block_tables.values() for b in table)
    free_ids = [block.block_id for block in manager.free_queue]
    assert len(free_ids) == len(set(free_ids)) == manager.num_free_blocks
    free = set(free_ids)
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id]          # exact ref counts
        assert (block.block_id in free) == (block.ref_count == 0)   # free iff nobody holds it


def assert_pool_empty(llm: LLM) -> None:
    """Every block is back in the free queue and nobody holds a table."""
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.block_tables == {}
    assert all(block.ref_count == 0 for block in manager.blocks)


def run_engine(engine, prompts, params) -> list[list[int]]:
    """Add every prompt at once and step the engine until all finish; token ids come back in prompt order."""
    ids = [engine.add_request(engine.make_request(p, params)) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[i] for i in ids]


def player_frames(player) -> list[str]:
    """The HTML of every frame of a paged.viz player, in order, after checking that its Play button and slider span
    the frames and that the browser links them to the frame on show (jslink: no kernel needed to move them)."""
    (play, slider), view = player.children[0].children, player.children[1]
    frames = [child.value for child in view.children]
    assert (play.max, slider.max) == (len(frames) - 1, len(frames) - 1)
    assert slider.value == play.value == view.selected_index
    links = {(link.source, link.target) for link in live_widgets.values() if isinstance(link, Link)}
    assert ((play, "value"), (slider, "value")) in links and ((slider, "value"), (view, "selected_index")) in links
    return frames
