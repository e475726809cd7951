"""Resolve a spec's entrypoint to the episode function.

``pkg.module:function`` is imported with the working directory on ``sys.path``, as
``python -m`` would. ``path/to/file.py:function`` is loaded by path, relative to the working
directory (the server starts runs in the spec's ``cwd``), except ``eval.py:...``, which is the
run directory's (written from the spec's ``source``). Files are loaded under a unique module
name, so their ``if __name__ == "__main__":`` blocks do not run.
"""

import errno
import os
import sys

RUN_DIR_SOURCE_FILE = "eval.py"


def split_entrypoint(entrypoint: str) -> tuple[str, str]:
    if not isinstance(entrypoint, str):
        raise ValueError(f"entrypoint must be a string like 'pkg.module:function', got {entrypoint!r:.80}")
    target, sep, func = entrypoint.rpartition(":")
    if not sep or not target or not func.isidentifier():
        raise ValueError(
            f"invalid entrypoint {entrypoint!r}: expected 'pkg.module:function' or 'path/to/file.py:function'"
        )
    return target, func


def is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def resolve_file_path(target: str, run_dir: str, cwd: str | None = None) -> str:
    if target == RUN_DIR_SOURCE_FILE:
        return os.path.join(run_dir, RUN_DIR_SOURCE_FILE)
    return os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(target)))


def load_episode_function(entrypoint: str, run_dir: str, cwd: str | None = None):
    """Import the entrypoint's module and return its function.

    Raises what a user needs to see: ValueError for a malformed entrypoint, FileNotFoundError
    for a missing file, ModuleNotFoundError (or whatever the module raises while it is being
    imported), AttributeError when the module has no such function, TypeError when the name is
    not callable.
    """
    target, func_name = split_entrypoint(entrypoint)
    cwd = cwd or os.getcwd()
    if is_file_target(target):
        module = _load_file(resolve_file_path(target, run_dir, cwd))
    else:
        from importlib import import_module

        if cwd not in sys.path:  # `python -m` puts it first; make sure, whatever the flags
            sys.path.insert(0, cwd)
        module = import_module(target)
    func = getattr(module, func_name, None)
    if func is None:
        raise AttributeError(f"module {target!r} has no function {func_name!r}")
    if not callable(func):
        raise TypeError(f"{target}:{func_name} is a {type(func).__name__}, not a function")
    return func


def _load_file(path: str):
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
