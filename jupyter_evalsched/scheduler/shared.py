"""What the scheduler needs of the shared-model host (implemented by shared_models.manager)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


class ModelUnavailable(RuntimeError):
    """A model's host could not be started (it dies before it listens, or never listens in time).
    ``detail`` says how, with the last lines of the host's stderr."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """What the ledger knows of one shared model with VRAM on a GPU (``SharedModels.memory``).

    ``resident``: its VRAM is admitted (from its load's admission until it is unloaded: the host
    may still be starting or loading). ``busy``: a request is in flight. ``idle_s``: since a caller
    last used it. ``unloading``: its host is being stopped (it still holds its VRAM)."""

    name: str
    gpu: int
    vram_mb: int
    idle_unload_s: float | None
    resident: bool = False
    busy: bool = False
    idle_s: float = 0.0
    unloading: bool = False


# How the model host asks the ledger for a model's VRAM before it loads it: the awaitable ends
# once the model is admitted (ModelUnavailable when it can never fit).
LoadGate = Callable[[str], Awaitable[None]]


class SharedModels(Protocol):
    def names(self) -> list[str]:
        """Known model names: a spec naming another is a 422."""
        ...

    def memory(self) -> list[ModelMemory]:
        """The models with VRAM on a GPU: what the ledger holds for them, and how idle they are."""
        ...

    def bind_ledger(self, gate: LoadGate) -> None:
        """From now on a model's load waits for ``gate`` (its VRAM admitted by the ledger)."""
        ...

    def admitted(self, name: str) -> None:
        """The ledger admitted the model's VRAM (with a run that needs it, or for its load)."""
        ...

    async def unload(self, name: str) -> bool:
        """Stop the idle model's host, freeing its VRAM; False when it is in use (or was not
        resident), then nothing is done."""
        ...

    async def urls_for(self, names: list[str]) -> dict[str, str]:
        """Start the hosts of these models if needed; their URLs once they listen.
        ModelUnavailable when a host cannot be started."""
        ...

    def pids(self) -> set[int]:
        """The live host processes (their VRAM is their models', never unmanaged)."""
        ...

    def run_env(self, run_id: str) -> dict[str, str]:
        """Variables for a run that names shared models (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``)."""
        ...


class NoSharedModels:
    """A server without shared models."""

    def names(self) -> list[str]:
        return []

    def memory(self) -> list[ModelMemory]:
        return []

    def bind_ledger(self, gate: LoadGate) -> None:
        pass

    def admitted(self, name: str) -> None:
        pass

    async def unload(self, name: str) -> bool:
        return False

    async def urls_for(self, names: list[str]) -> dict[str, str]:
        if names:
            raise ValueError(f"no shared models are configured (asked for {', '.join(names)})")
        return {}

    def pids(self) -> set[int]:
        return set()

    def run_env(self, run_id: str) -> dict[str, str]:
        return {}
