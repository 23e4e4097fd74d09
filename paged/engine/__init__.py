"""The engine (guide §11, §13, §17): LLM and LLMEngine, the model runner, the KV pool, the sampler, and the
async and multi-process wrappers a server runs on.
"""
