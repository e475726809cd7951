"""Executors: how a run is started, followed, cancelled and judged at its end.

Two kinds, told apart by ``uses_ledger``:

* ledger executors (``LocalExecutor``; a warm-start executor would be another): admission places
  the run on this host's VRAM ledger and CPU slots, marks it running with its devices, then calls
  ``launch``. The executor tells the run table how the run ended.
* placing executors (``SlurmExecutor``): the run is handed over at submission (``submit``) and the
  other system places it; this host's ledger does not apply.

An executor changes records only through the run table's public methods (``update``,
``set_reason``, ``set_exit_code``, ``set_slurm_state``, ``note_warning``, ``exited``, ``finish``,
``conclude``; ``tests/test_record_writes.py`` checks it) and learns of ended runs from
``RunTable.on_end``: it never reaches into admission, and admission never into it. (A ledger
executor calls ``exited`` as soon as a run's process is gone, before it reads the run's files
for the verdict: admission hands what the run held to the next run at once.)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor as ThreadPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ...store import RunStore
    from ..cgroups import RunCgroup
    from ..config import SchedulerConfig
    from ..runs import Run, RunTable


@dataclass(frozen=True)
class ObservedTarget:
    """A live run on this host, as observation sees it: its process, and its cgroup when it has
    one (then every process of the run is in it, whatever it did to its session)."""

    pid: int
    cgroup: RunCgroup | None = None

    def pids(self) -> set[int]:
        """Every process of the run (from its cgroup; empty without one). Blocking: I/O thread."""
        return self.cgroup.pids() if self.cgroup is not None else set()


@dataclass(frozen=True)
class ExecutorContext:
    """What the scheduler gives its executors when it starts."""

    table: RunTable
    store: RunStore
    config: SchedulerConfig
    loop: asyncio.AbstractEventLoop
    io: ThreadPool  # for blocking work (file writes, SLURM commands), off the event loop


class Executor:
    name: ClassVar[str]
    #: True: runs are admitted against this host's ledger, then ``launch``ed. False: runs are
    #: handed over at submission (``submit``) and placed elsewhere.
    uses_ledger: ClassVar[bool]

    _ctx: ExecutorContext | None = None

    @property
    def interpreter(self) -> str | None:
        """The Python its runs start with (a path or a command name), None where unknown."""
        return None

    @property
    def ctx(self) -> ExecutorContext:
        if self._ctx is None:
            raise RuntimeError(f"the {self.name} executor is not bound to a scheduler")
        return self._ctx

    def bind(self, ctx: ExecutorContext) -> None:
        """Called once, before recovery, when the scheduler starts."""
        self._ctx = ctx

    def launch(self, run: Run) -> None:
        """Start a run admission placed (state ``running``, ``devices`` set). Ledger executors."""
        raise NotImplementedError(f"the {self.name} executor places its runs itself")

    def submit(self, run: Run) -> None:
        """Take a queued run. Placing executors."""
        raise NotImplementedError(f"runs of the {self.name} executor are admitted by the scheduler")

    def recover(self, run: Run, done: bool) -> None:
        """A run this executor had, found queued or running when the server starts (``done``:
        its ``_DONE`` exists). A queued run of a ledger executor goes back to admission instead."""
        raise NotImplementedError

    async def cancel(self, run: Run) -> None:
        """Cancel a run this executor holds; the run ends ``cancelled`` (now or once it stops)."""
        raise NotImplementedError

    def kill_run(self, run: Run, reason: str) -> bool:
        """Stop a run now, everything it started included; it ends ``failed`` with ``reason``
        (a run over its declared VRAM). False when this executor cannot."""
        return False

    def preempt(self, run: Run, by: str) -> bool:
        """Stop a running run at its next episode boundary so that ``by`` can start; it is queued
        again once it stopped (``RunTable.requeue``). False when this executor cannot."""
        return False

    async def recovered(self) -> None:
        """Called once recovery has seen every run, before any run starts (admission opens once
        every executor's has returned): clean up what no run owns any more. Its waits belong in
        a thread: the event loop serves the whole Jupyter server meanwhile."""

    async def reconcile(self) -> None:
        """The periodic backstop (missed exits, another system's state)."""

    async def stop(self) -> None:
        """The server shuts down: end what must not outlive it."""

    def observed_targets(self) -> dict[str, ObservedTarget]:
        """The live runs on this host whose usage is observed (run id -> target)."""
        return {}

    @property
    def mode(self) -> dict[str, object]:
        """How it works on this host, for ``GET /evalsched/status`` (e.g. clean-up method)."""
        return {}
