"""The ``ctx`` an episode receives, and the per-process cache of shared-model clients."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

    from jupyter_evalsched.shared_models.client import ModelClient

    from .eval_log import EvalLogger

    # The eval's ``episode(ctx, index)``: returns its metrics (validated by validate_metrics).
    EpisodeFunction = Callable[["EpisodeContext", int], object]


class UnknownModelError(KeyError):
    """``ctx.model(name)`` for a name the run was not given. A KeyError, so ``except KeyError``
    works, with a readable message (KeyError's own ``str`` would quote it)."""

    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        listed = ", ".join(repr(n) for n in available) if available else "none"
        self.message = (
            f"unknown shared model {name!r}; this run has: {listed} "
            f"(name the models a run uses in the spec's 'models' list)"
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ModelRegistry:
    """Clients of the server's shared models, created on first use and cached per name."""

    def __init__(self, urls: dict[str, str]) -> None:
        self._urls = dict(urls)
        self._clients: dict[str, ModelClient] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._urls)

    def get(self, name: str) -> ModelClient:
        client = self._clients.get(name)
        if client is not None:
            return client
        url = self._urls.get(name)
        if not isinstance(url, str):
            raise UnknownModelError(name, self.names)
        # Imported here, not at start-up: runs that use no shared model never pay for it.
        from jupyter_evalsched.shared_models.client import connect

        client = self._clients[name] = connect(url)
        return client


_eval_logger: EvalLogger | None = None


def eval_logger() -> EvalLogger:
    """The logger behind ``ctx.log``: INFO and up to stderr (the run's ``stderr.log``); calling it
    logs at INFO (``ctx.log("x %s", 1)`` is ``ctx.log.info("x %s", 1)``).

    Built on first use so that evals that never log do not import ``logging``.
    """
    global _eval_logger
    if _eval_logger is None:
        from .eval_log import make_eval_logger

        _eval_logger = make_eval_logger()
    return _eval_logger


def parse_devices(environ: Mapping[str, str] = os.environ) -> list[int]:
    """GPU indices given to this run: ``EVALSCHED_DEVICES`` (comma separated, possibly empty).

    When it is unset (a run started by SLURM rather than our launcher), fall back to
    ``CUDA_VISIBLE_DEVICES`` if it holds plain indices.
    """
    raw = environ.get("EVALSCHED_DEVICES")
    if raw is None:
        raw = environ.get("CUDA_VISIBLE_DEVICES", "")
    devices: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            devices.append(int(part))
        except ValueError:  # a GPU UUID or MIG name in CUDA_VISIBLE_DEVICES: not an index
            return []
    return devices


class EpisodeContext:
    """What ``episode(ctx, index)`` gets.

    ``params`` (the spec's params; shared by all episodes of a process, so treat it as
    read-only), ``index``, ``seed`` (the spec's seed + index), ``devices`` (GPU indices, maybe
    empty), ``run_dir`` (str), ``run_id``, ``episodes`` (the total), ``attempt`` (1, or more for
    a resumed run), ``log`` (a ``logging.Logger`` writing to stderr: ``ctx.log.info(...)``,
    ``ctx.log.warning(...)``; ``ctx.log(...)`` logs at INFO) and ``model(name)`` (a client
    of a shared model).
    """

    __slots__ = ("params", "index", "seed", "devices", "run_dir", "run_id", "episodes", "attempt", "_models")

    def __init__(
        self,
        *,
        params: dict[str, Any],
        index: int,
        seed: int,
        devices: list[int],
        run_dir: str,
        run_id: str,
        episodes: int,
        models: ModelRegistry,
        attempt: int = 1,
    ) -> None:
        self.params = params
        self.index = index
        self.seed = seed
        self.devices = devices
        self.run_dir = run_dir
        self.run_id = run_id
        self.episodes = episodes
        self.attempt = attempt
        self._models = models

    @property
    def log(self) -> EvalLogger:
        return eval_logger()

    def model(self, name: str) -> ModelClient:
        """The client of the shared model ``name`` (``client(inputs, **kwargs) -> outputs``)."""
        return self._models.get(name)

    def __repr__(self) -> str:
        return (
            f"EpisodeContext(run_id={self.run_id!r}, index={self.index}, seed={self.seed}, "
            f"devices={self.devices}, models={self._models.names})"
        )


class ContextFactory:
    """Makes the ``ctx`` of each episode from what is fixed for the whole run."""

    __slots__ = ("params", "seed", "devices", "run_dir", "run_id", "episodes", "models", "attempt")

    def __init__(
        self,
        *,
        params: dict[str, Any],
        seed: int,
        devices: list[int],
        run_dir: str,
        run_id: str,
        episodes: int,
        models: ModelRegistry,
        attempt: int = 1,
    ) -> None:
        self.params = params
        self.seed = seed
        self.devices = devices
        self.run_dir = run_dir
        self.run_id = run_id
        self.episodes = episodes
        self.models = models
        self.attempt = attempt

    def __call__(self, index: int) -> EpisodeContext:
        return EpisodeContext(
            params=self.params,
            index=index,
            seed=self.seed + index,
            devices=list(self.devices),
            run_dir=self.run_dir,
            run_id=self.run_id,
            episodes=self.episodes,
            models=self.models,
            attempt=self.attempt,
        )
