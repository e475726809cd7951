"""The run process: ``python -m jupyter_evalsched.runner --run-dir DIR``.

Failure semantics (see also the package docstring for exit codes):

* Anything the eval raises fails the run, which the runner finalizes (``summary.json`` with
  ``status: failed`` and ``error``, then ``_DONE``; exit 0). That includes every
  ``BaseException``: ``SystemExit`` (``sys.exit(n)`` in an episode, whatever ``n``: an eval that
  exits early did not complete its episodes, so it cannot have succeeded) and
  ``KeyboardInterrupt`` raised by the eval's code.
* ``_DONE`` is the process's last act (``finish``, from the entry point's exit): after the
  ``atexit`` handlers and the flush of its output, right before it leaves, so that nothing of the
  run happens after it and what the run holds is released moments after it appears. Nothing the
  eval left running holds it back for long: not a non-daemon thread (not waited for), nor a
  ``multiprocessing`` child (``multiprocessing`` joins it at the exit: ``leftover_children``
  gives it a few seconds, then terminates it and says so in the log).
* Signals are not exceptions here. SIGINT is reset to its default action, like SIGTERM, so an
  interrupt from outside ends the process like a cancel, and the server records it. No handler
  finalizes on a signal: on cancel the server signals the process group and finalizes itself.
* A ``_STOP`` file in the run directory (the server preempts the run) stops it at the next
  episode boundary, workers included: the episodes finished so far are in ``episodes.jsonl``,
  the run is not finalized and the runner exits ``EXIT_STOPPED``; a later attempt (resume) skips
  them. Every attempt appends to ``episodes.jsonl`` and runs only the indices it lacks.
* Only the run's own process finalizes. A child the eval forks that comes back through the
  runner's frames (its episode returns, raises or calls ``sys.exit``, a failed ``exec``) exits
  there as the interpreter would end it, at once, without touching the run's files (nor, in a
  worker, its pipe); the run goes on.
* A process exit the runner cannot intercept (``os._exit``, a segfault, SIGKILL) leaves the run
  unfinalized; the server records ``exit_code:<n>`` or ``signal:<NAME>``. With workers, a
  worker's death is seen by the run process, which finalizes the run as failed with a
  ``WorkerDied`` error naming the signal or exit code and the episode.
"""

from __future__ import annotations

# _signal, not signal: the latter imports enum (~5 ms here) for its IntEnum wrappers.
import _signal
import os
import sys

from ..contract import (
    DEFAULT_SOURCE_ENTRYPOINT,
    DONE_FILE,
    EXIT_STOPPED,
    SHARED_URLS_FILE,
    SPEC_FILE,
    STOP_FILE,
    split_entrypoint,
)
from . import fastjson
from ._proc import (
    DONE_NOTICE,
    EXIT_PARENT_GONE,
    NotInCgroup,
    ensure_in_cgroup,
    expected_parent_pid,
    flush_stdio,
    leave_if_forked,
    parent_is_gone,
    set_parent_death_signal,
)
from ._proc import say as _say

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from typing import Any

    from .context import EpisodeFunction
    from .errors import ErrorInfo
    from .results import RunFiles

EXIT_FINALIZED = 0
EXIT_USAGE = 2  # bad arguments or an unusable run directory (no spec.json)
EXIT_IO_ERROR = 74  # the run files could not be written (EX_IOERR): the server finalizes


_USAGE = "usage: python -m jupyter_evalsched.runner --run-dir DIR"


def parse_args(argv: list[str]) -> str | None:
    """The ``--run-dir`` value, or None when the arguments are wrong. (No argparse: it costs
    milliseconds of import on every run.)"""
    if len(argv) == 2 and argv[0] == "--run-dir" and argv[1]:
        return argv[1]
    if len(argv) == 1 and argv[0].startswith("--run-dir=") and len(argv[0]) > len("--run-dir="):
        return argv[0][len("--run-dir=") :]
    return None


