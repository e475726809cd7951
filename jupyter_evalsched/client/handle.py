""":class:`RunHandle`: one run, as ``%eval_submit`` returns it and ``client.handle(id)`` builds it."""

from __future__ import annotations

import sys
from html import escape
from typing import TYPE_CHECKING, Any

from ..contract import TERMINAL_STATES
from .errors import EvalSchedClientError, EvalSchedError, WaitTimeout
from .formatting import format_metrics
from .progress import notebook_view, reporter_for

if TYPE_CHECKING:
    from .log_reader import LogReader
    from .rest_client import EvalSchedClient


def run_id_of(value: Any) -> Any:
    """A handle stands for its run's id (in ``depends_on``, say); anything else for itself."""
    return value.id if isinstance(value, RunHandle) else value


class ShortRecord(dict):
    """What ``wait()`` returns: a plain dict (``record["state"]``, ``json.dumps(record)``) that
    IPython shows in one line, its main keys first, when it is a cell's last value; the progress
    bar above it already told the rest. ``dict(record)`` or ``print(record)`` shows all of it."""

    SHOWN = ("id", "name", "state", "reason", "counts")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(short_repr(self, self.SHOWN))


def short_repr(record: dict, shown: tuple[str, ...]) -> str:
    """``{'id': '…', 'state': 'failed', 'reason': '…', … 35 more keys: print(record) shows them}``"""
    parts = []
    for key in shown:
        if record.get(key) not in (None, "", {}, []):
            parts.append(f"{key!r}: {record[key]!r}")
    runs = record.get("runs")
    if isinstance(runs, list):
        parts.append(f"'runs': [{len(runs)} run records]")
    more = len(record) - len(parts)
    if more > 0:
        parts.append(f"… {more} more keys: print(record) shows them")
    return "{" + ", ".join(parts) + "}"


