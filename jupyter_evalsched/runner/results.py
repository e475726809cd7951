"""Metrics and the run's output files: ``episodes.jsonl``, ``summary.json`` and ``_DONE``.

The run process is the single writer of these files. ``summary.json`` is replaced atomically (a
temporary file in the same directory, renamed over it, or exchanged with it between episodes:
:mod:`.replace`), so a reader sees either the previous or the next complete file, never a partial
one.
"""

from __future__ import annotations

import _thread  # get_ident() without importing `threading`
import math
import os
import time

from ..contract import DONE_FILE, EPISODES_FILE, MAX_METRIC_NAME_CHARS, MAX_METRIC_NAMES, SUMMARY_FILE
from .fastjson import dumps
from .replace import replace

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Mapping

    from .errors import ErrorInfo

    Number = bool | int | float
    Metrics = dict[str, Number]  # what an episode returned, validated: {name: number}
    # name -> {mean, std, min, max, count, skipped}; the figures are None when nothing was finite
    MetricsSummary = dict[str, dict[str, float | None]]

# Intermediate summaries are fsync'd at most this often. Readers are protected by the atomic
# rename alone; fsync only adds durability across a host crash, where in-flight runs are lost
# anyway (they become `aborted`). An fsync'd rewrite costs ~5 ms on this project's disks, which
# would make a 100,000-episode run of fast episodes spend minutes in fsync. The end of a run is
# always made durable (see RunFiles.finalize).
INTERMEDIATE_FSYNC_INTERVAL_S = 1.0

# Run files are private to their owner, like the rest of the run directory; O_NOFOLLOW: a
# symbolic link planted in the run directory never redirects a write.
_FILE_MODE = 0o600
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def utc_now_iso() -> str:
    """Now, as ISO 8601 in UTC with microseconds and ``+00:00``.

    Same text as ``datetime.now(timezone.utc).isoformat(timespec="microseconds")``, without
    importing ``datetime`` on the runner's start-up path.
    """
    ns = time.time_ns()
    seconds, rem = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rem // 1000:06d}+00:00"


def validate_metrics(result: object, index: int) -> Metrics:
    """Check what ``episode(ctx, index)`` returned and normalize it to ``{name: number}``.

    ``None`` means no metrics. Values may be bool, int or float, or any other real number type
    (numpy scalars register as ``numbers.Real``), which is converted to int or float. Anything
    else raises a TypeError that names the episode. Names of a ``str`` subclass (a ``StrEnum``)
    become plain ``str`` of the same text: what is returned holds no class of the eval's, so a
    worker can send it to the run process, which has not imported the eval's module.
    """
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise TypeError(
            f"episode {index} returned {type(result).__name__}; an episode must return a dict "
            f"of metric name -> number, or None"
        )
    metrics: Metrics = {}
    for name, value in result.items():
        if not isinstance(name, str):
            raise TypeError(
                f"episode {index} returned a metric name of type {type(name).__name__} ({name!r:.80}); "
                f"metric names must be strings"
            )
        if type(name) is not str:
            name = str.__str__(name)  # (a copy of the text, whatever the subclass overrides)
        if type(value) not in (bool, int, float):
            value = _coerce_number(value, name, index)
        metrics[name] = value
    return metrics


def _coerce_number(value: object, name: str, index: int) -> Number:
    if isinstance(value, int):  # subclasses, e.g. IntEnum (bool cannot be subclassed)
        return int(value)
    if isinstance(value, float):  # subclasses, e.g. numpy.float64
        return float(value)
    import numbers  # only for unusual values: numpy and friends register with these ABCs

    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"episode {index} returned metric {name!r} = {value!r:.80} of type {type(value).__name__}; "
        f"metric values must be numbers (bool, int or float)"
    )


def _as_finite_float(value: Number | None) -> float | None:
    if value is None:  # a non-finite value as episodes.jsonl holds it
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


# The least int that float() cannot convert (OverflowError): 2**1024 less half the last step.
_FLOAT_OVERFLOW = 2**1024 - 2**970


