"""A comparison's worker process (started with ``BOOTSTRAP``, below): it reads the runs'
``spec.json`` and ``episodes.jsonl`` and computes the answer of ``GET /evalsched/compare``
(:mod:`.compare`'s statistics) in an interpreter of its own. In the
server's, the comparisons' JSON parsing held the GIL against the event loop, which gives it up at
every socket call and then waited for it again behind them (docs/performance.md, "Comparisons in
worker processes"). :mod:`.comparisons` starts these and feeds them.

One request at a time, a line of JSON on stdin: ``{"root", "runs": [records], "baseline",
"timeout_s", "limit_s", "max_values"}``. The answer on stdout: a header line ``{"status": "ok",
"bytes": n}`` and then the n bytes of the answer's JSON (which the server sends on as they are), or
``{"status": "too_large" | "unavailable" | "failed", "message"}``. The worker ends at the end of
its stdin (the server retires an idle worker so), and at once when the server's end of it closes
while it computes (the server stopped or died): it never outlives the server by more than that.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from contextlib import closing
from pathlib import Path
from typing import Any, BinaryIO

from .. import contract
from ..store import RunFileError, RunStore
from . import compare
from .errors import TooLarge, Unavailable

# A comparison looks at the clock every this many lines of a file (a line is at most
# store.MAX_EPISODE_LINE_BYTES, read as JSON: a look costs next to nothing beside 256 of them).
DEADLINE_EVERY = 256


def compare_runs(
    store: RunStore,
    records: list[dict[str, Any]],
    baseline: str | None,
    deadline: float | None,
    max_values: int,
    limit_s: float,
) -> dict[str, Any]:
    """The comparison of the runs of ``records`` (each with its ``id``; blocking: it reads every
    run's spec and episodes). Past ``deadline`` (time.monotonic()), Unavailable naming ``limit_s``;
    more than ``max_values`` episode values in all, TooLarge. Each run's ``episodes.jsonl`` is read
    as a stream, its values taken as they come: what a comparison holds is bounded by
    ``max_values``, not by the files' sizes. While a run's file is read, what is held may pass the
    limit up to twice (a later line for an index replaces the earlier one's values, maybe with
    fewer): the reading stops at the line past that; the limit itself is checked against each
    run's final count, so that the answer is the one of the whole files. The deadline is checked
    every DEADLINE_EVERY lines, episodes or not."""
    data = []
    problems: dict[str, str] = {}
    values = 0
    for given in records:
        _check_deadline(deadline, limit_s)
        record = dict(given)
        run_id = record["id"]
        try:
            spec = store.spec(run_id)
            if not isinstance(spec, dict):
                raise RunFileError(f"{contract.SPEC_FILE} is missing or not a JSON object")
            record["params"] = spec.get("params") or {}
        except RunFileError as exc:
            record["params"] = {}
            problems[run_id] = str(exc)
        metrics = compare.EpisodeMetrics()
        try:
            with closing(store.iter_episode_lines(run_id)) as lines:
                for n, line in enumerate(lines, 1):
                    if line is not None:
                        metrics.add(line)
                        if values + metrics.values > 2 * max_values:
                            raise _too_large(max_values)
                    if not n % DEADLINE_EVERY:
                        _check_deadline(deadline, limit_s)
            episodes = metrics.by_index
        except RunFileError as exc:
            episodes = {}
            problems[run_id] = str(exc)
        values += sum(len(v) for v in episodes.values())
        if values > max_values:
            raise _too_large(max_values)
        data.append((record, episodes))
    result = compare.compare(data, baseline)
    for row in result["rows"]:
        row["error"] = problems.get(row["id"])
    return result


def _too_large(max_values: int) -> TooLarge:
    return TooLarge(
        f"the runs hold more than {max_values} episode metric values (MAX_COMPARE_VALUES); compare fewer runs"
    )


def timed_out(limit_s: float) -> Unavailable:
    return Unavailable(
        f"the comparison took more than {limit_s:g} s "
        "(COMPARE_TIMEOUT_S, waiting for a worker process included); compare fewer runs, or retry"
    )


def _check_deadline(deadline: float | None, limit_s: float) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise timed_out(limit_s)


def answer(request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The header and the body of the answer to one request (the body empty but for "ok")."""
    # The deadline from what was left of it when the server sent the request: this process's
    # clock need not be the server's.
    deadline = time.monotonic() + float(request["timeout_s"])
    try:
        result = compare_runs(
            RunStore(Path(request["root"])),
            request["runs"],
            request["baseline"],
            deadline,
            int(request["max_values"]),
            float(request["limit_s"]),
        )
        body = json.dumps(result, separators=(",", ":"), allow_nan=False).encode()
    except TooLarge as exc:
        return {"status": "too_large", "message": exc.message}, b""
    except Unavailable as exc:
        return {"status": "unavailable", "message": exc.message}, b""
    except MemoryError:
        return {"status": "unavailable", "message": "the comparison's worker process ran out of memory"}, b""
    except Exception as exc:  # a bug of ours: its traceback goes to the server's log (our stderr)
        traceback.print_exc()
        return {"status": "failed", "message": f"the comparison failed: {type(exc).__name__}: {exc}"}, b""
    return {"status": "ok", "bytes": len(body)}, body


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    for line in requests:
        header, body = answer(json.loads(line))
        answers.write(json.dumps(header).encode() + b"\n" + body)
        answers.flush()


def _exit_with_the_server() -> None:
    """End this process as soon as the server's end of stdin closes, even while it computes."""

    def watch() -> None:
        poller = select.poll()
        poller.register(sys.stdin.fileno(), 0)  # no events asked: POLLHUP (the writer gone) only
        poller.poll()
        os._exit(0)

    threading.Thread(target=watch, name="evalsched-compare-watch", daemon=True).start()


def main() -> None:
    # Ctrl-C at the server's terminal reaches its whole process group: the server stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_the_server()
    # The answers go out on a copy of stdout of our own (buffered: a write is whole whatever
    # PYTHONUNBUFFERED says); stdout itself becomes stderr, so that whatever else prints (a
    # warning of an import, a print left in) reaches the server's log, never the answers.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(sys.stdin.buffer, answers)
    except BrokenPipeError:  # the server went while we answered
        os._exit(0)


# How the server starts a worker: ``python -I -S -c BOOTSTRAP <the folder that holds the package>``.
# Isolated (-I: no PYTHONPATH, no user site-packages, not the working directory) and without the
# site hooks (-S: no sitecustomize, usercustomize or .pth file) of whoever started the server:
# what a user's files there print or shadow (a select.py) cannot reach the answers, and the
# interpreter starts in a few tens of ms. The worker needs the standard library and this package
# only; the package's folder comes after the standard library, so nothing in it shadows that.
BOOTSTRAP = (
    "import sys; sys.path.append(sys.argv[1]); from jupyter_evalsched.scheduler.compare_worker import main; main()"
)


if __name__ == "__main__":
    main()
