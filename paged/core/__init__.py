"""The engine's bookkeeping (guide §5, §6, §10-§12): requests and sequences, the block pool and its tables, the scheduler.

No tensors of the model live here: these modules decide which tokens run and where their K/V go; the
engine carries the decision out.
"""
