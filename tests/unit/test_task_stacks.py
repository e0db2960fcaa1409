"""SIGUSR1's task dump: the await chain reaches the call that actually waits."""

from __future__ import annotations

import asyncio

from pipeline.stages.worker_main import await_chain


async def test_await_chain_follows_a_suspended_task_to_its_innermost_wait() -> None:
    gate = asyncio.Event()

    async def inner() -> None:
        await gate.wait()

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer())
    await asyncio.sleep(0)  # let it start and suspend
    chain = await_chain(task.get_coro())
    names = [entry.split()[-1] for entry in chain]
    assert names[:3] == ["outer", "inner", "wait"], chain
    assert chain[0].startswith("test_task_stacks.py:")
    gate.set()
    await task
    assert await_chain(task.get_coro()) == []  # finished: nothing waits