class RunSpec:
    """The fields of ``spec.json`` the runner uses, checked. The server has validated the spec
    and filled its defaults; this guards against a hand-written or damaged file."""

    __slots__ = ("entrypoint", "episodes", "workers", "seed", "params")

    def __init__(self, raw: object) -> None:
        if not isinstance(raw, dict):
            raise ValueError(f"{SPEC_FILE} must hold a JSON object, not {type(raw).__name__}")
        entrypoint = raw.get("entrypoint")
        if entrypoint is None:
            if raw.get("source") is None:
                raise ValueError(f"{SPEC_FILE} has neither 'entrypoint' nor 'source'")
            entrypoint = DEFAULT_SOURCE_ENTRYPOINT
        split_entrypoint(entrypoint)  # raises ValueError for a malformed one
        self.entrypoint: str = entrypoint
        self.episodes = _int_field(raw, "episodes", 1, minimum=0)
        self.workers = _int_field(raw, "workers", 1, minimum=1)
        self.seed = _int_field(raw, "seed", 0)
        params = raw.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"{SPEC_FILE}: 'params' must be an object, got {type(params).__name__}")
        self.params: dict[str, Any] = params


def _int_field(raw: dict[str, Any], name: str, default: int, minimum: int | None = None) -> int:
    value = raw.get(name)
    if value is None:
        return default
    if type(value) is not int or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{SPEC_FILE}: {name!r} must be an integer{bound}, got {value!r:.80}")
    return value


def read_shared_urls(run_dir: str) -> dict[str, str]:
    """``{name: url}`` from ``shared_urls.json``; no file means no shared models."""
    try:
        with open(os.path.join(run_dir, SHARED_URLS_FILE), "rb") as f:
            raw = fastjson.loads(f.read())
    except FileNotFoundError:
        return {}
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        raise ValueError(f'{SHARED_URLS_FILE} must look like {{"models": {{"<name>": "<url>"}}}}')
    return models


def _line_buffer_stdio() -> None:
    # stdout is a file (stdout.log): block-buffered by default, so prints would appear late or,
    # after a crash, never. Line buffering makes logs tail live. (stderr is line-buffered already.)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (OSError, ValueError):
                pass