class RunHandle:
    """One run: ``status()``, ``record()``, ``summary()``, ``episodes()``, ``logs()`` read the
    server; ``wait()`` shows progress (a widget in a notebook, text in a terminal) and returns the
    final record. Displaying the handle in a notebook shows the run's live progress widget.
    """

    def __init__(self, client: EvalSchedClient, run: str | dict):
        self.client = client
        if isinstance(run, dict):
            self.id = run["id"]
            self._record: dict | None = dict(run)
        else:
            self.id = str(run)
            self._record = None

    # ---- reads

    @property
    def run_dir(self) -> str | None:
        """The run directory on the server's host (from the record's ``run_dir``)."""
        rec = self._record if self._record and "run_dir" in self._record else self.record()
        return rec.get("run_dir")

    @property
    def last_record(self) -> dict | None:
        """The record as last read or given (no request); None before the first read."""
        return self._record

    @property
    def name(self) -> str | None:
        return (self._record or self.record()).get("name")

    def record(self) -> dict:
        """The current run record, with ``summary``."""
        self._record = self.client.get(self.id)
        return self._record

    def status(self) -> str:
        """The run's state: queued, running, succeeded, failed, cancelled or aborted."""
        return self.record()["state"]

    def summary(self) -> dict | None:
        """The run's ``summary.json`` (episodes done, per-metric mean/std/min/max/count), or None."""
        return self.record().get("summary")

    def episodes(self):
        """Finished episodes: a pandas DataFrame (one column per metric) when pandas is installed,
        else a list of dicts."""
        rows = self.client.episodes(self.id)
        try:
            import pandas as pd
        except ImportError:
            return rows
        flat = [{**{k: v for k, v in ep.items() if k != "metrics"}, **(ep.get("metrics") or {})} for ep in rows]
        df = pd.DataFrame(flat)
        for col in ("started_at", "finished_at"):
            if col in df:
                df[col] = pd.to_datetime(df[col], utc=True, errors="coerce", format="ISO8601")
        if "index" in df:
            df = df.sort_values("index").reset_index(drop=True)
        return df

    def logs(self, stream: str = "stdout", tail: int | None = None) -> str:
        return self.client.logs(self.id, stream=stream, tail=tail)

    def log_reader(self, stream: str = "stdout", tail: int | None = None) -> LogReader:
        """Follows the log: each ``read()`` gives what was written since the last (``tail``: the
        first gives the last ``tail`` lines only); ``read(final=True)`` once the run ended."""
        return self.client.log_reader(self.id, stream, tail)

    def cancel(self) -> dict:
        """Cancel the run (queued: at once; running: its process group is signalled) and return
        its record. Idempotent: a run that already ended (succeeded, failed, cancelled or
        aborted) is left as it is and its record returned, without error (the REST API's 409)."""
        try:
            self._record = self.client.cancel(self.id, by="python")
        except EvalSchedError as exc:
            if exc.status != 409:
                raise
            record = self.client.get(self.id)
            if record.get("state") not in TERMINAL_STATES:
                raise
            self._record = record
        return self._record

    def resume(self) -> dict:
        """Queue a failed, aborted or cancelled run again (same id, ``attempt`` + 1); its next
        attempt skips the episodes already done. Returns the record."""
        self._record = self.client.resume(self.id)
        return self._record

    # ---- waiting

    def wait(self, timeout: float | None = None, progress: Any = True) -> dict:
        """Wait for the end of the run and return its final record (with ``summary``).

        ``progress``: True shows a progress bar (the widget in a notebook, a line on stderr
        elsewhere), False nothing; or pass your own reporter (``update(record)``,
        ``finish(record)``). Ctrl-C / interrupting the kernel stops waiting and returns the current
        record: the run itself goes on (``cancel()`` stops it). A server that goes away once the
        run was read (a restart) is polled until it answers again, a note on stderr (or the
        reporter's ``note(text)``) saying so. Raises :class:`WaitTimeout` after ``timeout`` seconds.
        """
        reporter = reporter_for(self, progress)
        try:
            # A server that goes away meanwhile (a restart) is waited for: a note says so.
            record = self.client.wait(
                self.id, timeout=timeout, on_update=reporter.update, on_note=getattr(reporter, "note", None)
            )
        except KeyboardInterrupt:
            record = self._record_after_interrupt()
            reporter.finish(record)
            print(
                f"stopped waiting; run {self.id} is still {record.get('state')} (cancel it with .cancel())",
                file=sys.stderr,
            )
            return ShortRecord(record)
        except WaitTimeout as e:
            reporter.finish(e.record or {})
            raise
        except BaseException:
            reporter.finish(self._record or {})
            raise
        self._record = record
        reporter.finish(record)
        return ShortRecord(record)

    def _record_after_interrupt(self) -> dict:
        try:
            return self.record()
        except (EvalSchedClientError, KeyboardInterrupt):  # a second Ctrl-C, or the server is gone
            return self._record or {"id": self.id, "state": "?"}

    # ---- display

    def __repr__(self) -> str:
        rec = self._record or {}
        state = rec.get("state", "?")
        prog = rec.get("progress") or {}
        extra = f" {prog.get('done', 0)}/{prog.get('total', 0)}" if prog.get("total") else ""
        return f"<RunHandle {self.id} {rec.get('name', '')!s} {state}{extra}>".replace("  ", " ")

    def _repr_html_(self) -> str:
        rec = self._record or {"id": self.id}
        rows = [
            ("id", rec.get("id")),
            ("name", rec.get("name")),
            ("state", rec.get("state")),
            ("reason", rec.get("reason")),
            ("progress", "{done}/{total}".format(**(rec.get("progress") or {"done": 0, "total": 0}))),
            ("metrics", format_metrics(rec)),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{escape(k)}</th><td>{escape(str(v))}</td></tr>"
            for k, v in rows
            if v not in (None, "")
        )
        return f"<table class='evalsched-run'>{body}</table>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        view = notebook_view()
        if view is not None:
            display(view(self))
        else:  # a terminal, or no widget registered (ipywidgets missing): the static view
            display({"text/plain": repr(self), "text/html": self._repr_html_()}, raw=True)
