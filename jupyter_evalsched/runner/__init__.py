"""What runs inside a run subprocess: ``python -m jupyter_evalsched.runner --run-dir DIR``.

The runner reads ``spec.json`` and ``shared_urls.json`` from the run directory, calls the eval's
``episode(ctx, index)`` for every index (in this process, or in forked worker processes when
``workers > 1``), and writes ``episodes.jsonl`` and ``summary.json`` after every episode, then
``_DONE`` last. Disk is its only channel to the server.

Standard library only, and lazily: a run must start in about the time of a bare interpreter,
so nothing here imports pydantic, tornado or the server, and the sub-modules import what they
need when they need it (``multiprocessing`` only with workers, ``logging`` only when the eval
touches ``ctx.log``, ``traceback`` only on failure).

Exit status: 0 when the runner finalized the run (succeeded, or failed by an exception, with
``_DONE`` written); anything else means it did not, and the server finalizes:
``2`` unusable run directory or arguments, ``70`` the expected parent was already gone at start,
``74`` the run files could not be written.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:  # what __getattr__ below resolves, spelled out for the type checker
    from .context import EpisodeContext, UnknownModelError
    from .entrypoint import load_episode_function
    from .results import validate_metrics
    from .run import main
    from .workers import WorkerDied

__all__ = [
    "EpisodeContext",
    "UnknownModelError",
    "WorkerDied",
    "load_episode_function",
    "main",
    "validate_metrics",
]

_EXPORTS = {
    "EpisodeContext": "context",
    "UnknownModelError": "context",
    "WorkerDied": "workers",
    "load_episode_function": "entrypoint",
    "main": "run",
    "validate_metrics": "results",
}


def __getattr__(name: str) -> object:  # PEP 562: keep `import jupyter_evalsched.runner` free of sub-module imports
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module_name}"), name)
