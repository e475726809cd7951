"""``jupyter evalsched ...``: submit, list, status, wait, cancel, delete, logs, queue, leases, lease,
release, doctor, demo, host-ledger.

Exit status: 0 on success; 1 when ``wait`` (or ``submit --wait``, ``logs -f``, ``demo``) sees a run end in any
state but ``succeeded``, when ``doctor`` finds something degraded, or with the exit status of the
command ``lease`` ran (127: not found, 126: cannot be run, as a shell says); 2 for usage errors
and client errors (no server, invalid spec, HTTP errors), reported as one line on stderr; 130
after Ctrl-C. ``--json`` prints machine-readable output on stdout.

``wait``, ``logs -f`` and ``queue --watch`` poll through a server restart (once they read the
server), with a note on stderr, until their timeout or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .client import (
    SPEC_FILE_SUFFIXES,
    SPEC_FLAGS,
    SWEEP_FLAGS,
    EvalSchedClient,
    EvalSchedClientError,
    LiveFeed,
    LocalServer,
    QueueTracker,
    RunTracker,
    SpecError,
    TextProgress,
    WaitTimeout,
    apply_spec_options,
    elapsed_s,
    format_duration,
    format_metrics,
    load_spec_file,
    sweep_from_options,
)
from .client.discovery import discover_servers
from .client.errors import EvalSchedError, TokenRefused, server_away
from .client.formatting import (
    compare_table,
    holder_text,
    is_other_users,
    model_figures,
    other_user_text,
    other_users,
    outside_text,
    pending_text,
)
from .client.live_feed import outage_notes
from .client.spec import did_you_mean
from .client.sweep import sweep_record
from .contract import MAX_LIST_LIMIT, QUEUED, SUCCEEDED, TERMINAL_STATES

PROG = "jupyter evalsched"
DEFAULT_HOST_LEDGER_SOCKET = "/run/evalsched/ledger.sock"  # host_ledger.config.DEFAULT_SOCKET


# --------------------------------------------------------------------------- output helpers


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], max_width: int = 60) -> str:
    """A plain left-aligned text table; cells longer than ``max_width`` are cut with an ellipsis,
    except in the last column (a reason: read whole, it shifts no other column)."""

    def cell(v: Any, width: int | None = max_width) -> str:
        s = "" if v is None else str(v)
        s = " ".join(s.split())
        return s if width is None or len(s) <= width else s[: width - 1] + "…"

    last = len(headers) - 1
    text_rows = [[cell(h) for h in headers]] + [
        [cell(v, None if i == last else max_width) for i, v in enumerate(row)] for row in rows
    ]
    widths = [max(len(r[i]) for r in text_rows) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)).rstrip() for r in text_rows]
    return "\n".join(lines)


def _progress(rec: dict) -> str:
    prog = rec.get("progress") or {}
    return f"{prog.get('done', 0)}/{prog.get('total', 0)}"


def format_slurm(rec: dict) -> str:
    """``slurm:123 RUNNING`` for a SLURM run (``slurm`` alone until sbatch answered), ``""`` for a
    local run."""
    if rec.get("executor") != "slurm":
        return ""
    job = rec.get("slurm_job_id")
    head = f"slurm:{job}" if job not in (None, "") else "slurm"
    return f"{head} {rec['slurm_state']}" if rec.get("slurm_state") else head


def format_where(rec: dict) -> str:
    """Where a run executes, for the GPUS column: ``slurm:123 RUNNING`` for a SLURM run (it is not
    on this host's GPUs), else its GPUs (``gpu0,gpu1``: a bare ``0`` reads as "no GPU"), ``cpu``
    for a run that takes no GPU, ``-`` for one that has none yet (queued)."""
    if format_slurm(rec):
        return format_slurm(rec)
    devices = rec.get("devices") or []
    if devices:
        return ",".join(f"gpu{d}" for d in devices)
    if not rec.get("marginal_vram_mb") and not rec.get("exclusive_gpu"):
        return "cpu"
    return "-"


# The width of text written to a pipe or a file: wide enough for a table row, narrow enough to read.
PIPED_WIDTH = 100
WATCH_QUEUE_ROWS = 50  # queued runs that `queue --watch` lists unless told


def output_width() -> int:
    """The columns text is wrapped to: the terminal's (``COLUMNS`` first, as the shell sets it),
    else ``PIPED_WIDTH`` when the output is not a terminal."""
    return max(40, shutil.get_terminal_size((PIPED_WIDTH, 24)).columns)


def wrap_lines(text: str, width: int, indent: str = "", first_indent: str = "") -> list[str]:
    """``text`` wrapped to ``width`` columns at spaces, never inside a word (an id, a path): the
    whole of it, nothing cut."""
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=first_indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [first_indent.rstrip()]


def _bar(fraction: float, width: int = 24) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def format_ledger(
    ledger: dict | None, width: int = 24, names: dict[str, str] | None = None, me: str | None = None
) -> str:
    """One text bar per GPU (allocated out of usable), then the CPU slots. ``names`` maps run ids
    to shorter labels. On a host shared through a host ledger, a line per other user under each
    GPU, by user name only; ``me`` is this server's user (``host_ledger.user`` of the status)."""
    names = names or {}
    if not ledger:
        return "ledger: unavailable"
    lines = []
    for dev in ledger.get("devices") or []:
        usable = int(dev.get("usable_mb") or 0)
        allocated = int(dev.get("allocated_mb") or 0)
        extra = []
        if dev.get("baseline_mb"):
            extra.append(f"models {dev['baseline_mb']} MB")
        if dev.get("unmanaged_mb"):
            holders = _unmanaged_holders(dev, me)
            extra.append(f"other {dev['unmanaged_mb']} MB" + (f": {holders}" if holders else ""))
        if dev.get("exclusive"):
            extra.append(f"held whole by {names.get(dev['exclusive'], dev['exclusive'])}")
        runs = ", ".join(
            f"{names.get(r.get('id'), r.get('id'))}:{r.get('marginal_vram_mb')}" for r in dev.get("runs") or []
        )
        leases = ", ".join(
            f"{lease_holder(item)}:{item.get('vram_mb')}"
            + (f" (+{item['over_lease_mb']} over)" if item.get("over_lease_mb") else "")
            for item in dev.get("leases") or []
        )
        lines.append(
            f"GPU {dev.get('index')} {_bar(allocated / usable if usable else 0.0, width)} "
            f"{allocated:>6}/{usable} MB  free {dev.get('free_mb')} MB"
            + (f"  ({'; '.join(extra)})" if extra else "")
            + (f"  runs: {runs}" if runs else "")
            + (f"  leases: {leases}" if leases else "")
        )
        for entry in other_users(dev, me):  # a line per other user: what they hold, nothing more
            pieces = [other_user_text(entry)] if entry["mb"] > 0 else []
            if entry["outside_mb"] > 0:
                pieces.append(
                    outside_text(entry) if not pieces else f"{entry['outside_mb']:,} MB outside the scheduler"
                )
            lines.append("  user " + "; ".join(pieces))
    if not lines:
        lines.append("no GPUs (CPU-only runs)")
    cpu = ledger.get("cpu_slots") or {}
    if cpu:
        lines.append(f"CPU slots {cpu.get('allocated', 0)}/{cpu.get('total', 0)}")
    return "\n".join(lines)


def lease_holder(lease: dict) -> str:
    """Who holds a lease: its label, else its notebook, else its pid, else its id."""
    if lease.get("label"):
        return str(lease["label"])
    if lease.get("session_path"):
        return os.path.basename(str(lease["session_path"]))
    return f"pid {lease['pid']}" if lease.get("pid") else str(lease.get("id"))


def _unmanaged_holders(dev: dict, me: str | None = None) -> str:
    """VRAM outside the scheduler by who holds it: another user of a shared host (by name), a
    notebook (its kernel), else a pid."""
    by_holder: dict[str, int] = {}
    for proc in dev.get("unmanaged_processes") or []:
        if proc.get("lease_id"):
            continue  # within its lease (only what exceeds it is unmanaged, shown with the lease)
        if is_other_users(proc, me):
            who = f"user {proc['user']}"
        elif proc.get("session_path"):
            who = os.path.basename(proc["session_path"])
        else:
            who = f"pid {proc.get('pid')}"
        by_holder[who] = by_holder.get(who, 0) + int(proc.get("used_mb") or 0)
    return ", ".join(f"{who} {mb} MB" for who, mb in sorted(by_holder.items(), key=lambda kv: -kv[1]))


def format_leases(leases: Sequence[dict]) -> str:
    return format_table(
        [
            (
                item.get("id"),
                item.get("state"),
                lease_holder(item),
                f"{item.get('vram_mb')}{' excl' if item.get('exclusive_gpu') else ''}",
                ",".join(str(d) for d in item.get("devices") or []) or "-",
                item.get("pid") or "-",
                pending_text(item),
            )
            for item in leases
        ],
        ["ID", "STATE", "HOLDER", "VRAM_MB", "GPUS", "PID", "REASON"],
        max_width=90,
    )


def format_queue(view: dict, me: str | None = None) -> str:
    """``me``: this server's user on a host shared through a host ledger (see format_ledger)."""
    running = view.get("running") or []
    queued = view.get("queued") or []
    out = [format_ledger(view.get("ledger"), names=run_labels(running), me=me), "", f"RUNNING ({len(running)})"]
    if running:
        out.append(
            format_table(
                [
                    (
                        r.get("id"),
                        r.get("name"),
                        r.get("priority"),
                        r.get("marginal_vram_mb"),
                        format_where(r),
                        _progress(r),
                        format_duration(elapsed_s(r)),
                    )
                    for r in running
                ],
                ["ID", "NAME", "PRIORITY", "VRAM_MB", "GPUS", "PROGRESS", "ELAPSED"],
            )
        )
    leases = view.get("leases") or []
    if leases:
        out += ["", f"LEASES ({len(leases)})", format_leases(leases)]
    total = view.get("queued_total")
    total = total if isinstance(total, int) and total > len(queued) else len(queued)
    out += ["", f"QUEUED ({total}, in admission order)"]
    if queued:
        # A queued SLURM run may already be a PENDING SLURM job: a SLURM column when there is one.
        slurm = any(format_slurm(q) for q in queued)
        out.append(
            format_table(
                [
                    (i + 1, q.get("id"), q.get("name"), q.get("priority"), q.get("marginal_vram_mb"))
                    + ((format_slurm(q) or "-",) if slurm else ())
                    + (pending_text(q),)
                    for i, q in enumerate(queued)
                ],
                ["#", "ID", "NAME", "PRIORITY", "VRAM_MB"] + (["SLURM"] if slurm else []) + ["REASON"],
                max_width=90,
            )
        )
    if total > len(queued):
        out.append(f"... and {total - len(queued)} more queued (--limit shows more)")
    return "\n".join(out)


def run_labels(runs: Sequence[dict]) -> dict[str, str]:
    """What the ledger's bars call each run: its name, with its id where two share it."""
    shared = Counter(r.get("name") for r in runs)
    return {
        r["id"]: (r["name"] if shared[r["name"]] == 1 else f"{r['name']} ({r['id']})")
        for r in runs
        if r.get("id") and r.get("name")
    }


class _Screen:
    """Redraws a block of text in place on a terminal; elsewhere prints it only when it changes."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._lines = 0
        self._last_key: Any = None

    def draw(self, text: str, key: Any = None) -> None:
        if self.tty:
            # Lines are wrapped here to the terminal's width (never cut: a reason is read whole):
            # a line the terminal wrapped would break the count of lines to move back up over.
            columns = max(20, shutil.get_terminal_size().columns - 1)
            lines = []
            for line in text.split("\n"):
                if len(line) <= columns:
                    lines.append(line)
                else:
                    lines += textwrap.wrap(line, columns, subsequent_indent="  ", break_on_hyphens=False) or [""]
            if self._lines:
                self.stream.write(f"\x1b[{self._lines}F\x1b[J")
            self.stream.write("\n".join(lines) + "\n")
            self._lines = len(lines)
        else:
            key = text if key is None else key
            if key == self._last_key:
                return
            self._last_key = key
            self.stream.write(text + "\n\n")
        self.stream.flush()


class _Throttle:
    """Calls ``draw()`` after a change, at most every ``min_s``, and every ``every_s`` anyway
    (the clocks and elapsed times on the screen)."""

    def __init__(self, draw: Callable[[], None], every_s: float, min_s: float = 0.25):
        self._draw = draw
        self.every_s = every_s
        self.min_s = min_s
        self._dirty = True
        self._last = 0.0

    def changed(self, *_: Any) -> None:
        self._dirty = True

    def tick(self) -> None:
        since = time.monotonic() - self._last
        if (self._dirty and since >= self.min_s) or since >= self.every_s:
            self.draw_now()

    def draw_now(self) -> None:
        self._last = time.monotonic()
        self._dirty = False
        self._draw()


# --------------------------------------------------------------------------- commands


def _client(args: argparse.Namespace) -> EvalSchedClient:
    """The client of the server named (``--url``, ``EVALSCHED_URL``), else of the one discovery
    picks; when it found several, a line on stderr says which (a user's runs are on one of them)."""
    if args.url is not None or os.environ.get("EVALSCHED_URL"):
        return EvalSchedClient(args.url, args.token)
    (base, token), others = discover_servers(token=args.token)
    if others:
        print(f"{PROG}: {several_servers_note(base, 1 + len(others))}", file=sys.stderr)
    return EvalSchedClient(base, token)


def several_servers_note(base: str, count: int) -> str:
    return f"using {base} ({count} servers found: --url to choose)"


SWEEP_PREFIX = "sweep-"  # sweep ids; run ids never start so


def _record_line(rec: dict) -> str:
    parts = [rec.get("id", "?"), rec.get("name") or "", rec.get("state", "?")]
    if rec.get("reason"):
        parts.append(rec["reason"])
    return "  ".join(str(p) for p in parts if p != "")


def _wait_and_report(client: EvalSchedClient, run_id: str, args: argparse.Namespace, timeout: float | None) -> int:
    reporter = TextProgress(stream=sys.stderr) if not args.quiet else None
    try:
        # Through a server restart it goes on polling (until --timeout, else until Ctrl-C),
        # saying so on stderr.
        rec = client.wait(
            run_id,
            timeout=timeout,
            on_update=reporter.update if reporter else None,
            on_note=reporter.note if reporter else None,
        )
    except WaitTimeout as e:
        if reporter:
            reporter.finish(e.record or {})
        print(f"{PROG}: {e}; it goes on (`{PROG} wait {run_id}` again, or `{PROG} cancel {run_id}`)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if reporter:
            reporter.finish({})
        print(
            f"{PROG}: stopped waiting; run {run_id} goes on (cancel it with `{PROG} cancel {run_id}`)", file=sys.stderr
        )
        return 130
    if reporter:
        reporter.finish(rec)
    if args.json:
        _print_json(rec)
    else:
        line = _record_line(rec)
        metrics = format_metrics(rec, limit=8)
        print(line + (f"  {metrics}" if metrics else ""))
    return 0 if rec.get("state") == SUCCEEDED else 1


def cmd_submit(args: argparse.Namespace) -> int:
    if args.target is None:
        if not args.source_file:
            raise SpecError("submit needs a spec file, an entrypoint or --source-file")
        base = {}  # the server's default entrypoint for a source: eval.py:episode
    elif args.target.endswith(SPEC_FILE_SUFFIXES):
        base = load_spec_file(args.target)
    elif ":" in args.target:
        base = {"entrypoint": args.target}
    else:
        raise SpecError(
            f"{args.target!r} is neither a spec file (.json, .yaml) nor an entrypoint "
            "('pkg.module:function' or 'path/file.py:function')"
        )
    if args.source_file:
        try:
            with open(args.source_file, encoding="utf-8") as f:
                base["source"] = f.read()
        except OSError as e:
            raise SpecError(f"cannot read {args.source_file}: {e.strerror or e}") from None
    spec = apply_spec_options(base, args, default_cwd=os.getcwd())
    client = _client(args)
    sweep = sweep_from_options(args)
    if sweep is not None:
        return _submit_sweep(client, spec, sweep, args)
    rec = client.submit(spec)
    if args.wait:
        if not args.json:
            print(f"submitted {_record_line(rec)}", file=sys.stderr)
        return _wait_and_report(client, rec["id"], args, args.wait_timeout)
    if args.json:
        _print_json(rec)
    else:
        print(_record_line(rec))
    return 0


def _submit_sweep(client: EvalSchedClient, spec: dict, sweep: dict | list, args: argparse.Namespace) -> int:
    view = client.submit_sweep(spec, sweep)
    if not args.wait:
        if args.json:
            _print_json(view)
        else:
            print(f"sweep {view['id']}: {len(view['runs'])} runs")
            for rec in view["runs"]:
                print(f"  {_record_line(rec)}")
        return 0
    if not args.json:
        print(f"submitted sweep {view['id']}: {len(view['runs'])} runs", file=sys.stderr)
    return _wait_for_sweep(client, view["id"], args, args.wait_timeout)


def _wait_for_sweep(client: EvalSchedClient, sweep_id: str, args: argparse.Namespace, timeout: float | None) -> int:
    handle = client.sweep_handle(sweep_id)
    try:
        view = handle.follow(timeout=timeout, progress=TextProgress(stream=sys.stderr) if not args.quiet else False)
    except WaitTimeout as e:
        print(
            f"{PROG}: {e}; it goes on (`{PROG} wait {sweep_id}` again, or `{PROG} cancel {sweep_id}`)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(
            f"{PROG}: stopped waiting; sweep {sweep_id} goes on (cancel it with `{PROG} cancel {sweep_id}`)",
            file=sys.stderr,
        )
        return 130
    if args.json:
        _print_json(view)
    else:
        print(compare_table(client.compare(sweep=sweep_id)))
    return 0 if sweep_record(view)["state"] == SUCCEEDED else 1


def cmd_sweeps(args: argparse.Namespace) -> int:
    sweeps = _client(args).sweeps(limit=args.limit)
    if args.json:
        _print_json(sweeps)
        return 0
    for s in sweeps:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(s["counts"].items()))
        print(f"{s['id']}  {(s.get('name') or '').split(' [')[0]}  {s['runs']} runs: {counts}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if bool(args.run_ids) == bool(args.sweep):
        raise SpecError("compare needs run ids, or --sweep ID (one of them)")
    client = _client(args)
    answer = client.compare(runs=args.run_ids or None, sweep=args.sweep, baseline=args.baseline)
    if args.json:
        _print_json(answer)
        return 0
    # Runs named one by one may run different evals (a sweep's all run one): their records say.
    records = (
        [rec for row in answer.get("rows") or [] if (rec := _record_if_any(client, row["id"]))] if args.run_ids else []
    )
    for line in compare_warnings(answer.get("rows") or [], records):
        print(f"warning: {line}", file=sys.stderr)  # (stdout: the table alone, for scripts)
    print(compare_table(answer, limit_metrics=args.metrics))
    return 0


def _record_if_any(client: EvalSchedClient, run_id: str) -> dict | None:
    """A run's record, or None where it is gone (deleted since the comparison: not checked)."""
    try:
        return client.get(run_id)
    except EvalSchedError as e:
        if e.status == 404:
            return None
        raise


def compare_warnings(rows: Sequence[dict], records: Sequence[dict]) -> list[str]:
    """What makes a comparison's deltas doubtful: runs that did not succeed (their metrics cover
    the episodes they finished), and runs of different evals (their ``entrypoint``, and the
    digest of a cell's source, in ``records``)."""
    out = []
    unfinished = [r for r in rows if r.get("state") != SUCCEEDED]
    if unfinished:
        listed = ", ".join(f"{r.get('name') or r.get('id')} ({r.get('state')})" for r in unfinished[:5])
        more = f" and {len(unfinished) - 5} more" if len(unfinished) > 5 else ""
        out.append(f"did not succeed: {listed}{more}; their metrics cover only the episodes they finished")
    evals: dict[str, list[str]] = {}
    for rec in records:
        what = str(rec.get("entrypoint") or "?")
        if rec.get("source_digest"):
            what += f" (source {str(rec['source_digest'])[:8]})"  # two cells' evals are both eval.py:episode
        evals.setdefault(what, []).append(str(rec.get("name") or rec.get("id")))
    if len(evals) > 1:
        groups = "; ".join(
            f"{what}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}" for what, names in evals.items()
        )
        out.append(f"the runs' entrypoints differ ({groups}): they ran different evals")
    return out


def cmd_list(args: argparse.Namespace) -> int:
    runs = _client(args).list(state=args.state, limit=args.limit)
    if args.json:
        _print_json(runs)
        return 0
    print(format_list(runs))
    return 0


def format_list(runs: Sequence[dict]) -> str:
    """The ``list`` table; a SLURM column (``slurm:123 RUNNING``) when a SLURM run is listed."""
    slurm = any(format_slurm(r) for r in runs)
    return format_table(
        [
            (r.get("id"), r.get("name"), r.get("state"), r.get("priority"), r.get("marginal_vram_mb"))
            + ((format_slurm(r) or "-",) if slurm else ())
            + (_progress(r), (r.get("submitted_at") or "")[:19].replace("T", " "), r.get("reason") or "")
            for r in runs
        ],
        ["ID", "NAME", "STATE", "PRIORITY", "VRAM_MB"]
        + (["SLURM"] if slurm else [])
        + ["PROGRESS", "SUBMITTED (UTC)", "REASON"],
    )


def cmd_status(args: argparse.Namespace) -> int:
    rec = _client(args).get(args.run_id)
    if args.json:
        _print_json(rec)
        return 0
    summary = rec.get("summary") or {}
    # The keys' column: as wide as the longest metric's key (up to a point), so that no value runs into its key.
    keys_width = max((len("metric " + str(name)) for name in summary.get("metrics") or {}), default=0) + 2
    width = min(max(STATUS_KEY_WIDTH, keys_width), MAX_STATUS_KEY_WIDTH)
    keys = [
        "id",
        "name",
        "state",
        "reason",
        "priority",
        "submitted_at",
        "started_at",
        "finished_at",
        "pid",
        "devices",
        "exit_code",
        "marginal_vram_mb",
        "depends_on",
        "executor",
        "slurm_job_id",
        "slurm_state",
        "memory_mb",
        "run_dir",
    ]
    for key in keys:
        if key == "exit_code" and not exit_code_tells(rec):
            continue
        if key in rec and rec[key] not in (None, [], ""):
            print(f"{_key_cell(key, width)}{rec[key]}")
    for holder in (rec.get("why") or {}).get("holders") or []:
        print(f"{_key_cell('held by', width)}{holder_text(holder)}")
    if rec.get("marginal_vram_source", "declared") != "declared":
        print(f"{_key_cell('vram from', width)}{rec['marginal_vram_source']}")
    observed = rec.get("observed")
    if observed:
        vram = ", ".join(f"GPU {gpu}: {mb} MB" for gpu, mb in (observed.get("peak_vram_mb") or {}).items()) or "none"
        rss = observed.get("peak_rss_mb")
        print(f"{_key_cell('observed', width)}peak VRAM {vram}; peak host memory {rss if rss is not None else '?'} MB")
    for warning in rec.get("warnings") or []:
        print(f"{_key_cell('warning', width)}{warning}")
    if (rec.get("attempt") or 1) > 1 or rec.get("retries"):
        extra = [f"attempt {rec.get('attempt', 1)}"]
        if rec.get("retries"):
            extra.append(f"retries {rec.get('retries_used', 0)} of {rec['retries']} used")
        if rec.get("preemptions"):
            extra.append(f"preempted {rec['preemptions']} time(s)")
        if rec.get("retry_at"):
            extra.append(f"next attempt at {rec['retry_at']}")
        print(f"{_key_cell('attempts', width)}{'; '.join(extra)}")
    for h in rec.get("history") or []:
        print(
            f"{_key_cell('attempt ' + str(h.get('attempt')), width)}{h.get('state')} after {h.get('episodes_done', 0)} episodes: {h.get('reason')}"
        )
    if rec.get("detach"):
        print(f"{_key_cell('detached', width)}yes (does not die with the server)")
    if rec.get("start"):
        print(f"{_key_cell('start', width)}{rec['start']} ({rec.get('start_detail') or ''})")
    print(f"{_key_cell('progress', width)}{_progress(rec)}")
    for name, stats in (summary.get("metrics") or {}).items():
        if isinstance(stats, dict):
            desc = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
            print(f"{_key_cell('metric ' + name, width)}{desc}")
    error = summary.get("error")
    if error:
        print(f"{_key_cell('error', width)}{error.get('type')}: {error.get('message')}")
    if rec.get("state") in TERMINAL_STATES and rec.get("state") != SUCCEEDED:
        print(f"{_key_cell('its stderr', width)}{PROG} logs {rec.get('id')} --stream stderr  (a traceback, if any)")
    return 0


STATUS_KEY_WIDTH = 17  # the key column of `status`, at least
MAX_STATUS_KEY_WIDTH = 40  # and at most: a longer key is followed by two spaces


def _key_cell(key: str, width: int) -> str:
    """``key`` padded to ``width``, or followed by two spaces where it is as long: never run into its value."""
    return key.ljust(width) if len(key) < width else key + "  "


def exit_code_tells(rec: dict) -> bool:
    """Whether a record's ``exit_code`` says something: not a 0 of a run that failed, which only
    means that the runner caught the eval's failure, recorded it and exited normally."""
    return not (rec.get("exit_code") == 0 and rec.get("state") not in (SUCCEEDED, None, "queued", "running"))


def cmd_leases(args: argparse.Namespace) -> int:
    leases = _client(args).request("GET", "leases")["leases"]
    if args.json:
        _print_json(leases)
    else:
        print(format_leases(leases) if leases else "no live lease")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from .client.lease import lease_path

    path = lease_path(args.lease_id)  # quoted: an id never names another resource
    client = _client(args)
    client.request("DELETE", path)
    rec = client.request("GET", path)
    if args.json:
        _print_json(rec)
    else:
        print(f"{rec['id']}  {rec['state']}  {rec.get('reason') or ''}".rstrip())
    return 0


def cmd_lease(args: argparse.Namespace) -> int:
    """Hold a lease while a command runs (with CUDA_VISIBLE_DEVICES set), or until Ctrl-C."""
    from .client.lease import lease

    command = list(args.command or [])
    try:
        held = lease(
            args.vram,
            gpus=args.gpus,
            exclusive_gpu=args.exclusive,
            timeout=args.timeout,
            label=args.label or (" ".join(command)[:200] if command else None),
            ttl_s=args.ttl,
            client=_client(args),
        )
    except KeyboardInterrupt:
        print(f"{PROG}: stopped waiting; the lease request was withdrawn", file=sys.stderr)
        return 130
    with held:
        devices = ",".join(str(d) for d in held.devices)
        if args.json:
            _print_json(held.record)
        else:
            print(f"lease {held.id}: {held.record.get('vram_mb')} MB on GPU {devices}", file=sys.stderr)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices, CUDA_DEVICE_ORDER="PCI_BUS_ID", EVALSCHED_LEASE=held.id)
        try:
            if not command:
                print("holding it until Ctrl-C", file=sys.stderr)
                while held.refresh()["state"] == "granted":
                    time.sleep(1.0)
                print(f"lease {held.id}: {held.record.get('reason')}", file=sys.stderr)
                return 0
            import subprocess

            # The lease ends (`with held`) only once the command has: a signal that would end
            # this CLI goes to the command instead (from before it starts), and this CLI goes on
            # waiting for it.
            with _SignalsPassedOn() as passing:
                try:
                    child = subprocess.Popen(command, env=env, preexec_fn=_dies_with_this_process())
                except FileNotFoundError:  # as a shell says it, with its exit status; the lease ends
                    print(f"{PROG}: {command[0]}: command not found", file=sys.stderr)
                    return 127
                except OSError as e:  # not executable (permission, format): a shell's 126
                    print(f"{PROG}: {command[0]}: cannot run it: {e.strerror or e}", file=sys.stderr)
                    return 126
                passing.to(child)
                code = child.wait()
            return 128 - code if code < 0 else code  # killed by signal N: 128+N, as a shell says it
        except KeyboardInterrupt:
            return 130


# The signals that end a CLI (a terminal closed, `kill`, Ctrl-C) and that `lease -- COMMAND`
# passes on to the command. PR_SET_PDEATHSIG in <sys/prctl.h>.
_PASSED_ON = ("SIGTERM", "SIGHUP", "SIGINT")
_PR_SET_PDEATHSIG = 1


def _dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` by which the command is SIGKILLed when this CLI dies (even SIGKILLed,
    when no handler of ours runs), so that it never holds a GPU after its lease ended; None where
    the kernel has no such thing (not Linux) or libc cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        import signal

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    kill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:  # the CLI died before prctl took effect
            os._exit(1)

    return preexec


def _terminal_signals_it_too() -> bool:
    """Whether a Ctrl-C reached the command from the terminal already (it shares our process
    group, the foreground one of our controlling terminal, whatever our stdin is: ``< /dev/null``
    too): a second SIGINT from us would interrupt its own clean-up."""
    if not hasattr(os, "tcgetpgrp"):
        return False
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return False  # no controlling terminal (a service, setsid, a CI job): no Ctrl-C from one
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


class _SignalsPassedOn:
    """While in the ``with``, the signals of ``_PASSED_ON`` this CLI gets go to the command
    (``to(child)``; those that came before it started, once it has). Those set to be ignored stay
    ignored (``nohup``, a background job); outside the main thread nothing is passed on."""

    def __init__(self) -> None:
        self._child: Any = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalsPassedOn:
        import signal

        for name in _PASSED_ON:
            signum = getattr(signal, name, None)
            if signum is None or signal.getsignal(signum) == signal.SIG_IGN:
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._pass_on)
            except ValueError:  # not the main thread (main() called from one)
                break
        return self

    def _pass_on(self, signum: int, frame: Any) -> None:
        import signal

        if signum == signal.SIGINT and _terminal_signals_it_too():
            return
        if self._child is None:
            self._pending.append(signum)
            return
        try:
            self._child.send_signal(signum)
        except OSError:
            pass  # it has just exited

    def to(self, child: Any) -> None:
        self._child = child
        while self._pending:
            self._pass_on(self._pending.pop(0), None)

    def __exit__(self, *exc: Any) -> None:
        import signal

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def format_checks(checks: Sequence[dict]) -> str:
    lines = []
    for item in checks:
        lines.append(f"{item['status'].upper():<9} {item['name']:<13} {item['detail']}")
        if item.get("fix") and item["status"] != "ok":
            lines.append(f"{'':<9} {'':<13} fix: {item['fix']}")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import ERROR, OK, check, local_checks

    try:
        client = _client(args)
        checks = [check("server", OK, f"{client.base_url} answers /evalsched/")]
        checks += client.request("GET", "doctor")["checks"]
    except EvalSchedClientError as e:
        if isinstance(e, TokenRefused) or (isinstance(e, EvalSchedError) and e.status == 403):
            # A server is there, and its checks (not this host's, seen from outside it) are
            # what matters: only the token stands in the way.
            fix = "give the server's token: EVALSCHED_TOKEN=... or --token (`jupyter server list` shows it)"
            detail = str(e) if isinstance(e, TokenRefused) else f"{client.base_url} refused the token"
            checks = [check("server", ERROR, detail, fix)]
            _print_json(checks) if args.json else print(format_checks(checks))
            return 2
        checks = [check("server", ERROR, str(e), "start Jupyter with the extension, or set EVALSCHED_URL")]
        checks += local_checks()  # what this host offers, without a server
    if args.json:
        _print_json(checks)
    else:
        print(format_checks(checks))
    statuses = {item["status"] for item in checks}
    return 2 if ERROR in statuses else (1 if statuses - {OK} else 0)


def cmd_wait(args: argparse.Namespace) -> int:
    if args.run_id.startswith(SWEEP_PREFIX):
        return _wait_for_sweep(_client(args), args.run_id, args, args.timeout)
    return _wait_and_report(_client(args), args.run_id, args, args.timeout)


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.run_id.startswith(SWEEP_PREFIX):  # a sweep: its unfinished runs
        view = _client(args).cancel_sweep(args.run_id, by="cli")
        view = sweep_cancel_view(view)
        ending = view["still_ending"]
        if args.json:
            _print_json(view)
        else:
            for rec in view["runs"]:
                print(cancel_line(rec))
            # On stderr: stdout stays one line per run.
            print(sweep_cancel_note(args.run_id, ending), file=sys.stderr)
        return 0
    rec = with_cancel_requested(_client(args).cancel(args.run_id, by="cli"))
    _print_json(rec) if args.json else print(cancel_line(rec))
    return 0


def with_cancel_requested(rec: dict) -> dict:
    """A cancel's answer with ``cancel_requested`` (the run still ends: signalled, not ended yet)
    where the server did not say it (a server older than the field, for a run's or a sweep's
    cancel); a run's state then tells it (a cancel never leaves a run unended otherwise)."""
    if "cancel_requested" in rec:
        return rec
    return {**rec, "cancel_requested": rec.get("state") not in TERMINAL_STATES}


def sweep_cancel_view(view: dict) -> dict:
    """A sweep cancel's answer with ``cancel_requested`` on each run and ``still_ending``, where a
    server older than these fields did not say them: each run's state then tells it."""
    runs = [with_cancel_requested(rec) for rec in view["runs"]]
    ending = view.get("still_ending", sum(rec["cancel_requested"] for rec in runs))
    return {**view, "runs": runs, "still_ending": ending}


def sweep_cancel_note(sweep_id: str, ending: int) -> str:
    """How many runs of a cancelled sweep are still ending (signalled, not ended yet)."""
    if not ending:
        return f"sweep {sweep_id}: no run still ending (each is cancelled, or had ended before)"
    runs = "1 run is" if ending == 1 else f"{ending} runs are"
    return f"sweep {sweep_id}: {runs} still ending; each ends cancelled once it has stopped (`{PROG} wait {sweep_id}`)"


def cancel_line(rec: dict) -> str:
    """What a cancel did to a run, from the answer's ``cancel_requested``: ended (``cancelled``
    and the reason: a queued or not yet started run), else signalled and ending (a running one
    is answered as it is, ``running``, until its process exits)."""
    if not with_cancel_requested(rec)["cancel_requested"]:
        return _record_line(rec)
    head = "  ".join(str(p) for p in (rec.get("id", "?"), rec.get("name") or "") if p)
    how = (
        "its SLURM job scancel'd; it ends cancelled once SLURM says the job ended"
        if rec.get("executor") == "slurm"
        else "signalled to stop (SIGTERM, then SIGKILL after the server's cancel_grace_s); "
        "it ends cancelled when its process exits"
    )
    return f"{head}  cancelling: {how} (`{PROG} wait {rec.get('id', '?')}` shows it)"


def cmd_resume(args: argparse.Namespace) -> int:
    client = _client(args)
    rec = client.resume(args.run_id)
    if args.wait:
        return _wait_and_report(client, args.run_id, args, None)
    _print_json(rec) if args.json else print(_record_line(rec) + f"  (attempt {rec.get('attempt', '?')})")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    _client(args).delete(args.run_id)
    _print_json({"id": args.run_id, "deleted": True}) if args.json else print(f"deleted {args.run_id}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.follow:
        text = client.logs(args.run_id, stream=args.stream, tail=args.tail)
        if args.json:
            _print_json({"id": args.run_id, "stream": args.stream, "text": text})
            return 0
        sys.stdout.write(text)
        sys.stdout.flush()
        _tell_the_end(client, args.run_id, args.stream, printed=bool(text))
        return 0
    follower = _LogFollower(client, args.run_id, args.stream, args.tail, as_json=args.json)
    told: list[str | None] = [None]

    def tell_why_queued(rec: dict) -> None:
        # A queued run has no log yet: what it waits for, on stderr, once and at each change.
        note = queued_note(rec)
        if note is not None and note != told[0]:
            print(note, file=sys.stderr, flush=True)
        told[0] = note

    try:
        # The feed follows the run's state, through a server restart too; the log is read at its
        # ticks, and once more after the final record was read, so that the last read holds
        # everything the run wrote.
        LiveFeed(
            client,
            RunTracker(args.run_id, on_change=tell_why_queued),
            on_tick=follower.tick,
            name="evalsched-logs",
            on_outage=outage_notes(),
        ).run()
        follower.print_new(final=True)
    except KeyboardInterrupt:
        return 130
    # As `wait`: 0 only when the run followed succeeded.
    return 0 if _tell_the_end(client, args.run_id, args.stream, printed=follower.printed > 0) == SUCCEEDED else 1


def queued_note(rec: dict) -> str | None:
    """The line ``logs -f`` writes on stderr while the run it follows is queued: what it waits for."""
    if rec.get("state") != QUEUED:
        return None
    why = pending_text(rec) or "no reason given yet"
    return f"(run {rec.get('id')} is queued: {why}; its log begins when it starts)"


STDERR_TAIL_LINES = 20  # of a failed run's stderr, under its stdout


def _tell_the_end(client: EvalSchedClient, run_id: str, stream: str, printed: bool) -> str | None:
    """After a run's stdout, on stderr: why it did not succeed, with the end of its stderr (the
    traceback is there) and how to read all of it; for a log with nothing in it (or none yet: the
    run has not started), that. Never nothing: an empty answer reads as "it worked". Returns the
    run's state."""
    rec = client.get(run_id)
    state = rec.get("state")
    if state not in TERMINAL_STATES or state == SUCCEEDED or stream == "stderr":
        if not printed:
            print(f"(nothing in {stream}.log of run {run_id}; the run is {state})", file=sys.stderr)
        return state
    print(failure_note(rec, client.logs(run_id, stream="stderr", tail=STDERR_TAIL_LINES)), file=sys.stderr)
    return state


def failure_note(rec: dict, stderr_tail: str) -> str:
    """What ``logs`` adds for a run that did not succeed: its state and reason, the end of its
    stderr, and the command that shows the whole of it."""
    run_id = rec.get("id", "?")
    lines = [f"run {run_id} {rec.get('state')}: {rec.get('reason') or 'no reason recorded'}"]
    if stderr_tail.strip():
        lines += ["the end of its stderr.log:", *("  " + line for line in stderr_tail.rstrip("\n").split("\n"))]
    lines.append(f"all of it: {PROG} logs {run_id} --stream stderr")
    return "\n".join(lines)


class _LogFollower:
    """Prints what is new in a run's log, read at most every ``interval_s``: each read fetches
    the bytes past the last one only (:class:`LogReader`)."""

    def __init__(
        self,
        client: EvalSchedClient,
        run_id: str,
        stream: str,
        tail: int | None,
        interval_s: float = 0.5,
        as_json: bool = False,
    ):
        self.run_id = run_id
        self.stream = stream
        self.reader = client.log_reader(run_id, stream, tail)
        self.reader.on_rewritten = self._rewritten
        self.interval_s = interval_s
        self.as_json = as_json  # a JSON line {"id", "stream", "text"} per new chunk
        self.printed = 0  # characters written to stdout
        self._last_read = 0.0

    def tick(self) -> None:
        if time.monotonic() - self._last_read >= self.interval_s:
            try:
                self.print_new()
            except EvalSchedClientError as e:
                if not server_away(e):
                    raise
                # The server is away (a restart): the feed says so, and this reads again later.

    def print_new(self, final: bool = False) -> None:
        """Print what came since the last read; ``final``: the run ended, read to the log's end."""
        self._last_read = time.monotonic()
        new = self.reader.read(final=final)
        if new:
            if self.as_json:
                sys.stdout.write(json.dumps({"id": self.run_id, "stream": self.stream, "text": new}) + "\n")
            else:
                sys.stdout.write(new)
            sys.stdout.flush()
            self.printed += len(new)

    def _rewritten(self) -> None:
        sys.stdout.flush()
        print(
            f"({self.stream}.log of run {self.run_id} was rewritten: printing it again from its start)", file=sys.stderr
        )


def host_user(client: EvalSchedClient, view: dict) -> str | None:
    """This server's user on a host shared through a host ledger (the ledger's devices list
    ``users``), from ``GET /evalsched/status``; None without one, or while the link has not said."""
    if not any("users" in dev for dev in (view.get("ledger") or {}).get("devices") or []):
        return None
    try:
        user = (client.request("GET", "status").get("host_ledger") or {}).get("user")
    except EvalSchedClientError:
        return None
    return user if isinstance(user, str) and user else None


def _queue_limit(text: str) -> int:
    """``queue --limit``: what the server accepts, told before asking it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_LIST_LIMIT}, got {value}")
    return value


def cmd_queue(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.watch:
        view = client.queue(limit=args.limit)
        _print_json(view) if args.json else print(format_queue(view, host_user(client, view)))
        return 0
    me: list[str | None] = [None]
    screen = _Screen()
    away: list[str | None] = [None]  # why the server cannot be read, while it cannot
    # A screen redrawn at every change shows the head of a long queue, not thousands of lines.
    tracker = QueueTracker(queue_limit=WATCH_QUEUE_ROWS if args.limit is None else args.limit)

    def draw() -> None:
        view = tracker.view
        if args.json:
            print(json.dumps(view), flush=True)
        else:
            if me[0] is None:
                me[0] = host_user(client, view)
            note = f"  (server unreachable, retrying: {away[0]})" if away[0] and screen.tty else ""
            screen.draw(
                time.strftime("%H:%M:%S  ") + client.base_url + note + "\n\n" + format_queue(view, me[0]),
                key=json.dumps(view, sort_keys=True, default=str),
            )

    # Drawn at every change, and every --interval anyway (the clock and elapsed times); without
    # the event stream the queue is read every --interval.
    redraw = _Throttle(draw, every_s=args.interval)
    tracker.on_change = redraw.changed
    note_on_stderr = outage_notes()

    def on_outage(error: str | None) -> None:
        # Through a server restart the view stays, and is read again once the server answers:
        # the screen's header says so on a terminal, a line on stderr otherwise.
        away[0] = error
        if screen.tty and not args.json:
            redraw.changed()
        else:
            note_on_stderr(error)

    feed = LiveFeed(
        client,
        tracker,
        poll_s=args.interval,
        safety_poll_s=max(3.0, args.interval),
        on_tick=redraw.tick,
        name="evalsched-queue",
        on_outage=on_outage,
    )
    try:
        feed.run()
    except KeyboardInterrupt:
        return 0
    return 0


# --------------------------------------------------------------------------- demo


DEMO_LEASE_MB = 10000


def demo_plan(sleep_s: float, episodes: int) -> list[tuple[str, dict]]:
    """The demo's runs: on two 24000 MB GPUs, one holding a notebook's 10000 MB lease at first, three
    16000 MB runs cannot all run at once, the exclusive run waits for an empty GPU, the
    high-priority run overtakes both, and one CPU run waits for the first run (its ``depends_on``
    is filled in at submission)."""
    entry = "jupyter_evalsched.examples.basic:sleepy"

    def spec(name: str, vram: int = 0, priority: str = "normal", exclusive: bool = False) -> dict:
        return {
            "name": name,
            "entrypoint": entry,
            "episodes": episodes,
            "params": {"sleep_s": sleep_s},
            "seed": 1000 * len(name) + ord(name[-1]),
            "scheduling": {"marginal_vram_mb": vram, "priority": priority, "exclusive_gpu": exclusive},
        }

    return [
        ("big-a", spec("big-a", 16000)),
        ("big-b", spec("big-b", 16000)),
        ("big-c", spec("big-c", 16000)),
        ("exclusive", spec("exclusive", 0, exclusive=True)),
        ("urgent", spec("urgent", 16000, priority="high")),
        ("after-a", {**spec("after-a"), "depends_on": ["@big-a"]}),
    ]


DEMO_MODEL = "tiny-lm"


def demo_model_dir() -> str:
    """Where the demo builds its tiny causal LM (offline, once: later demos reuse it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jupyter_evalsched", "tiny-gpt2")


def demo_models() -> list[dict]:
    """The demo's shared model: the tiny GPT-2 (``shared_models.tiny_lm``), built and loaded by
    its model host as the server starts (without waiting for it); none without the libraries it
    needs."""
    import importlib.util

    if any(importlib.util.find_spec(name) is None for name in ("torch", "transformers", "tokenizers")):
        return []
    return [
        {
            "name": DEMO_MODEL,
            "loader": "jupyter_evalsched.shared_models.tiny_lm:load_tiny_lm",
            "model": demo_model_dir(),
            "max_batch_size": 16,
            "cpu_threads": 1,
            "preload": True,  # built and loaded while the first runs queue, not when its run asks
        }
    ]


def demo_model_run(episodes: int) -> tuple[str, dict]:
    """The demo's run that uses the shared model through ``OPENAI_BASE_URL`` (on the CPU)."""
    return (
        "openai",
        {
            "name": "openai",
            "entrypoint": "jupyter_evalsched.examples.shared:openai_completion",
            "episodes": episodes,
            "params": {"model": DEMO_MODEL, "max_tokens": 8},
            "seed": 7,
            "models": [DEMO_MODEL],
            "scheduling": {"marginal_vram_mb": 0},
        },
    )


def format_demo_models(models: Sequence[dict], width: int) -> str:
    """``shared model tiny-lm (loaded) at http://…/evalsched/v1: 4 requests · 52.1 tok/s ·
    batch 1``, wrapped to ``width`` (the URL whole)."""
    lines: list[str] = []
    for m in models:
        text = f"shared model {m.get('name')} ({m.get('state')}) at {m.get('endpoint') or '-'}: " + " · ".join(
            model_figures(m)
        )
        lines += wrap_lines(text, width, indent="    ")
    return "\n".join(lines)


def demo_frame(
    view: dict, ids: dict[str, str], records: dict[str, dict], elapsed: float, width: int
) -> tuple[str, Any]:
    """One frame of the demo, ``width`` columns wide: the ledger, then a row per run with its
    reason whole under it (wrapped, never cut: the reason is what the demo is there to show).
    Returns the text and what a log outside a terminal compares to print changes only."""
    order = {q["id"]: i + 1 for i, q in enumerate(view.get("queued") or [])}
    labels = {rid: label for label, rid in ids.items()}
    rows, reasons = [], []
    for label, rid in ids.items():
        rec = records[rid]
        rows.append(
            (
                label,
                rec.get("state"),
                f"#{order[rid]}" if rid in order else "",
                rec.get("priority"),
                rec.get("marginal_vram_mb"),
                format_where(rec),
                _progress(rec),
            )
        )
        reasons.append(rec.get("reason") or "")
    table = format_table(rows, ["RUN", "STATE", "QUEUE", "PRIORITY", "VRAM_MB", "GPUS", "PROGRESS"]).split("\n")
    lines = [f"t={elapsed:5.1f}s"]
    for line in format_ledger(view.get("ledger"), names=labels).split("\n"):
        lines += wrap_lines(line, width, indent="      ")
    lines += ["", table[0]]
    for row, reason in zip(table[1:], reasons, strict=True):
        lines.append(row)
        if reason:
            lines += wrap_lines(reason, width, indent="      ", first_indent="    ")
    key = [(r[1], r[2], reason) for r, reason in zip(rows, reasons, strict=True)]  # changes only, in a log
    return "\n".join(lines), key


def _follow_demo(client: EvalSchedClient, ids: dict[str, str], args: argparse.Namespace) -> list[dict] | None:
    """Show the demo's runs until all are terminal, then return their final records (with
    ``summary``); None when ``args.timeout`` passes first."""
    t0 = time.monotonic()
    screen = _Screen()
    tracker = QueueTracker(finished_limit=50)
    records: dict[str, dict] = {}

    def draw() -> None:
        text, key = demo_frame(tracker.view, ids, records, time.monotonic() - t0, output_width() - 1)
        if not args.json:
            screen.draw(text, key=key)

    redraw = _Throttle(draw, every_s=0.5)
    tracker.on_change = redraw.changed

    def tick() -> bool:
        for rid in ids.values():
            # A run is queued, running or recently finished; a GET only before the first read.
            records[rid] = tracker.find(rid) or records.get(rid) or client.get(rid)
        if all(r.get("state") in TERMINAL_STATES for r in records.values()):
            # The last end came as an event, before the ledger that frees its GPU: the final
            # frame is drawn from a fresh read, whatever the throttle says.
            tracker.read(client)
            for rid in ids.values():
                records[rid] = tracker.find(rid) or records[rid]
            redraw.draw_now()
            return False
        redraw.tick()
        return time.monotonic() - t0 <= args.timeout

    LiveFeed(client, tracker, poll_s=0.5, safety_poll_s=1.0, on_tick=tick, name="evalsched-demo").run()
    if not all(r.get("state") in TERMINAL_STATES for r in records.values()):
        return None
    return [client.get(rid) for rid in ids.values()]  # with the final summary.json: the metrics


def format_demo_final(ids: dict[str, str], final: Sequence[dict], width: int) -> str:
    """The demo's last table: each run's id, state, time, GPUs and metrics (under its row, whole,
    when they do not fit beside it); a reason (a run that did not succeed) whole under its row."""
    metrics = [format_metrics(rec) for rec in final]

    def table(beside: Sequence[bool]) -> list[str]:
        rows = [
            (
                label,
                rec.get("id"),
                rec.get("state"),
                format_duration(elapsed_s(rec)),
                format_where(rec),
                text if keep else "",
            )
            for label, rec, text, keep in zip(ids, final, metrics, beside, strict=False)
        ]
        return format_table(rows, ["RUN", "ID", "STATE", "RAN", "GPUS", "METRICS"]).split("\n")

    # METRICS is the last column: a row's metrics moved under it leave the other rows as they were.
    beside = [len(line) <= width for line in table([True] * len(final))[1:]]
    lines = [*table(beside)[:1]]
    for row, rec, text, keep in zip(table(beside)[1:], final, metrics, beside, strict=False):
        lines.append(row.rstrip())
        if not keep:
            lines += wrap_lines(text, width, indent="    ", first_indent="    ")
        if rec.get("reason"):
            lines += wrap_lines(rec["reason"], width, indent="      ", first_indent="    ")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    server = None
    try:
        if args.url:
            client = EvalSchedClient(args.url, args.token)
            print(f"using the server at {client.base_url}", file=sys.stderr)
        else:
            print("starting a private Jupyter server with two virtual 24000 MB GPUs …", file=sys.stderr)
            models = demo_models()
            server = LocalServer(virtual_gpus="24000,24000", cpu_slots=8, models=models)
            client = server.client()
            print(f"server at {client.base_url} (runs in {server.runs_dir})", file=sys.stderr)
            if not models:
                print("(torch, transformers or tokenizers is missing: no shared model this time)", file=sys.stderr)
        served = DEMO_MODEL in {m.get("name") for m in client.models()}
        if served and not args.json:
            print(
                f"shared model {DEMO_MODEL}: a tiny causal LM (built offline in {demo_model_dir()}), "
                f"at {client.base_url.rstrip('/')}/evalsched/v1; run 'openai' calls it with the openai client",
                file=sys.stderr,
            )

        # A notebook holding VRAM for interactive work: a lease, for as long as the first runs take.
        lease = client.request(
            "POST",
            "leases",
            body={
                "vram_mb": DEMO_LEASE_MB,
                "label": "demo notebook",
                "pid": os.getpid(),
                "ttl_s": max(1.5, args.sleep * args.episodes),
            },
        )
        if not args.json:
            print(
                f"lease {lease['id']}: {DEMO_LEASE_MB} MB for 'demo notebook' ({lease['state']}, "
                f"ends after {lease['ttl_s']:g} s)",
                file=sys.stderr,
            )
        ids: dict[str, str] = {}
        plan = demo_plan(args.sleep, args.episodes) + ([demo_model_run(args.episodes)] if served else [])
        for label, spec in plan:
            spec = dict(spec)
            spec["depends_on"] = [ids[d[1:]] if d.startswith("@") else d for d in spec.get("depends_on", [])]
            spec.setdefault("cwd", os.getcwd())
            ids[label] = client.submit(spec)["id"]

        final = _follow_demo(client, ids, args)
        if final is None:
            print(
                f"{PROG}: demo runs did not finish within {args.timeout:g} s (a busy host? try --timeout {2 * args.timeout:g})",
                file=sys.stderr,
            )
            return 1
        models = [m for m in client.models() if m.get("name") == DEMO_MODEL] if served else []
        if args.json:
            _print_json({"runs": final, "models": models})
        else:
            print("\nfinal:")
            print(format_demo_final(ids, final, output_width() - 1))
            if models:
                print(format_demo_models(models, output_width() - 1))
        ok = all(r.get("state") == SUCCEEDED for r in final)
        return 0 if ok else 1
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            print("stopping the server …", file=sys.stderr)
            server.cleanup()


# --------------------------------------------------------------------------- host ledger


def format_host_ledger(view: dict) -> str:
    """The host ledger's view (``--status``): per GPU what is held and by whom, then the grants
    and the waiting requests the caller may see."""
    head = f"host ledger: user {view['user']}{' (admin: every user)' if view.get('admin') else ''}"
    lines = [
        head + ("; reclaiming: new grants wait for the servers to re-tell theirs" if view.get("reclaiming") else "")
    ]
    rows = []
    for dev in view["devices"]:
        others = ", ".join(f"{u['user']} {u['allocated_mb']} MB" for u in dev["users"]) or "-"
        rows.append([dev["index"], dev["usable_mb"], dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"], others])
    lines.append(format_table(rows, ["GPU", "USABLE_MB", "GRANTED_MB", "UNMANAGED_MB", "FREE_MB", "OTHER USERS"]))
    if view["grants"]:
        grants = [
            [g["id"], g["user"], g["kind"], g["key"], ",".join(map(str, g["devices"])), g["vram_mb"]]
            for g in view["grants"]
        ]
        lines += ["", format_table(grants, ["GRANT", "USER", "KIND", "KEY", "GPUS", "VRAM_MB"])]
    if view["waiting"]:
        waiting = [[w["user"], w["key"], w["vram_mb"], w["reason"]] for w in view["waiting"]]
        lines += ["", format_table(waiting, ["WAITING", "KEY", "VRAM_MB", "REASON"], max_width=100)]
    omitted = {what: n for what, n in (view.get("omitted") or {}).items() if n}
    if omitted:  # a busy host's view is bounded; its per-GPU figures above count everything
        more = ", ".join(f"{n} more {what}" for what, n in omitted.items())
        lines += ["", f"({more} not listed)"]
    return "\n".join(lines)


def cmd_host_ledger(args: argparse.Namespace) -> int:
    from .host_ledger.client import HostLedgerError, status
    from .host_ledger.config import ConfigError, load_config

    if args.status:
        try:
            view = status(args.socket)
        except HostLedgerError as e:
            print(f"{PROG}: error: {e.reason}", file=sys.stderr)
            return 2
        _print_json(view) if args.json else print(format_host_ledger(view))
        return 0
    import asyncio
    import logging

    from .host_ledger.server import serve

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(config, args.socket))
    except (OSError, RuntimeError) as e:  # the socket's directory, another ledger on it
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse, with "did you mean ...?" for a mistyped flag or command."""

    def error(self, message: str) -> NoReturn:
        known: set[str] = set(self._option_string_actions)
        for action in self._actions:  # a flag the top parser does not know may be a command's
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    known.update(sub._option_string_actions)
        super().error(did_you_mean(message, sorted(known)))


def build_parser() -> argparse.ArgumentParser:
    # Global options are accepted before and after the subcommand; SUPPRESS keeps a subparser's
    # unset copy from overwriting a value given before the subcommand.
    common = _Parser(add_help=False)
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="server base URL (default: EVALSCHED_URL, else the running Jupyter server)",
    )
    common.add_argument("--token", default=argparse.SUPPRESS, help="server token (default: EVALSCHED_TOKEN)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    parser = _Parser(
        prog=PROG, parents=[common], description="Submit and watch evaluation runs on the host's scheduler."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("submit", cmd_submit, "submit a run from a spec file (.json/.yaml) or an entrypoint")
    p.add_argument(
        "target",
        metavar="SPEC_OR_ENTRYPOINT",
        nargs="?",
        help="spec.json / spec.yaml, or 'pkg.module:function' / 'path/file.py:function' (optional with --source-file)",
    )
    for flag_args, flag_kwargs in (*SPEC_FLAGS, *SWEEP_FLAGS):
        p.add_argument(*flag_args, **flag_kwargs)
    p.add_argument(
        "--source-file",
        metavar="FILE",
        help="send FILE as the spec's source, saved as the run's eval.py; the entrypoint defaults to eval.py:episode",
    )
    p.add_argument(
        "--wait", action="store_true", help="wait for the run (or sweep); exit 0 only if it (all of it) succeeded"
    )
    # --timeout is the run's timeout_s (a spec flag), so waiting has its own option.
    p.add_argument(
        "--wait-timeout",
        dest="wait_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --wait: stop waiting after SECONDS (exit 1)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="with --wait: no progress bar")

    p = add("list", cmd_list, "list runs, newest first")
    p.add_argument("--state", help="only these states, comma-separated (e.g. queued,running)")
    p.add_argument("--limit", type=int, help="at most this many runs (server default 100)")

    p = add("status", cmd_status, "show one run's record and metrics")
    p.add_argument("run_id", metavar="ID")

    p = add("wait", cmd_wait, "wait for a run (or a sweep) with a progress bar; exit 0 only if it succeeded")
    p.add_argument("run_id", metavar="ID")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop waiting after SECONDS (exit 1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = add("cancel", cmd_cancel, "cancel a queued or running run, or a sweep's unfinished runs")
    p.add_argument("run_id", metavar="ID")

    p = add("sweeps", cmd_sweeps, "list the sweeps, newest first")
    p.add_argument("--limit", type=int, help="at most this many sweeps (server default 100)")

    p = add(
        "compare",
        cmd_compare,
        "runs (or a sweep's runs) side by side: metrics ± stderr, paired deltas against a baseline with 95%% intervals",
    )
    p.add_argument("run_ids", metavar="ID", nargs="*", help="the runs to compare")
    p.add_argument("--sweep", metavar="SWEEP_ID", help="compare this sweep's runs")
    p.add_argument("--baseline", metavar="ID", help="the run deltas are against (default: the first)")
    p.add_argument("--metrics", type=int, default=3, metavar="N", help="show the first N metrics (default 3)")

    p = add(
        "resume",
        cmd_resume,
        "queue a failed, aborted or cancelled run again; it skips the episodes already done",
    )
    p.add_argument("run_id", metavar="ID")
    p.add_argument("--wait", action="store_true", help="then wait for it; exit 0 only if it succeeded")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (with --wait)")

    p = add("delete", cmd_delete, "delete a finished run's directory")
    p.add_argument("run_id", metavar="ID")

    p = add("logs", cmd_logs, "print a run's stdout or stderr")
    p.add_argument("run_id", metavar="ID")
    p.add_argument("--stream", choices=["stdout", "stderr"], default="stdout")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing until the run ends; exit 1 unless it succeeded",
    )

    p = add("queue", cmd_queue, "show the queue and the VRAM ledger")
    p.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    p.add_argument(
        "--limit",
        type=_queue_limit,
        metavar="N",
        help=f"list the first N queued runs only (all of them by default; {WATCH_QUEUE_ROWS} with --watch);"
        " the count says how many are queued",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="with --watch: redraw at least this often (at every change anyway); poll this often without events",
    )

    p = add("leases", cmd_leases, "list the live leases (VRAM held for interactive work)")

    p = add("release", cmd_release, "end a lease")
    p.add_argument("lease_id", metavar="LEASE_ID")

    p = add(
        "lease",
        cmd_lease,
        "hold VRAM in the ledger while a command runs (CUDA_VISIBLE_DEVICES set to the leased GPUs), or until Ctrl-C",
    )
    p.add_argument("vram", metavar="MB", type=int, nargs="?", default=0, help="VRAM per GPU, in MB")
    p.set_defaults(command=[])  # what follows `--`: the command to run under the lease (see main)
    p.add_argument("--gpus", type=int, default=1, metavar="N")
    p.add_argument("--exclusive", action="store_true", help="whole GPUs, nothing else on them")
    p.add_argument("--ttl", type=float, metavar="SECONDS", help="end the lease this long after its grant")
    p.add_argument("--label", help="shown in the ledger (default: the command)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="give up waiting for the grant after this long")

    p = add("doctor", cmd_doctor, "what this host offers and what is in force, each line OK or degraded with the fix")

    p = add(
        "host-ledger",
        cmd_host_ledger,
        "serve the host ledger: one process granting the GPUs to every user's server on this host",
    )
    p.add_argument(
        "--socket",
        default=DEFAULT_HOST_LEDGER_SOCKET,
        metavar="PATH",
        help=f"its Unix socket (default {DEFAULT_HOST_LEDGER_SOCKET})",
    )
    p.add_argument("--config", metavar="FILE", help="its policy (JSON): usable VRAM, quotas, admin group, socket mode")
    p.add_argument(
        "--status",
        action="store_true",
        help="print the running ledger's view (every user's for root or the admin group; else your own)",
    )

    p = add("demo", cmd_demo, "start a private server on two virtual GPUs, queue a few runs and watch them")
    p.add_argument("--sleep", type=float, default=0.5, metavar="SECONDS", help="sleep per episode (default 0.5)")
    p.add_argument("--episodes", type=int, default=4, help="episodes per run (default 4)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS", help="give up after SECONDS")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv and "lease" in argv[: argv.index("--")]:
        # `lease MB [flags] -- COMMAND ...`: everything after `--` is the command, flags included.
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if command:
        args.command = command
    for name, default in (("url", None), ("token", None), ("json", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    try:
        return args.func(args)
    except EvalSchedClientError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling: no traceback
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`
        try:
            sys.stdout.close()
        except Exception:
            pass
        return 0


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
