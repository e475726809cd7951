"""jupyter_evalsched: one evaluation scheduler per host, inside the Jupyter server.

This module stays cheap to import: the run subprocess imports the package too, so nothing
heavy (pydantic, tornado, jupyter_server) is imported here. The entry points import lazily.
"""

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_server_extension_points():
    from .app import EvalSchedApp

    return [{"module": "jupyter_evalsched", "app": EvalSchedApp}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "jupyter-evalsched"}]


def load_ipython_extension(ipython):
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
