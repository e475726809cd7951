"""``python -m jupyter_evalsched.runner --run-dir DIR``."""

from __future__ import annotations

import sys

from .run import main


def _exit(code: int) -> None:
    """Run the atexit handlers, flush, create the run's ``_DONE`` (if it finalized) and leave at
    once.

    Skips the interpreter's final wait for non-daemon threads: a thread an eval left running
    must not keep a finished run's process (and its CPU slot) alive after ``_DONE``.
    """
    import atexit
    import os

    from .run import finish

    try:
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
