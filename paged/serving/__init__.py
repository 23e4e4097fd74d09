"""The OpenAI-compatible server (guide §13): request models, routes, and the token budget its steps run under.
"""
