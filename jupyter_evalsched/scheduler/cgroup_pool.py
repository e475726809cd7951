"""Run cgroups made ahead and removed afterwards, off the path that starts a run.

Making a cgroup (a ``mkdir`` per hierarchy) and removing one (killing what is left, reclaiming
the memory still charged to it, ``rmdir``) are kernel work under the cgroup lock: done between
a run's admission and its first instruction, they made every start wait for them. Here both
happen in one background thread (one at a time: they contend for the same kernel lock anyway):

- ``take()`` hands out a cgroup made ahead (for a cold start; a warm start's process places
  itself in one while it waits: ``runner/zygote.py``), and the pool is refilled behind it;
- ``discard(cgroup)`` removes a cgroup whose run (or spare) has ended; one that would not go yet
  is tried again at each later removal and at ``close()``.

``close()`` (at shutdown) removes the unused ones and waits for the removals under way.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .cgroupfs import CgroupError
from .cgroups import Cgroups, RunCgroup, remove_each

log = logging.getLogger(__name__)

# Cgroups kept ready for cold starts: a start takes one and the thread makes the next in about a
# millisecond, so a few cover a burst (a start that finds none makes its own, on the spot).
POOL_SIZE = 4


class CgroupPool:
    def __init__(self, cgroups: Cgroups, size: int = POOL_SIZE) -> None:
        self.cgroups = cgroups
        self.size = size
        self._ready: collections.deque[RunCgroup] = collections.deque()
        self._lock = threading.Lock()
        self._refilling = False
        self._closed = False
        # Discarded cgroups that would not go yet (a process in one slow to die): tried again at
        # each later removal and at close, not left behind. Touched by the janitor thread only
        # (and by close() once it has ended).
        self.lingering: list[RunCgroup] = []
        self.janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evalsched-cgroups")

    def start(self) -> None:
        self._refill_later()

    def take(self) -> RunCgroup:
        """A fresh cgroup (no run, no limit yet: ``RunCgroup.assign``). CgroupError when none can
        be made."""
        try:
            cgroup = self._ready.popleft()
        except IndexError:
            cgroup = None
        self._refill_later()
        if cgroup is None:  # a burst emptied the pool: made here, which costs this start a little
            cgroup = self.cgroups.make()
        return cgroup

    def discard(self, cgroup: RunCgroup | None) -> Future[bool] | None:
        """Kill what is left in ``cgroup`` and remove it, in the background thread."""
        if cgroup is None:
            return None
        try:
            return self.janitor.submit(self._remove, cgroup)
        except RuntimeError:  # closed: shutdown removes it on the spot
            cgroup.remove()
            return None

    def _remove(self, cgroup: RunCgroup) -> bool:
        """In the janitor thread: ``cgroup`` removed, and those that would not go before tried
        again. True when ``cgroup`` is gone."""
        self.lingering[:] = remove_each(self.lingering)
        if cgroup.remove():
            return True
        self.lingering.append(cgroup)
        return False

    def linger(self, cgroups: list[RunCgroup]) -> None:
        """Cgroups whose removal gave up elsewhere (recovery's): tried again with the pool's own."""
        if cgroups:
            try:
                self.janitor.submit(self.lingering.extend, cgroups)
            except RuntimeError:  # closed: what is left goes with the namespace
                pass

    def _refill_later(self) -> None:
        with self._lock:
            if self._refilling or self._closed or len(self._ready) >= self.size:
                return
            self._refilling = True
        try:
            self.janitor.submit(self._refill)
        except RuntimeError:
            self._refilling = False

    def _refill(self) -> None:
        try:
            while not self._closed and len(self._ready) < self.size:
                try:
                    self._ready.append(self.cgroups.make())
                except CgroupError as exc:
                    log.warning("evalsched: cannot make run cgroups ahead: %s", exc)
                    return
        finally:
            with self._lock:
                self._refilling = False

    def close(self) -> None:
        """Shutdown: no more cgroups; the unused ones and those being removed are gone on return."""
        with self._lock:
            self._closed = True
        self.janitor.shutdown(wait=True)
        while self._ready:
            self._ready.popleft().remove()
        self.lingering[:] = remove_each(self.lingering)  # (what is still left goes with the namespace)
