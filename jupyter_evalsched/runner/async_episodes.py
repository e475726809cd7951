"""``async def episode``: each coroutine an episode returns runs on one event loop per process.

One loop for the whole run (not ``asyncio.run`` per episode), so that what an eval keeps between
episodes (an ``openai.AsyncOpenAI``, an ``aiohttp`` session: bound to the loop they were first
used on) keeps working. ``asyncio`` is imported by the first coroutine only: a plain ``def
episode`` never pays for it. Imported once the eval is loaded, not at the runner's start-up.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from asyncio import Runner

    from .context import EpisodeContext, EpisodeFunction


async def _probe() -> None:
    pass


def _coroutine_type() -> type:
    # types.CoroutineType without importing types.
    coroutine = _probe()
    coroutine.close()
    return type(coroutine)


CoroutineType = _coroutine_type()
_runner: Runner | None = None


def episode_caller(episode: EpisodeFunction) -> EpisodeFunction:
    """``episode``, whose coroutines (an ``async def``'s, or any a plain function returns) are run
    to completion on this process's event loop: what they return is the episode's result."""

    def call(ctx: EpisodeContext, index: int) -> object:
        result = episode(ctx, index)
        if type(result) is CoroutineType:
            return event_loop_runner().run(result)  # type: ignore[arg-type]
        return result

    return call


def event_loop_runner() -> Runner:
    """This process's ``asyncio.Runner``, made on first use and closed at exit (its pending tasks
    cancelled, its async generators finalized, as ``asyncio.run`` does)."""
    global _runner
    if _runner is None:
        import asyncio
        import atexit

        _runner = asyncio.Runner()
        atexit.register(_runner.close)
    return _runner
