"""Shared model singletons: loaded once per host, used by every run through a URL.

- ``client``: the run side (``connect(url)``), standard library only.
- ``manager``: the server side (``ModelHostManager``), asyncio, owns the host processes.
- ``host``: the model host process (one per shared model); torch/transformers load only there.
- ``config``: validation of the operator's declarations (the ``EvalSchedApp.models`` traitlet).
- ``tiny``, ``loaders``, ``testing``: ready-made loaders (a tiny offline BERT, sentence
  embeddings, and stdlib-only models for tests).

Importing this package imports only the client (standard library), so that runs stay light.
"""

from .client import ModelClient, SharedModelError, connect

__all__ = ["ModelClient", "SharedModelError", "connect"]