def _json_safe(value: Number) -> bool:
    if type(value) is float:
        return math.isfinite(value)
    return type(value) is not int or -_FLOAT_OVERFLOW < value < _FLOAT_OVERFLOW


def json_safe_metrics(metrics: Metrics) -> Mapping[str, Number | None]:
    """Metrics as written to ``episodes.jsonl``: non-finite floats become null (strict JSON has
    no NaN or Infinity, and browsers reject them), and so do ints too large for a float (a reader
    takes them for one, which overflows; beyond 4300 digits Python will not even write them);
    the summary counts them as skipped."""
    if all(_json_safe(v) for v in metrics.values()):
        return metrics
    return {k: (v if _json_safe(v) else None) for k, v in metrics.items()}


class MetricAggregator:
    """Running mean, population std, min, max and count per metric, in O(1) per value
    (Welford's algorithm), so a run of any length never re-reads its episodes.

    At most ``max_names`` distinct metric names (the first seen) are kept, and no name longer than
    ``MAX_METRIC_NAME_CHARS``: the others are dropped and counted (distinct names, up to
    ``MAX_DROPPED_COUNTED``), so that what an eval returns never makes the summary, the run's
    record or a comparison grow without bound."""

    __slots__ = ("_dropped", "_stats", "_too_long", "max_names")

    MAX_DROPPED_COUNTED = 65536

    def __init__(self, max_names: int = MAX_METRIC_NAMES) -> None:
        # name -> [count, mean, m2, min, max, skipped] (count and skipped are ints)
        self._stats: dict[str, list[float]] = {}
        self._dropped: set[str] = set()
        # The names dropped as too long, by hash: the names themselves may be megabytes each.
        self._too_long: set[int] = set()
        self.max_names = max_names

    @property
    def dropped(self) -> int:
        """Distinct metric names dropped so far, for either reason (at most MAX_DROPPED_COUNTED)."""
        return len(self._dropped) + len(self._too_long)

    @property
    def too_long(self) -> int:
        """Of those, the names dropped as longer than MAX_METRIC_NAME_CHARS."""
        return len(self._too_long)

    def _drop(self, name: str) -> None:
        if len(self._dropped) + len(self._too_long) < self.MAX_DROPPED_COUNTED:
            if len(name) > MAX_METRIC_NAME_CHARS:
                self._too_long.add(hash(name))
            else:
                self._dropped.add(name)

    def keep(self, metrics: Metrics) -> Metrics:
        """``metrics`` without the names beyond the cap (the same dict when none is dropped); the
        names kept are known from now on."""
        stats = self._stats
        out: Metrics = {}
        for name, value in metrics.items():
            if name not in stats:
                if len(stats) >= self.max_names or len(name) > MAX_METRIC_NAME_CHARS:
                    self._drop(name)
                    continue
                stats[name] = [0, 0.0, 0.0, math.inf, -math.inf, 0]
            out[name] = value
        return metrics if len(out) == len(metrics) else out

    def add(self, metrics: Mapping[str, Number | None]) -> None:
        for name, value in metrics.items():
            stats = self._stats.get(name)
            if stats is None:
                if len(self._stats) >= self.max_names or len(name) > MAX_METRIC_NAME_CHARS:
                    self._drop(name)
                    continue
                stats = self._stats[name] = [0, 0.0, 0.0, math.inf, -math.inf, 0]
            number = _as_finite_float(value)
            if number is None:
                stats[5] += 1
                continue
            stats[0] += 1
            delta = number - stats[1]
            stats[1] += delta / stats[0]
            stats[2] += delta * (number - stats[1])
            if number < stats[3]:
                stats[3] = number
            if number > stats[4]:
                stats[4] = number

    def summary(self) -> MetricsSummary:
        """``{name: {mean, std, min, max, count, skipped}}``; the figures are null when every
        value of a metric was non-finite."""
        out: MetricsSummary = {}
        for name, (count, mean, m2, low, high, skipped) in self._stats.items():
            if count:
                if not math.isfinite(m2):  # overflowed (inf, -inf, nan) near the float limits, as the mean does
                    std = math.nan
                else:
                    std = math.sqrt(m2 / count) if m2 > 0 else 0.0
                out[name] = {
                    "mean": _finite_or_none(mean),
                    "std": _finite_or_none(std),
                    "min": low,
                    "max": high,
                    "count": count,
                    "skipped": skipped,
                }
            else:
                out[name] = {"mean": None, "std": None, "min": None, "max": None, "count": 0, "skipped": skipped}
        return out


