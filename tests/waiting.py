"""Waiting for a condition, the one way the tests synchronise with servers, runs and threads.

Poll the condition; never sleep for a fixed time and hope. ``wait_until`` returns the predicate's
first truthy value, so a test can wait for and fetch a thing in one call. Exceptions raised by
the predicate propagate unless ``ignore`` names them (a server that is restarting, say).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _failure(message: str, timeout: float, last: Any) -> AssertionError:
    text = message or "condition not met"
    return AssertionError(f"{text} within {timeout:g} s (last value: {last!r:.300})")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 20.0,
    interval: float = 0.02,
    message: str = "",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something truthy; return that. AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise _failure(message, timeout, last)
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 20.0,
    interval: float = 0.02,
    message: str = "",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """``wait_until`` for tests that share the event loop with the server: the predicate may be
    a coroutine function, and the wait yields to the loop between tries."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
            if inspect.isawaitable(last):
                last = await last
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise _failure(message, timeout, last)
        await asyncio.sleep(interval)


def reached_state(rec: dict, states) -> bool:
    """The record is in one of ``states``; ``running`` counts once its process is there (a warm
    start's pid comes a moment after admission, as a run waiting for its model host has none)."""
    if rec["state"] not in states:
        return False
    return rec["state"] != "running" or rec.get("pid") is not None or bool(rec.get("models"))


def loop_ticker(every_s: float = 0.01) -> tuple[list[float], asyncio.Future[None]]:
    """A task on the running loop that notes the time every ``every_s``: the times it noted
    (while the loop turned) and the task (cancel it when done)."""
    ticks: list[float] = []

    async def ticking() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(every_s)

    return ticks, asyncio.ensure_future(ticking())
