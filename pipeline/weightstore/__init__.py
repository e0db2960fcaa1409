"""Weights without a shared filesystem: versions in Redis or object storage, as chunked deltas
(docs/weights.md). ``codec`` (bytes), ``manifest``, ``stores`` (Redis, fsspec), ``writer`` (a learner's uploads),
``mirror`` (a reader's local folder), ``location`` (a folder or a URL, wherever a weights location is taken)."""
