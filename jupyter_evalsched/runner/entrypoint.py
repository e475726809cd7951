"""Resolve a spec's entrypoint to the episode function.

``pkg.module:function`` is imported with the working directory on ``sys.path``, as
``python -m`` would. ``path/to/file.py:function`` is loaded by path, relative to the working
directory (the server starts runs in the spec's ``cwd``), except ``eval.py:...``, which is the
run directory's (written from the spec's ``source``). Files are loaded under a unique module
name, so their ``if __name__ == "__main__":`` blocks do not run.
"""

from __future__ import annotations

import errno
import os
import sys

from ..contract import EVAL_SOURCE_FILE, is_file_target, split_entrypoint

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from types import ModuleType

    from .context import EpisodeFunction

__all__ = ["is_file_target", "load_episode_function", "resolve_entrypoint_file", "split_entrypoint"]


def resolve_entrypoint_file(entrypoint: str, run_dir: str | None, cwd: str) -> str | None:
    """The file a file entrypoint names, as the runner loads it; None for a module entrypoint.

    The one resolver: the server validates a spec with it (``run_dir`` None: the run directory
    does not exist yet, and ``eval.py`` is then not checked) and the runner loads with it. A
    relative path is relative to ``cwd``; ``~`` is the user's home; ``eval.py`` is the run
    directory's. ValueError for a malformed entrypoint.
    """
    target, _ = split_entrypoint(entrypoint)
    if not is_file_target(target):
        return None
    if target == EVAL_SOURCE_FILE:
        return os.path.join(run_dir, EVAL_SOURCE_FILE) if run_dir is not None else None
    return os.path.abspath(os.path.join(cwd, os.path.expanduser(target)))


def load_episode_function(entrypoint: str, run_dir: str, cwd: str | None = None) -> EpisodeFunction:
    """Import the entrypoint's module and return its function.

    Raises what a user needs to see: ValueError for a malformed entrypoint, FileNotFoundError
    for a missing file, ModuleNotFoundError (or whatever the module raises while it is being
    imported), AttributeError when the module has no such function, TypeError when the name is
    not callable.
    """
    target, func_name = split_entrypoint(entrypoint)
    cwd = cwd or os.getcwd()
    path = resolve_entrypoint_file(entrypoint, run_dir, cwd)
    if path is not None:
        module = _load_file(path)
    else:
        from importlib import import_module

        if cwd not in sys.path:  # `python -m` puts it first; make sure, whatever the flags
            sys.path.insert(0, cwd)
        try:
            module = import_module(target)
        except ModuleNotFoundError as exc:
            if not exc.name or not (target == exc.name or target.startswith(exc.name + ".")):
                raise  # a module the eval imports is missing: its own message says which
            # The entrypoint's own module: say where it is looked for, and the other way.
            raise ModuleNotFoundError(
                f"{exc}: the entrypoint's module must be importable by the server's Python (installed "
                f"there, or under the run's cwd {cwd}); or name a file: 'path/to/file.py:{func_name}'",
                name=exc.name,
            ) from None
    func: object = getattr(module, func_name, None)
    if func is None:
        raise AttributeError(f"module {target!r} has no function {func_name!r}")
    if not callable(func):
        raise TypeError(f"{target}:{func_name} is a {type(func).__name__}, not a function")
    return func


def _load_file(path: str) -> ModuleType:
    import importlib.util

    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "entrypoint file not found", path)
    # As `python path/to/file.py` would, let the file import its neighbours.
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    stem = "".join(c if c.isalnum() or c == "_" else "_" for c in os.path.splitext(os.path.basename(path))[0])
    name = f"_evalsched_entry_{stem}"
    suffix = 1
    while name in sys.modules:
        suffix += 1
        name = f"_evalsched_entry_{stem}_{suffix}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module", path=path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, like any import: dataclasses, pickle and typing look it up.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
