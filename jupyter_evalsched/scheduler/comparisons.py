"""Comparisons of runs as the server carries them out: the runs' specs and episodes read on a
bounded pool of their own (so that a heavy comparison never delays a plain read of a run), at most
``compare.MAX_CONCURRENT_COMPARES`` at once, within a time and a size limit. The statistics are
:mod:`.compare`'s (pure)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

from ..store import RunFileError, RunStore
from . import compare
from .errors import Busy, SpecRejected, TooLarge, Unavailable
from .runs import Run, RunTable


class Comparisons:
    # A comparison looks at the clock every this many lines of a file (a line is at most
    # store.MAX_EPISODE_LINE_BYTES, read as JSON: a look costs next to nothing beside 256 of them).
    DEADLINE_EVERY = 256

    def __init__(self, table: RunTable, store: RunStore) -> None:
        self.table = table
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=compare.COMPARE_THREADS, thread_name_prefix="evalsched-compare")
        self._compares = 0  # comparisons admitted and not answered yet (event loop only)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def inputs(
        run_ids: list[str] | None,
        sweep_id: str | None,
        baseline: str | None,
        sweep_runs: Callable[[str], list[Run]],
        get: Callable[[str], Run],
    ) -> list[Run]:
        """The runs a comparison is about, checked (unknown ids: 404 through ``get``; too many, or
        a baseline that is not among them: 422)."""
        if (run_ids is None) == (sweep_id is None):
            raise SpecRejected("name the runs to compare: ?runs=a,b,c or ?sweep=ID (one of them)")
        runs = sweep_runs(sweep_id) if sweep_id is not None else [get(r) for r in dict.fromkeys(run_ids or [])]
        if not runs:
            raise SpecRejected("no runs to compare")
        if len(runs) > compare.MAX_COMPARE_RUNS:
            raise SpecRejected(f"{len(runs)} runs; at most {compare.MAX_COMPARE_RUNS} are compared at once")
        if baseline is not None and baseline not in {r.id for r in runs}:
            raise SpecRejected(f"the baseline {baseline!r} is not one of the compared runs")
        return runs

    async def compare(self, runs: list[Run], baseline: str | None, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """The comparison of ``runs`` (checked by ``inputs``), on the comparison pool.
        More than MAX_CONCURRENT_COMPARES at once: Busy (429); a comparison past COMPARE_TIMEOUT_S
        (its wait for a thread included): Unavailable (503); one that would hold more than
        MAX_COMPARE_VALUES values: TooLarge (413)."""
        if self._compares >= compare.MAX_CONCURRENT_COMPARES:
            raise Busy(
                f"{self._compares} comparisons are under way; at most {compare.MAX_CONCURRENT_COMPARES} "
                "run at once: retry in a moment"
            )
        deadline = time.monotonic() + compare.COMPARE_TIMEOUT_S
        self._compares += 1
        try:
            return await loop.run_in_executor(self._pool, self.compare_runs, runs, baseline, deadline)
        finally:
            self._compares -= 1

    def compare_runs(self, runs: list[Run], baseline: str | None, deadline: float | None = None) -> dict[str, Any]:
        """The comparison (blocking: it reads every run's spec and episodes; a thread's work).
        Past ``deadline`` (time.monotonic()), Unavailable; more than MAX_COMPARE_VALUES episode
        values in all, TooLarge. Each run's ``episodes.jsonl`` is read as a stream, its values
        taken as they come: what a comparison holds is bounded by MAX_COMPARE_VALUES, not by the
        files' sizes. While a run's file is read, what is held may pass the limit up to twice (a
        later line for an index replaces the earlier one's values, maybe with fewer): the reading
        stops at the line past that; the limit itself is checked against each run's final count,
        so that the answer is the one of the whole files. The deadline is checked every
        DEADLINE_EVERY lines, episodes or not."""
        data = []
        problems: dict[str, str] = {}
        values = 0
        for run in runs:
            self._check_deadline(deadline)
            record = dict(run.record)
            try:
                record["params"] = self.table.full_spec(run).get("params") or {}
            except RunFileError as exc:
                record["params"] = {}
                problems[run.id] = str(exc)
            metrics = compare.EpisodeMetrics()
            try:
                with closing(self.store.iter_episode_lines(run.id)) as lines:
                    for n, line in enumerate(lines, 1):
                        if line is not None:
                            metrics.add(line)
                            if values + metrics.values > 2 * compare.MAX_COMPARE_VALUES:
                                raise self._too_large()
                        if not n % self.DEADLINE_EVERY:
                            self._check_deadline(deadline)
                episodes = metrics.by_index
            except RunFileError as exc:
                episodes = {}
                problems[run.id] = str(exc)
            values += sum(len(v) for v in episodes.values())
            if values > compare.MAX_COMPARE_VALUES:
                raise self._too_large()
            data.append((record, episodes))
        result = compare.compare(data, baseline)
        for row in result["rows"]:
            row["error"] = problems.get(row["id"])
        return result

    @staticmethod
    def _too_large() -> TooLarge:
        return TooLarge(
            f"the runs hold more than {compare.MAX_COMPARE_VALUES} episode metric values "
            "(MAX_COMPARE_VALUES); compare fewer runs"
        )

    @staticmethod
    def _check_deadline(deadline: float | None) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise Unavailable(
                f"the comparison took more than {compare.COMPARE_TIMEOUT_S:g} s "
                "(COMPARE_TIMEOUT_S, waiting for a thread included); compare fewer runs, or retry"
            )
