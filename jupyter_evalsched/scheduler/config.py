"""The scheduler's settings (filled from the extension's traitlets by the app)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import policy


@dataclass
class SchedulerConfig:
    runs_dir: Path
    cpu_slots: int = field(default_factory=lambda: os.cpu_count() or 1)
    reserve_mb: int = 0
    usable_override: dict[int, int] = field(default_factory=dict)
    env_usable_mb: int | None = None
    policy: policy.PolicyConfig = field(default_factory=policy.PolicyConfig)
    cancel_grace_s: float = 10.0
    sweep_interval_s: float = 1.0
    progress_interval_s: float = 0.2
    default_cwd: str = field(default_factory=os.getcwd)
    fsync: bool = False
    # Environment given to every run on top of the server's (e.g. PYTHONPATH for tests).
    run_env: dict[str, str] = field(default_factory=dict)
    default_executor: str = "local"
    # Observed against declared (DESIGN.md "Observed usage, enforcement, learned declarations").
    enforce_vram: str = "warn"  # "off" | "warn" | "kill"
    vram_tolerance: float = 0.1
    auto_margin: float = 0.1
    # Attempts (DESIGN.md "Attempts, resume, retries, preemption, detached runs"); the preemption
    # guard rails are in ``policy``.
    auto_resume: bool = False
    retry_backoff_s: float = 10.0
    retry_backoff_max_s: float = 600.0
    preempt_grace_s: float = 30.0
    # Warm starts (DESIGN.md "Warm starts"): runs forked from a zygote that preloaded these.
    warm_start: bool = True
    preload_modules: list[str] = field(default_factory=list)
    max_zygotes: int = 4
    zygote_idle_s: float = 600.0
