"""Process plumbing: the parent-death signal and the parent check that closes its race, the run's
cgroup, its log lines, and what its process's exit must not wait for without end."""

from __future__ import annotations

import _signal  # not `signal`, which imports enum: this module is on the start-up path
import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Exit status when the expected parent died before we could tie our life to it (EX_SOFTWARE).
EXIT_PARENT_GONE = 70
# A run's last word to the server, once its _DONE exists (runner.run.finish): on the socket a
# warm run's spare was asked on (runner.zygote's protocol), or a cold run's --notice-fd.
DONE_NOTICE = b'{"op":"done"}'

_prctl: Callable[..., int] | None = None


def _load_prctl() -> Callable[..., int]:
    """libc's ``prctl`` as a Python callable.

    This is what ``ctypes.CDLL(None, use_errno=True).prctl`` builds, written against ``_ctypes``
    directly: ``import ctypes`` costs ~3 ms of CPU on this project's machines (a fifth of the
    interpreter's own start), these few lines ~1 ms, and this runs at the start of every run.
    Falls back to ``ctypes`` should ``_ctypes`` ever differ.
    """
    try:
        import _ctypes

        # typeshed makes _SimpleCData generic; at run time (3.11) it is not subscriptable.
        class CInt(_ctypes._SimpleCData):  # type: ignore[type-arg]
            _type_ = "i"

        class CFunction(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = CInt

        class Program:  # the running program's symbols, libc's included (dlopen(NULL))
            # typeshed wants a path; dlopen(NULL) (None) is what ctypes.CDLL(None) passes too.
            _handle = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)  # type: ignore[arg-type]

        # typeshed wants a ctypes.CDLL; CFuncPtr only reads the object's `_handle`.
        return CFunction(("prctl", Program()))  # type: ignore[arg-type]
    except Exception:
        import ctypes

        # CDLL(None), not ctypes.util.find_library, which spawns ldconfig (tens of milliseconds).
        return ctypes.CDLL(None, use_errno=True).prctl


