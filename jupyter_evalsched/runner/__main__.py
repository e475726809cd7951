"""``python -m jupyter_evalsched.runner --run-dir DIR``."""

from __future__ import annotations

import sys

from .run import main


def _exit(code: int) -> None:
    """Run the atexit handlers, flush, create the run's ``_DONE`` (if it finalized) and leave at
    once.

    Skips the interpreter's final wait for non-daemon threads: a thread an eval left running
    must not keep a finished run's process (and its CPU slot) alive after ``_DONE``. Nor may a
    ``multiprocessing`` child it left running, which ``multiprocessing``'s own ``atexit`` handler
    joins: it gets a grace, then is terminated (``leftover_children``).
    """
    import atexit
    import os

    from ._proc import end_leftover_children
    from .run import finish

    try:
        end_leftover_children()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(finish(code))


if __name__ == "__main__":
    _exit(main())
