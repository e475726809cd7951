""":class:`SweepHandle`: one sweep (``POST /evalsched/sweeps``) and its runs, from Python."""

from __future__ import annotations

import sys
import time
from html import escape
from typing import TYPE_CHECKING, Any

from ..contract import ABORTED, CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL_STATES
from .errors import EvalSchedClientError, WaitTimeout, server_away
from .handle import RunHandle, ShortRecord
from .live_feed import outage_notes
from .progress import ProgressReporter, TextProgress, _NoProgress

if TYPE_CHECKING:
    from .rest_client import EvalSchedClient


def sweep_record(view: dict) -> dict:
    """The sweep as one run-like record, for a progress bar: its episodes done of all, a state
    (running while any run is active; else failed when any failed, cancelled when any was
    cancelled, succeeded), the counts as its reason, and its first run's name."""
    runs = view.get("runs") or []
    counts = view.get("counts") or {}
    done = sum(int((r.get("progress") or {}).get("done") or 0) for r in runs)
    total = sum(int((r.get("progress") or {}).get("total") or 0) for r in runs)
    if any(r.get("state") in (QUEUED, RUNNING) for r in runs):
        state = RUNNING if any(r.get("state") == RUNNING for r in runs) or done else QUEUED
    elif counts.get(FAILED) or counts.get(ABORTED):
        state = FAILED
    elif counts.get(CANCELLED):
        state = CANCELLED
    else:
        state = SUCCEEDED
    started = [r["started_at"] for r in runs if r.get("started_at")]
    finished = [r["finished_at"] for r in runs if r.get("finished_at")]
    base = (runs[0].get("name") or "").split(" [")[0] if runs else ""
    return {
        "id": view.get("id"),
        "name": f"sweep {base} ({len(runs)} runs)".replace("  ", " "),
        "state": state,
        "reason": ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or None,
        "progress": {"done": done, "total": total},
        "started_at": min(started) if started else None,
        "finished_at": max(finished) if finished and state in TERMINAL_STATES else None,
    }


class SweepHandle:
    """A sweep: ``runs`` (:class:`RunHandle`), ``wait()``, ``cancel()``, ``compare()``."""

    poll_s = 0.5

    def __init__(self, client: EvalSchedClient, sweep: str | dict):
        self.client = client
        if isinstance(sweep, dict):
            self.id = str(sweep["id"])
            self._view: dict | None = sweep
        else:
            self.id = str(sweep)
            self._view = None

    # ---- reading

    def refresh(self) -> dict:
        """``GET /evalsched/sweeps/{id}``: ``{"id", "runs", "counts"}``."""
        self._view = self.client.sweep(self.id)
        return self._view

    @property
    def view(self) -> dict:
        return self._view if self._view is not None else self.refresh()

    @property
    def runs(self) -> list[RunHandle]:
        return [RunHandle(self.client, record) for record in self.view.get("runs") or []]

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.refresh().get("counts") or {})

    @property
    def done(self) -> bool:
        return all(r.get("state") in TERMINAL_STATES for r in self.refresh().get("runs") or [])

    # ---- acting

    def cancel(self) -> dict:
        """Cancel the sweep's unfinished runs; finished runs keep their results. Answers the
        sweep's view, each run with ``cancel_requested`` (signalled by the cancel and still
        ending: it shows ``running`` until it has stopped) and ``still_ending``, how many are
        (a server older than these fields: absent)."""
        answer = self.client.cancel_sweep(self.id, by="python")
        # (The view kept is a plain view: those two fields say how the cancel went, then.)
        runs = [{k: v for k, v in r.items() if k != "cancel_requested"} for r in answer.get("runs") or []]
        self._view = {**{k: v for k, v in answer.items() if k != "still_ending"}, "runs": runs}
        return answer

    def wait(self, timeout: float | None = None, progress: Any = True) -> dict:
        """Wait until every run of the sweep has ended; returns the sweep's view. One progress
        bar for the sweep (episodes done of all its runs). Interrupting stops waiting, not the
        sweep; a server that goes away once the sweep was read (a restart) is polled until it
        answers again, with a note on stderr; :class:`WaitTimeout` after ``timeout`` seconds."""
        try:
            return self.follow(timeout, progress)
        except KeyboardInterrupt:
            print(f"stopped waiting; sweep {self.id} goes on (cancel it with .cancel())", file=sys.stderr)
            return ShortRecord(self._view or {"id": self.id, "runs": []})

    def follow(self, timeout: float | None = None, progress: Any = True) -> dict:
        """:meth:`wait`, but Ctrl-C raises KeyboardInterrupt, with nothing said: for a caller
        that tells the user in its own words (the CLI)."""
        reporter: ProgressReporter
        if progress is True:
            reporter = TextProgress()
        elif progress is False or progress is None:
            reporter = _NoProgress()
        else:
            reporter = progress
        on_outage = outage_notes(getattr(reporter, "note", None))
        deadline = None if timeout is None else time.monotonic() + timeout
        record: dict | None = None  # the sweep's as last read: none before the first read
        away = False
        try:
            while True:
                try:
                    view = self.refresh()
                except EvalSchedClientError as e:
                    # A sweep never read (an unknown id, a wrong URL) is told at once; a server
                    # that went away (a restart) is polled until it answers.
                    if record is None or not server_away(e):
                        raise
                    if not away:
                        away = True
                        on_outage(str(e))
                else:
                    if away:
                        away = False
                        on_outage(None)
                    record = sweep_record(view)
                    reporter.update(record)
                    if record["state"] in TERMINAL_STATES:
                        break
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(self.id, timeout or 0.0, record, what="sweep")
                time.sleep(self.poll_s if not away else max(self.poll_s, 1.0))
        except BaseException:
            reporter.finish(record or {})  # (nothing read: no bar at all, not an empty one)
            raise
        reporter.finish(record)
        return ShortRecord(view)

    def compare(self, baseline: Any = None) -> Any:
        """The sweep's runs side by side: see :func:`jupyter_evalsched.compare`."""
        from .comparison import frame

        return frame(self.client.compare(sweep=self.id, baseline=baseline))

    # ---- display

    def __repr__(self) -> str:
        view = self._view or {}
        counts = ", ".join(f"{n} {s}" for s, n in sorted((view.get("counts") or {}).items()))
        return f"<SweepHandle {self.id} {len(view.get('runs') or [])} runs{': ' + counts if counts else ''}>"

    def _repr_html_(self) -> str:
        try:
            view = self._view or self.refresh()
        except EvalSchedClientError:
            view = {"id": self.id, "runs": []}
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{escape(str(v))}</td>"
                for v in (
                    r.get("id"),
                    ", ".join(f"{k}={v}" for k, v in (r.get("sweep_point") or {}).items()),
                    r.get("state"),
                    "{done}/{total}".format(**(r.get("progress") or {"done": 0, "total": 0})),
                )
            )
            + "</tr>"
            for r in view.get("runs") or []
        )
        head = "<tr><th>run</th><th>point</th><th>state</th><th>episodes</th></tr>"
        return f"<div><b>sweep {escape(self.id)}</b><table class='evalsched-sweep'>{head}{rows}</table></div>"