def set_parent_death_signal(sig: int = _signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits.

    Linux only; returns False where it is not available. The setting is not inherited across
    ``fork``, so every worker process calls this itself.
    """
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _prctl is None:
            _prctl = _load_prctl()
        return _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stat_fields(pid: int | str = "self") -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from the third (the state) on: field N is at index
    N - 3. Split after the command name's last ')', as the name may hold spaces and parentheses.
    None when it cannot be read (gone, or no ``/proc``)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    name_end = stat.rfind(b")")
    return stat[name_end + 2 :].split() if name_end >= 0 else None


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch, computed as psutil's ``create_time`` is
    (its start in clock ticks since boot, plus the boot time: both from ``/proc``), so that the
    two compare; None when it cannot be read (gone, or no ``/proc``). Without psutil: the zygote,
    which must stay small, tells the server this about each process it forks."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        ticks = int(fields[19])  # starttime (field 22)
        fd = os.open("/proc/stat", os.O_RDONLY)
        try:  # btime comes after a line per CPU and the interrupt counts: read until it is in
            info = b""
            while (at := info.find(b"\nbtime ")) < 0 or info.find(b"\n", at + 1) < 0:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                info += chunk
        finally:
            os.close(fd)
        boot = float(info[at + 7 : info.index(b"\n", at + 1)])
        return ticks / os.sysconf("SC_CLK_TCK") + boot
    except (OSError, ValueError, IndexError):
        return None


def flush_stdio() -> None:
    """Flush stdout and stderr: the run's logs are files, read while the run goes on. Never
    raises: the eval may have closed them, or put anything in their place (no ``flush``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # nothing to save there
            pass


def say(message: str) -> None:
    """A line for the run's stderr log. Never raises: the eval may have replaced ``sys.stderr``
    with anything, or None; then the line goes to descriptor 2 itself."""
    text = f"evalsched runner: {message}\n"
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    except Exception:
        pass
    data = text.encode("utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(2, data) :]
    except OSError:
        pass  # closed by the eval: nowhere left to say it


def end_leftover_children(whose: str = "the run's process") -> None:
    """At the start of a run's process's exit (or a worker's): bound what ``multiprocessing``'s
    exit handler joins, the children the eval left running and its queues' feeder threads
    (``leftover_children``), from when that handler begins: after the eval's ``atexit`` handlers
    registered after ``multiprocessing`` was imported, which may take as long as they need (to
    stop and join those children, say). Nothing is imported where nothing is left to bound.
    Never raises: the exit must go on."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return  # no multiprocessing exit handler: nothing joins at this exit
    try:
        # Run by that handler first among its finalizers of priority 0 (after a Pool's and a
        # queue's closing ones, before a Manager's shutdown and the joins).
        util.Finalize(None, _bound_multiprocessing_joins, args=(whose,), exitpriority=0)
    except Exception as exc:  # the exit waits as Python's does
        say(f"cannot bound the exit's wait for multiprocessing: {type(exc).__name__}: {exc}")


def _bound_multiprocessing_joins(whose: str) -> None:
    try:
        process = sys.modules["multiprocessing.process"]
        util = sys.modules["multiprocessing.util"]
        queues = sys.modules.get("multiprocessing.queues")
        feeder_join = None if queues is None else queues.Queue._finalize_join
        if not process.active_children() and not (
            feeder_join is not None
            and any(getattr(f, "_callback", None) is feeder_join for f in list(util._finalizer_registry.values()))
        ):
            return
        from .leftover_children import bound_joins

        bound_joins(whose, say)
    except Exception as exc:  # (a thread that cannot start, say): the exit waits as Python's does
        say(f"cannot bound the exit's wait for multiprocessing: {type(exc).__name__}: {exc}")


def leave_if_forked(owner: int, exc: BaseException | None = None) -> None:
    """Unless this is process ``owner`` (the run's, or a worker's), which came into the eval's code
    and is back: end this process, a child the eval forked, as the interpreter would have ended
    it with ``exc`` (None: the eval's code returned) uncaught, but at once. It must not go on as
    the run (run the next episodes, write the run's files, finalize it) while the run does: those
    are ``owner``'s. Nor does it run the ``atexit`` handlers, which are the run's, inherited."""
    if os.getpid() == owner:
        return
    code = 0 if exc is None else 1
    try:
        if isinstance(exc, SystemExit):
            value = exc.code
            if value is None or isinstance(value, int):
                code = 0 if value is None else value & 0xFF
            else:
                sys.stderr.write(f"{value}\n")  # (as the interpreter prints a code that is no number)
        elif exc is not None:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        else:  # no exception says why it ended: the log does
            sys.stderr.write(
                f"evalsched runner: process {os.getpid()}, forked by the eval, returned into the runner; "
                "it exits without touching the run\n"
            )
    except BaseException:
        pass  # (stderr removed or broken by the eval: the status says enough)
    flush_stdio()
    os._exit(code)


def expected_parent_pid() -> int | None:
    """The PID in ``EVALSCHED_PARENT_PID``, or None (unset or empty, e.g. under SLURM)."""
    raw = os.environ.get("EVALSCHED_PARENT_PID", "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def parent_is_gone(expected_pid: int | None) -> bool:
    """True when we were reparented away from ``expected_pid``: it died before the death signal
    was armed, so the signal will never come and we must exit on our own."""
    return expected_pid is not None and os.getppid() != expected_pid


# ``EVALSCHED_CGROUP_PROCS`` lists one file per line: a cgroup's path may hold a ":" (a systemd
# unit's, a container's), never a newline (``/proc/self/cgroup`` gives one cgroup per line).
CGROUP_PROCS_ENV = "EVALSCHED_CGROUP_PROCS"


def cgroup_procs_value(files: list[str]) -> str:
    """The value of ``EVALSCHED_CGROUP_PROCS`` for these cgroup.procs files (primary last)."""
    return "\n".join(files)


class NotInCgroup(RuntimeError):
    """The run's process could not join the cgroup the server gave it: it runs no eval code."""


def ensure_in_cgroup(run_id: str) -> None:
    """Join the run's cgroup unless the server has moved us there already; NotInCgroup when it
    cannot (the cgroup removed meanwhile, say): the run then fails before any of its code runs,
    since nothing of it could be contained (killed with it, held to its memory limit).

    A warm run's process is in its cgroup before its request (the zygote's spare placed itself
    there); a cold one is added by the server right after it started, off its event loop (the
    first move into a cgroup can take milliseconds in the kernel); this check, made before any
    user code runs or any worker is forked, closes the race: nothing the eval starts can be
    outside the cgroup. ``EVALSCHED_CGROUP_PROCS`` lists the cgroup.procs files, primary last;
    the cgroup's name (the same in every hierarchy) is their directory's, not the run id.
    """
    value = os.environ.get(CGROUP_PROCS_ENV, "")
    # (":" joined them before: a server started before an upgrade of the package still does so.)
    old_form = "\n" not in value and ":" in value and not os.path.exists(value)
    files = [f for f in value.split(":" if old_form else "\n") if f]
    if not files:
        return
    try:
        with open("/proc/self/cgroup", "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    suffix = "/" + os.path.basename(os.path.dirname(files[-1]))
    if sum(1 for line in lines if line.endswith(suffix)) >= len(files):
        return
    pid = str(os.getpid())
    for path in files:
        try:
            with open(path, "w") as procs:
                procs.write(pid)
        except OSError as exc:
            raise NotInCgroup(
                f"the run's process could not join its cgroup ({path}: {exc.strerror or exc}), so none of the "
                "eval's code ran: it would not have been contained (killed with the run, held to its memory limit)"
            ) from None
