"""Student inference backends: ``base`` (the protocol, ``Completion``, ``GenParams``), ``hf`` (a local
transformers model) and ``vllm`` (a vLLM server over HTTP).

``hf`` and ``vllm`` are not imported here (``torch`` / ``httpx`` stay optional at import time): import
``pipeline.rollout.students.hf`` or ``pipeline.rollout.students.vllm`` directly.
"""