def attempt_number() -> int:
    """``EVALSCHED_ATTEMPT``: 1 for a run's first attempt, more when it is resumed."""
    raw = os.environ.get("EVALSCHED_ATTEMPT", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def main(argv: list[str] | None = None) -> int:
    # First thing: die with the parent, then make sure the parent did not die before that. A
    # detached run (spec ``detach``) outlives the server on purpose: no death signal.
    if os.environ.get("EVALSCHED_DETACH") != "1":
        set_parent_death_signal()
    expected = expected_parent_pid()
    if parent_is_gone(expected):
        _say(f"the parent process {expected} is gone (parent is now {os.getppid()}); not starting")
        return EXIT_PARENT_GONE
    if argv is None:
        _take_notice_argument()
    return main_checked(argv)


def main_checked(argv: list[str] | None = None) -> int:
    """The run, once its life is tied to its parent's (by ``main``, or by the zygote that forked
    it: see ``zygote.become_run``)."""
    run_dir = parse_args(sys.argv[1:] if argv is None else argv)
    if run_dir is None:
        _say(_USAGE)
        return EXIT_USAGE
    run_dir = os.path.abspath(run_dir)
    spec_path = os.path.join(run_dir, SPEC_FILE)
    if not os.path.isfile(spec_path):
        _say(f"{run_dir} is not a usable run directory: {SPEC_FILE} is missing")
        return EXIT_USAGE
    if os.path.lexists(os.path.join(run_dir, DONE_FILE)):
        _say(f"{run_dir} is already finalized ({DONE_FILE} exists); not running it again")
        return EXIT_USAGE

    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    _line_buffer_stdio()

    try:
        with open(spec_path, "rb") as f:
            spec_bytes = f.read()
    except OSError as exc:
        _say(f"cannot read {spec_path}: {exc}")
        return EXIT_USAGE
    return _run(run_dir, spec_bytes)


_finalized: RunFiles | None = None  # a run whose summary is final: _DONE is due at the exit
# The run's own process: the only one that may write its files and finalize it (the eval may fork
# children that come back through the runner's frames).
_run_pid: int | None = None
# The run's socket to the server, told DONE_NOTICE once _DONE exists: (descriptor, the socket's
# device and inode, the run's pid) as ``set_done_notice`` found them.
_done_notice: tuple[int, int, int, int] | None = None
NOTICE_FLAG = "--notice-fd"  # a cold run's: the descriptor of that socket (last on its command line)


def set_done_notice(fd: int) -> None:
    """Keep the server's socket ``fd`` for ``finish``, moved to the lowest free descriptor
    (close-on-exec: a subprocess does not inherit it), so that warm and cold runs show the eval
    the same descriptors."""
    global _done_notice
    low = os.dup(fd)  # the lowest free one
    if low > fd:  # every one below fd is taken: fd is the lowest
        os.close(low)
        low = fd
        os.set_inheritable(fd, False)
    else:
        os.close(fd)
    st = os.fstat(low)
    _done_notice = (low, st.st_dev, st.st_ino, os.getpid())


def _tell_done() -> None:
    """The word, from the run's own process only (not a child the eval forked that ends through
    the runner), and on that socket only: the eval may have closed it and reused its number."""
    notice = _done_notice
    if notice is None:
        return
    fd, dev, ino, pid = notice
    if os.getpid() != pid:
        return
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (dev, ino):
            # (A closed peer answers EPIPE on this kind of socket, never SIGPIPE.)
            os.write(fd, DONE_NOTICE)
    except OSError:
        pass  # the server is gone, or the eval closed the descriptor: the exit tells it


def _take_notice_argument() -> None:
    """A cold run's ``--notice-fd N``: kept, and taken out of ``sys.argv`` (and ``orig_argv``) so
    that the eval sees the arguments a warm run has."""
    args = sys.argv
    if len(args) < 3 or args[-2] != NOTICE_FLAG:
        return
    value = args[-1]
    del args[-2:]
    orig = sys.orig_argv
    if len(orig) >= 2 and orig[-2] == NOTICE_FLAG:
        del orig[-2:]
    if value.isdigit() and int(value) > 2:
        try:
            set_done_notice(int(value))
        except OSError:
            pass  # not open: the run's exit alone tells the server


def finish(code: int) -> int:
    """The exit code to leave with, once the run's ``_DONE`` is created (if the run finalized):
    called by the entry point after the ``atexit`` handlers and the flush, right before the
    process exits."""
    global _finalized
    files, _finalized = _finalized, None
    if files is None or code != EXIT_FINALIZED or os.getpid() != _run_pid:
        return code
    try:
        files.mark_done()
    except OSError as exc:
        _say(f"cannot write the run files in {files.run_dir}: {exc}; the run is not finalized")
        return EXIT_IO_ERROR
    # The server may hand a CPU slot on now, rather than once the kernel has torn this process
    # down (which takes longer than a no-op run's whole episode).
    _tell_done()
    return code


def _run(run_dir: str, spec_bytes: bytes) -> int:
    global _finalized, _run_pid
    from .errors import describe_exception
    from .results import RunFiles

    run_pid = _run_pid = os.getpid()

    raw: object = None
    spec: RunSpec | Exception  # the spec, or why it is unusable
    try:
        raw = fastjson.loads(spec_bytes)
        spec = RunSpec(raw)
    except Exception as exc:
        spec = exc

    if isinstance(spec, RunSpec):
        episodes_total = spec.episodes
    else:  # still report the intended size when only another field is wrong
        guess = raw.get("episodes") if isinstance(raw, dict) else None
        episodes_total = guess if type(guess) is int and guess >= 0 else 0

    try:
        files = RunFiles(run_dir, os.path.basename(run_dir), episodes_total, attempt_number())
        files.write_initial_summary()
    except OSError as exc:
        _say(f"cannot write the run files in {run_dir}: {exc}")
        return EXIT_IO_ERROR

    try:
        error: ErrorInfo | _Stopped | None
        if isinstance(spec, RunSpec):
            try:
                ensure_in_cgroup(files.run_id)  # before any user code runs or any worker is forked
            except NotInCgroup as exc:
                error = describe_exception(exc)
            else:
                try:
                    error = _run_episodes(spec, run_dir, files)
                except OSError:
                    raise  # the run files: the server finalizes (below)
                except Exception as exc:
                    # A failure of the runner's own, where the eval gave it what it did not
                    # expect: the run still ends failed, and says why, rather than crash unfinalized
                    # (which would count as a crash, and be retried).
                    error = describe_exception(exc)
        else:
            error = describe_exception(spec)
        leave_if_forked(run_pid)  # (the episodes check it at each return of the eval's code)
        if isinstance(error, _Stopped):
            left = files.episodes_total - files.episodes_done
            _say(f"stopped at an episode boundary ({STOP_FILE}): {files.episodes_done} episodes done, {left} left")
            return EXIT_STOPPED
        if error is not None:
            where = f"episode {error['episode']}" if error.get("episode") is not None else "before its episodes"
            _say(f"run failed ({where}):\n{error['traceback']}".rstrip("\n"))
        files.finalize("failed" if error is not None else "succeeded", error)
        _finalized = files
    except OSError as exc:
        _say(f"cannot write the run files in {run_dir}: {exc}; the run is not finalized")
        return EXIT_IO_ERROR
    return EXIT_FINALIZED


class _Stopped:
    """What ``_run_episodes`` returns when ``_STOP`` stopped the run between two episodes."""

    def __repr__(self) -> str:
        return "STOPPED"


STOPPED = _Stopped()


def _run_episodes(spec: RunSpec, run_dir: str, files: RunFiles) -> ErrorInfo | _Stopped | None:
    """Run every episode earlier attempts did not; None on success, STOPPED when ``_STOP``
    stopped it, else the ``error`` object of the failure."""
    from .context import ContextFactory, ModelRegistry, parse_devices
    from .entrypoint import load_episode_function
    from .errors import describe_exception
    from .results import utc_now_iso, validate_metrics

    try:
        urls = read_shared_urls(run_dir)
        cwd = os.getcwd()
    except Exception as exc:
        return describe_exception(exc)

    make_ctx = ContextFactory(
        params=spec.params,
        seed=spec.seed,
        devices=parse_devices(),
        run_dir=run_dir,
        run_id=files.run_id,
        episodes=spec.episodes,
        models=ModelRegistry(urls),
        attempt=files.attempt,
    )

    def load_episode() -> EpisodeFunction:
        # (Imported here, once the eval is: not on the runner's start-up path.)
        from .async_episodes import episode_caller

        # An ``async def episode`` is run on the process's own event loop (docs/reference.md,
        # "The run process"; docs/first-run.md).
        return episode_caller(load_episode_function(spec.entrypoint, run_dir, cwd))

    done = files.done_indices
    indices = [i for i in range(spec.episodes) if i not in done] if done else list(range(spec.episodes))
    stop_path = os.path.join(run_dir, STOP_FILE)

    def stop_requested() -> bool:
        return os.path.lexists(stop_path)  # one stat per episode

    if spec.workers > 1 and len(indices) > 1:
        from .workers import run_in_workers

        outcome = run_in_workers(
            min(spec.workers, len(indices)), indices, load_episode, make_ctx, files.record_episode, stop_requested
        )
        return STOPPED if outcome == "stopped" else outcome

    # One worker: the episodes run in this process; nothing to fork, nothing to import.
    if not indices:
        return None
    if stop_requested():
        return STOPPED
    pid = os.getpid()
    try:
        episode = load_episode()
    except BaseException as exc:
        leave_if_forked(pid, exc)
        return describe_exception(exc)
    leave_if_forked(pid)
    for position, index in enumerate(indices):
        if position and stop_requested():
            return STOPPED
        started_at = utc_now_iso()
        try:
            metrics = validate_metrics(episode(make_ctx(index), index), index)
        except BaseException as exc:
            leave_if_forked(pid, exc)
            flush_stdio()
            return describe_exception(exc, index)
        leave_if_forked(pid)
        finished_at = utc_now_iso()
        flush_stdio()  # a print without a newline would otherwise wait in the buffer
        files.record_episode(index, metrics, started_at, finished_at, pid)
    return None
