"""Starting a coroutine at once, in the caller, and making a task only of what must wait.

Most slot operations never wait: the host tier's memory answers them on the event loop. A task
per operation would still cost one more turn of the loop before it runs, and another for
whoever waits on it, which on 2 cores is a good part of a slot operation's round trip. Python
3.12's ``asyncio.eager_task_factory`` does this for every task of a loop; kvtier runs on 3.10
too, and only the operations want it.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator


def start_eagerly(coro: Coroutine) -> asyncio.Task | None:
    """Runs ``coro`` up to its first wait; None if it finished there (its result, or its
    exception, is its own to handle: use this for coroutines that catch what they raise),
    else the task that runs the rest."""
    try:
        awaited = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_rest(coro, awaited))


async def _rest(coro: Coroutine, awaited) -> object:
    return await _continue(coro, awaited)


@types.coroutine
def _continue(coro: Coroutine, awaited) -> Generator:
    """Hands what ``coro`` waits on to the task running this, and the task's answers (a value
    or a thrown exception, such as its cancellation) back to ``coro``, until it returns."""
    while True:
        try:
            sent = yield awaited
        except BaseException as exc:  # the task's to deliver, its cancellation too
            step = coro.throw
            arg = exc
        else:
            step = coro.send
            arg = sent
        try:
            awaited = step(arg)
        except StopIteration as done:
            return done.value
