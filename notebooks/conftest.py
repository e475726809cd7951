"""Run the notebooks against a real server: ``.venv/bin/pytest --nbval-lax notebooks/``.

nbval starts each notebook's kernel when it sets up the notebook, before any fixture of its cells
runs, so the server is started from ``pytest_sessionstart`` instead: a ``jupyter server``
subprocess configured by ``jupyter_server_config.py`` (this folder's: what docs/first-run.md tells
users to start, two virtual 24000 MB GPUs, 8 CPU slots, the ``minilm`` shared model preloaded while
the first notebooks run, a virtual GPU process table), with a temporary runs directory and that
table in a temporary folder. Kernels launched by nbval are not children of the server: they find it
through ``EVALSCHED_URL``/``EVALSCHED_TOKEN``, and the table through
``EVALSCHED_VIRTUAL_GPU_PROCESSES``, set here before any kernel starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from jupyter_evalsched.client import LocalServer

# The server the notebooks need, as users start it (docs/first-run.md).
# (``JUPYTER_CONFIG_PATH=notebooks``: this folder's jupyter_server_config.py.)
NOTEBOOKS_DIR = os.path.dirname(os.path.abspath(__file__))

_server: LocalServer | None = None
_table_dir: str | None = None
_saved_env: dict[str, str | None] = {}


def _running_notebooks(config) -> bool:
    # `pytest -m slow` deselects the notebooks: no server (and no model load) for nothing.
    if (config.getoption("markexpr", default="") or "").strip() == "slow":
        return False
    return bool(config.getoption("nbval", default=False) or config.getoption("nbval_lax", default=False))


def pytest_sessionstart(session):
    global _server
    if not _running_notebooks(session.config) or _server is not None:
        return
    # The virtual GPU process table that the notebooks write into (interactive_lease: a kernel
    # "loads" a model), read by the server's probe as it would read NVML.
    global _table_dir
    _table_dir = tempfile.mkdtemp(prefix="evalsched-gpu-processes-")
    table = os.path.join(_table_dir, "processes.json")
    _server = LocalServer(
        virtual_gpus=None,
        cpu_slots=None,
        env={"JUPYTER_CONFIG_PATH": NOTEBOOKS_DIR, "EVALSCHED_VIRTUAL_GPU_PROCESSES": table},
        extra_args=["--EvalSchedApp.progress_interval_s=0.05", "--EvalSchedApp.reconcile_interval_s=0.3"],
    )
    kernel_env = {**_server.env, "EVALSCHED_VIRTUAL_GPU_PROCESSES": table}
    for key, value in kernel_env.items():
        _saved_env[key] = os.environ.get(key)
        os.environ[key] = value
    os.environ.pop("JPY_PARENT_PID", None)


def pytest_sessionfinish(session, exitstatus):
    global _server
    if _server is None:
        return
    for key, value in _saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _server.cleanup()
    _server = None
    if _table_dir is not None:
        shutil.rmtree(_table_dir, ignore_errors=True)
