"""The model (guide §2, §5, §7): the Llama-family forward pass over the paged KV cache, its attention backends,
the architectures it knows, and the loader that finds and reads weights.
"""
