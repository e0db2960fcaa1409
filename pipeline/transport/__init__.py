"""Transport: Redis connections, the key names, producers, consumer groups, claim checks, shards, prompts.

Knows the wire format (``schemas``) and Redis, nothing of what a stage does with an entry.
"""
