"""Model files: loading causal LMs, weight files, and the tiny models for demos and tests.

Tiny models are built, pretrained and evaluated here; nothing in this package talks to Redis.
"""