def _say_name_too_long(index: int) -> None:
    """The line in the run's stderr log for the first metric name dropped as too long: straight
    to descriptor 2 (the log), whatever the eval made of ``sys.stderr``."""
    text = (
        f"evalsched runner: episode {index} returned a metric name longer than {MAX_METRIC_NAME_CHARS} "
        f"characters; a metric name may have at most {MAX_METRIC_NAME_CHARS} characters: such metrics "
        "are dropped (not aggregated, not written; counted in summary.json's metrics_dropped)\n"
    )
    try:
        os.write(2, text.encode())
    except OSError:
        pass  # closed by the eval: nowhere left to say it


def _finite_or_none(x: float) -> float | None:
    # Only reachable with values near the float limits, where sums overflow.
    return x if math.isfinite(x) else None


def write_json_atomic(path: str, data: object, *, fsync: bool = True, exchange: bool = False) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically for readers.

    The temp file lives in the same directory (``os.replace`` must not cross file systems) and
    its name is unique per process and thread, so concurrent writers never share one. With
    ``exchange``, the names are exchanged rather than renamed over (:mod:`.replace`): no write of
    the file by the file system at the rename, and no guarantee of the old or the new content after
    a power loss without ``fsync``.
    """
    payload = dumps(data).encode()
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{_thread.get_ident()}.tmp")
    fd = os.open(tmp, _WRITE_FLAGS | os.O_TRUNC, _FILE_MODE)
    try:
        _write_all(fd, payload)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        if exchange:
            replace(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# fsync only when the server asks (EvalSchedApp.fsync): the atomic renames already protect
# readers and a crash of any process; fsync adds survival of a host power loss and costs ~4 ms
# each here, three at the end of every run, which would double a short run's turnaround.
DURABLE = os.environ.get("EVALSCHED_FSYNC") == "1"


class RunFiles:
    """The run's single writer of ``episodes.jsonl``, ``summary.json`` and ``_DONE``."""

    def __init__(self, run_dir: str, run_id: str, episodes_total: int, attempt: int = 1) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.episodes_total = episodes_total
        self.attempt = attempt
        self.episodes_done = 0
        # Indices an earlier attempt of this run finished (a resumed run skips them).
        self.done_indices: set[int] = set()
        self.aggregator = MetricAggregator()
        self._said_too_long = False  # the stderr line on a metric name too long, once an attempt
        self.started_at = utc_now_iso()
        self._summary_path = os.path.join(run_dir, SUMMARY_FILE)
        # The first fsync'd intermediate summary comes an interval after the start: the initial
        # one is not worth an fsync on the start-up path.
        self._last_fsync = time.monotonic()
        # Appended to, never truncated: the lines of earlier attempts are the run's checkpoint.
        self._episodes_path = os.path.join(run_dir, EPISODES_FILE)
        self._episodes_fd = os.open(self._episodes_path, _WRITE_FLAGS | os.O_APPEND, _FILE_MODE)
        if os.fstat(self._episodes_fd).st_size:
            self._load_earlier_attempts()

    def _load_earlier_attempts(self) -> None:
        """Fold in the episodes earlier attempts finished, so that the summary covers them all and
        their indices are not run again. A partial last line (an attempt that died while writing
        it) is cut off, so that the next line starts on its own; a line that is not an episode of
        this run counts for nothing; of two lines for one index, the later counts (reference.md)."""
        import json  # resumed runs only: the start-up path of a first attempt never reads JSON lines

        fd = os.open(self._episodes_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            os.ftruncate(self._episodes_fd, complete)
        latest: dict[int, dict[str, Number | None]] = {}
        for raw in data[:complete].split(b"\n"):
            try:
                line = json.loads(raw) if raw.strip() else None
            except (ValueError, RecursionError):  # (RecursionError: nested too deeply to parse)
                continue
            if not isinstance(line, dict):
                continue
            index, metrics = line.get("index"), line.get("metrics")
            if type(index) is not int or not 0 <= index < self.episodes_total or not isinstance(metrics, dict):
                continue
            # null is how a non-finite value was written: the aggregator counts it as skipped.
            latest[index] = {
                k: v for k, v in metrics.items() if isinstance(k, str) and (v is None or type(v) in (bool, int, float))
            }
        for metrics in latest.values():
            self.aggregator.add(metrics)
        self.done_indices.update(latest)
        self.episodes_done = len(self.done_indices)

    def write_initial_summary(self) -> None:
        self._write_summary("running", None, final=False)

    def record_episode(self, index: int, metrics: Metrics, started_at: str, finished_at: str, worker: int) -> None:
        """Append the episode's line, fold its metrics in and rewrite the summary. Metric names
        beyond the cap, or too long, are neither written nor aggregated (the summary counts them;
        the first name too long is also named in the run's stderr log)."""
        if not self._said_too_long and any(len(name) > MAX_METRIC_NAME_CHARS for name in metrics):
            # (this attempt's first: an earlier attempt's lines may have held such a name already)
            self._said_too_long = True
            _say_name_too_long(index)
        metrics = self.aggregator.keep(metrics)
        line = dumps(
            {
                "index": index,
                "metrics": json_safe_metrics(metrics),
                "started_at": started_at,
                "finished_at": finished_at,
                "worker": worker,
                "attempt": self.attempt,
            }
        )
        # One write() per line on an O_APPEND descriptor: a tailing reader never sees two lines
        # interleaved, at worst a trailing partial line.
        _write_all(self._episodes_fd, (line + "\n").encode())
        self.aggregator.add(metrics)
        self.episodes_done += 1
        if self.episodes_done < self.episodes_total:
            self._write_summary("running", None, final=False)
        # else: the last episode's summary is the final one, which finalize() writes next (a
        # "running, all done" state in between would cost a rewrite and tell nobody anything).

    def finalize(self, status: str, error: ErrorInfo | None) -> None:
        """Make the terminal state durable: the episode log's data and the final summary's (before
        its rename). ``_DONE`` comes last, from ``mark_done``, as the process leaves."""
        if self.episodes_done and DURABLE:
            os.fsync(self._episodes_fd)
        os.close(self._episodes_fd)
        self._episodes_fd = -1
        self._write_summary(status, error, final=True)

    def mark_done(self) -> None:
        """Create ``_DONE``, after ``finalize``. It holds no data, so its own descriptor needs no
        fsync; the directory's fsync makes the summary's rename and ``_DONE`` durable together
        (an empty file's existence survives a crash through its directory)."""
        os.close(os.open(os.path.join(self.run_dir, DONE_FILE), _WRITE_FLAGS, _FILE_MODE))
        if DURABLE:
            fsync_directory(self.run_dir)

    def _write_summary(self, status: str, error: ErrorInfo | None, *, final: bool) -> None:
        now = utc_now_iso()
        summary = {
            "run_id": self.run_id,
            "status": status,
            "episodes_done": self.episodes_done,
            "episodes_total": self.episodes_total,
            "metrics": self.aggregator.summary(),
            "started_at": self.started_at,
            "updated_at": now,
            "finished_at": now if final else None,
            "error": error,
        }
        if self.aggregator.dropped:
            summary["metrics_dropped"] = self.aggregator.dropped
        fsync = final and DURABLE
        if not final and DURABLE:
            mono = time.monotonic()
            if mono - self._last_fsync >= INTERMEDIATE_FSYNC_INTERVAL_S:
                fsync = True
                self._last_fsync = mono
        # An intermediate summary replaces the last by an exchange of names: ext4 and btrfs would
        # write each one to disk at its rename (.replace). The final one keeps their write, so
        # that a power loss soon after the run's end finds it whole; so does every one of a run
        # that fsyncs (between its fsync'd summaries, one a second, that write is all it has).
        write_json_atomic(self._summary_path, summary, fsync=fsync, exchange=not final and not DURABLE)
