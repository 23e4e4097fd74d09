"""The OpenAI-compatible server (guide §13): its requests and responses (protocol.py), its routes (api_server.py),
the engine core process (engine_core.py) and the token budget its steps run under (token_budget.py).
"""
