"""The engine (guide §11, §13, §17): LLM (llm.py) and LLMEngine (llm_engine.py), the model runner, the output
processor, the KV pool, the sampler, and the async and multi-process wrappers a server runs on.
"""
