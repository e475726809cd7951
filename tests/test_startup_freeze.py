"""The server's start-up objects are out of the cyclic garbage collector's scans while the
extension runs (``freeze_startup_objects``, on by default; the other in-process tests turn it
off), and back in them once it stops."""

from __future__ import annotations

import gc
import weakref

import pytest


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _start(jp_serverapp, jp_asyncio_loop):
    """The extension started as the ``evalsched`` fixture does; its app."""
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    return jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app


@pytest.mark.parametrize("evalsched_config", [{"freeze_startup_objects": True}])
def test_the_startup_objects_are_frozen_while_the_extension_runs_and_thawed_when_it_stops(
    jp_serverapp, jp_asyncio_loop
):
    assert gc.get_freeze_count() == 0, "something in this process froze objects already"
    # Garbage in the oldest generation when the server starts: collected before the freeze, not
    # kept for good (a collection of the young generations alone would leave it to the freeze).
    old = _Cycle()
    gone = weakref.ref(old)
    gc.collect()  # (it survives this one, so that it sits in the oldest generation)
    del old
    app = _start(jp_serverapp, jp_asyncio_loop)
    assert gone() is None
    frozen = gc.get_freeze_count()
    # The server's own objects at least: its modules, classes and settings.
    assert frozen > 50_000
    assert app.scheduler.status_view().runs_dir
    # What comes after the start is collected as ever: a cycle made now goes at the next collection.
    gc.collect()
    _Cycle()
    assert gc.collect() >= 1
    assert gc.get_freeze_count() > frozen // 2  # (frozen objects still go as their references do)

    jp_asyncio_loop.run_until_complete(app.stop_extension())
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("evalsched_config", [{"freeze_startup_objects": False}])
def test_nothing_is_frozen_when_the_setting_is_off(jp_serverapp, jp_asyncio_loop):
    before = gc.get_freeze_count()
    app = _start(jp_serverapp, jp_asyncio_loop)
    assert app.scheduler.status_view().runs_dir
    assert gc.get_freeze_count() == before


@pytest.mark.parametrize("evalsched_config", [{"freeze_startup_objects": True}])
def test_a_freeze_made_by_someone_else_is_left_as_it_is(jp_serverapp, jp_asyncio_loop):
    """The process froze objects before the extension started (its own tuning): the extension
    neither freezes more nor thaws them when it stops."""
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        app = _start(jp_serverapp, jp_asyncio_loop)
        assert before - 1000 < gc.get_freeze_count() <= before
        jp_asyncio_loop.run_until_complete(app.stop_extension())
        assert before - 1000 < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("evalsched_config", [{"freeze_startup_objects": True}])
def test_the_scheduler_a_failed_takeover_drops_is_freed_though_made_before_the_freeze(
    jp_serverapp, jp_asyncio_loop, monkeypatch
):
    """A takeover that fails drops its scheduler for a fresh one. The one made at the first,
    failed, start was frozen with the rest; the next failed try thaws, collects and freezes
    again, so that it is not kept for good (a scheduler's parts refer to each other)."""
    from jupyter_evalsched.scheduler.service import Scheduler

    async def broken(*args):
        del args  # (the logged traceback keeps this frame: not the scheduler with it)
        raise RuntimeError("a start that fails")

    monkeypatch.setattr(Scheduler, "start", broken)
    app = _start(jp_serverapp, jp_asyncio_loop)
    assert app.start_error and "a start that fails" in app.start_error
    assert gc.get_freeze_count() > 50_000
    frozen_scheduler = weakref.ref(app.scheduler)  # made by the step-down, before the freeze
    jp_asyncio_loop.run_until_complete(app._take_over_if_free())
    assert app.start_error and "a start that fails" in app.start_error
    assert frozen_scheduler() is None
    assert gc.get_freeze_count() > 50_000
