"""jupyter_evalsched: one evaluation scheduler per host, inside the Jupyter server.

This module stays cheap to import: the run subprocess imports the package too, so nothing
heavy (pydantic, tornado, jupyter_server) is imported here. The entry points import lazily.
"""

from ._version import __version__

__all__ = ["__version__", "compare", "lease", "model", "openai_client", "sweep"]


def lease(*args, **kwargs):
    """Hold VRAM for this process in the host's ledger (see :func:`jupyter_evalsched.client.lease.lease`)."""
    from .client.lease import lease as _lease

    return _lease(*args, **kwargs)


def model(name, **kwargs):
    """The host's shared model ``name``, as runs get it (see :func:`jupyter_evalsched.client.lease.model`)."""
    from .client.lease import model as _model

    return _model(name, **kwargs)


def openai_client(**kwargs):
    """An ``openai.OpenAI`` client of this host's shared models (``/evalsched/v1``): inside a run
    that names models, from its ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; elsewhere (a kernel),
    for the server ``EvalSchedClient()`` finds, with its token. ``kwargs`` go to ``openai.OpenAI``.

    A run whose spec names no model has no key: it is an error (never the server's token, which
    would answer for every model, none of them admitted with the run)."""
    import os

    run_id = os.environ.get("EVALSCHED_RUN_ID")
    if run_id:
        from .openai_keys import PREFIX

        base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
        # The scheduler's variables, not ones the run inherited (a key of the user's own).
        if not (base_url and api_key and api_key.startswith(f"{PREFIX}{run_id}-")):
            from .client.errors import EvalSchedClientError

            raise EvalSchedClientError(
                f"run {run_id} has no key for the shared models' OpenAI API (the scheduler sets "
                "OPENAI_BASE_URL and OPENAI_API_KEY for a run that names models): "
                "name the model in the spec's `models` (`--model NAME`)"
            )
        import openai

        return openai.OpenAI(base_url=base_url, api_key=api_key, **kwargs)
    import openai

    from .client.rest_client import EvalSchedClient

    client = EvalSchedClient()
    base = client.base_url.rstrip("/") + "/evalsched/v1"
    return openai.OpenAI(base_url=base, api_key=client.token or "none", **kwargs)


def sweep(spec, sweep, **kwargs):
    """Submit ``spec`` at every point of ``sweep`` (a grid ``{"param": [values]}`` or a list of
    points); returns a :class:`~jupyter_evalsched.client.SweepHandle`. ``client=`` to choose
    the server."""
    from .client.rest_client import EvalSchedClient

    client = kwargs.pop("client", None) or EvalSchedClient()
    return client.sweep_handle(client.submit_sweep(spec, sweep, **kwargs))


def compare(runs=None, *, sweep=None, baseline=None, client=None):
    """Runs (ids, handles or records) or a sweep side by side, as a pandas DataFrame with a
    ``.plot(metric, x=param)`` (see :func:`jupyter_evalsched.client.comparison.compare`)."""
    from .client.comparison import compare as _compare
    from .client.rest_client import EvalSchedClient

    return _compare(client or EvalSchedClient(), runs, sweep=sweep, baseline=baseline)


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
