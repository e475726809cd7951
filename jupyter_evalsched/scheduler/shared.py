"""What the scheduler needs of the shared-model host (implemented by shared_models.manager)."""

from __future__ import annotations

from typing import Protocol


class ModelUnavailable(RuntimeError):
    """A model's host could not be started (it dies before it listens, or never listens in time).
    ``detail`` says how, with the last lines of the host's stderr."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail


class SharedModels(Protocol):
    def names(self) -> list[str]:
        """Known model names: a spec naming another is a 422."""
        ...

    def baseline_mb_by_device(self) -> dict[int, int]:
        """Declared VRAM of the models placed on each GPU: the ledger's baseline."""
        ...

    async def urls_for(self, names: list[str]) -> dict[str, str]:
        """Start the hosts of these models if needed; their URLs once they listen.
        ModelUnavailable when a host cannot be started."""
        ...

    def pids(self) -> set[int]:
        """The live host processes (their VRAM is the baseline, never unmanaged)."""
        ...

    def run_env(self, run_id: str) -> dict[str, str]:
        """Variables for a run that names shared models (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``)."""
        ...


class NoSharedModels:
    """A server without shared models."""

    def names(self) -> list[str]:
        return []

    def baseline_mb_by_device(self) -> dict[int, int]:
        return {}

    async def urls_for(self, names: list[str]) -> dict[str, str]:
        if names:
            raise ValueError(f"no shared models are configured (asked for {', '.join(names)})")
        return {}

    def pids(self) -> set[int]:
        return set()

    def run_env(self, run_id: str) -> dict[str, str]:
        return {}
