"""Stages: the shared run loop and worker process scaffolding, and the stage logic on top of ``transport``.

``scoring`` (teacher stage logic) and ``batching`` / ``kl_control`` (feeder logic) test without Redis;
``teacher_stage`` and ``feeder`` wire them to streams through ``runloop``.
"""
