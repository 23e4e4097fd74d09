"""The chapters' calculators (guide §1-§18): traces, fragmentation, sharing, cost models, the guide's figures,
the replay driver and the load client. The engine never imports them.
"""
