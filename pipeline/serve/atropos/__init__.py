"""The Atropos-compatible API server (``distillq serve atropos``).

``app`` (the FastAPI app and its middleware), ``routes`` (the API, as atroposlib's server answers it),
``bodies`` (request bodies), ``startup`` (settings, what the routes share, start-up), ``state`` (registration,
envs, buffers in Redis), ``ingest`` (posted groups onto ``rollouts``), ``queue`` with ``queue_scripts`` (scored
groups into batches, with leases), ``packing`` (batch arithmetic), ``lock`` (the writers' lock shared by replicas).
"""
