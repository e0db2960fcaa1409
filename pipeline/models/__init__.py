"""Model files: loading causal LMs (``weights``), published weight folders, depth pruning (``prune``), held-out
evaluation (``evaluation``) and the key/value cache names (``kvcache``). Nothing in this package talks to Redis.
"""
