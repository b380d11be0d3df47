"""``start_eagerly``: a coroutine runs in its caller up to its first wait, and a task carries
the rest exactly as a task started from the beginning would."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.service.rpc.eager import start_eagerly


def test_a_coroutine_that_never_waits_finishes_in_its_caller():
    ran = []

    async def answer_now():
        ran.append("ran")

    async def main():
        task = start_eagerly(answer_now())
        assert ran == ["ran"]  # before the loop had a turn
        return task

    assert asyncio.run(main()) is None


def test_a_coroutine_that_waits_runs_its_start_at_once_and_the_rest_in_a_task():
    steps = []

    async def in_two_parts(gate: asyncio.Future):
        steps.append("before")
        value = await gate
        steps.append(f"after {value}")
        await asyncio.sleep(0)
        return value * 2

    async def main():
        gate = asyncio.get_running_loop().create_future()
        task = start_eagerly(in_two_parts(gate))
        assert steps == ["before"]
        gate.set_result(21)
        assert await task == 42
        return steps

    assert asyncio.run(main()) == ["before", "after 21"]


def test_a_waiting_coroutine_sees_its_tasks_cancellation_and_errors_reach_the_task():
    seen = []

    async def waits_forever():
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def fails_after_a_wait():
        await asyncio.sleep(0)
        raise ValueError("late")

    async def main():
        waiting = start_eagerly(waits_forever())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(ValueError, match="late"):
            await start_eagerly(fails_after_a_wait())

    asyncio.run(main())
    assert seen == ["cancelled"]


def test_a_waiting_coroutine_gets_the_exception_of_what_it_awaits():
    async def catches():
        try:
            await asyncio.get_running_loop().run_in_executor(None, _raise)
        except KeyError as exc:
            return f"caught {exc.args[0]}"

    async def main():
        return await start_eagerly(catches())

    assert asyncio.run(main()) == "caught lost"


def _raise() -> None:
    raise KeyError("lost")
