"""The scheduler's settings, declared once.

Each setting is one trait here: its name, type, default and help. The extension app inherits
them (``c.EvalSchedApp.<name>``, ``--EvalSchedApp.<name>=...``) and builds the scheduler's
``SchedulerConfig`` from its values with one loop over ``SchedulerConfig.class_own_traits()``
(``EvalSchedApp.scheduler_config``): adding a setting is its trait and its use.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from traitlets import Bool, Dict, Enum, Float, Int, List, TraitType, Unicode, default, observe, validate
from traitlets.config import Configurable

from .policy import PolicyConfig

POLICY_SETTINGS = tuple(f.name for f in fields(PolicyConfig))


def env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None


class CliList(List):
    """A List setting that also takes ``--EvalSchedApp.x=[1, 2]`` or ``=a,b`` on the server's
    command line. (traitlets hands an extension's command-line value over as a string, and its
    own ``List.from_string`` fails for typed elements there; the value is validated when set.)"""

    def from_string(self, s: str) -> Any:
        text = s.strip()
        if text.startswith("["):
            return _literal(text)
        return [self._trait.from_string(part.strip()) if self._trait else part.strip() for part in text.split(",")]


class CliDict(Dict):
    """A Dict setting that also takes ``--EvalSchedApp.x={"k": "v"}`` on the command line."""

    def from_string(self, s: str) -> Any:
        value = _literal(s.strip())
        key_trait = self._key_trait
        if isinstance(value, dict) and key_trait is not None:  # JSON keys are strings: {"0": ...}
            value = {key_trait.from_string(k) if isinstance(k, str) else k: v for k, v in value.items()}
        return value


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)


class PathTrait(TraitType[Path, "str | Path"]):
    """A path, given as a string (a setting) or a ``Path``; ``~`` is expanded."""

    info_text = "a path"

    def validate(self, obj: Any, value: Any) -> Path:
        if isinstance(value, str | Path):
            return Path(value).expanduser()
        self.error(obj, value)


class SchedulerConfig(Configurable):
    """What the scheduler, its executors and its policy are told by the server's settings."""

    runs_dir = PathTrait(
        help=(
            "Where run directories live (a relative path: from the server's working directory at"
            " its start). Default: $EVALSCHED_RUNS_DIR, else <jupyter data dir>/evalsched/runs."
        )
    ).tag(config=True)

    @default("runs_dir")
    def _default_runs_dir(self) -> Path:
        return Path(os.environ.get("EVALSCHED_RUNS_DIR") or os.path.join(jupyter_data_dir(), "evalsched", "runs"))

    # Not a setting: the server's root directory (the cwd of a spec without one), set by the app.
    default_cwd = Unicode()

    @default("default_cwd")
    def _default_cwd(self) -> str:
        return os.getcwd()

    reserve_vram_mb = Int(
        512, help="VRAM kept free on each real GPU (CUDA context of the model host, fragmentation)."
    ).tag(config=True)

    usable_vram_mb = CliDict(
        key_trait=Int(),
        value_trait=Int(),
        help="Per-device usable VRAM in MB, {gpu_index: mb}; wins over everything else.",
    ).tag(config=True)

    default_usable_vram_mb = Int(
        None, allow_none=True, help="Usable VRAM for every device. Default: $EVALSCHED_USABLE_VRAM_MB."
    ).tag(config=True)

    @default("default_usable_vram_mb")
    def _default_usable(self) -> int | None:
        return env_int("EVALSCHED_USABLE_VRAM_MB")

    host_ledger = Unicode(
        help="The Unix socket of the host ledger (jupyter evalsched host-ledger) that grants the GPUs of a host "
        "shared by several users: devices and usable VRAM then come from it, and each run's start and lease's "
        "grant is granted there first. Default: $EVALSCHED_HOST_LEDGER. Empty: this server alone holds the GPUs."
    ).tag(config=True)

    @default("host_ledger")
    def _default_host_ledger(self) -> str:
        return os.environ.get("EVALSCHED_HOST_LEDGER", "").strip()

    cpu_slots = Int(help="CPU slots runs may take. Default: $EVALSCHED_CPU_SLOTS, else the host's cores.").tag(
        config=True
    )

    @default("cpu_slots")
    def _default_cpu_slots(self) -> int:
        return env_int("EVALSCHED_CPU_SLOTS") or os.cpu_count() or 1

    @validate("cpu_slots")
    def _check_cpu_slots(self, proposal: dict[str, Any]) -> int:
        value: int = proposal["value"]
        if value < 1:
            raise ValueError("cpu_slots must be at least 1")
        return value

    cancel_grace_s = Float(10.0, help="Seconds between SIGTERM and SIGKILL when a run is cancelled or times out.").tag(
        config=True
    )
    reconcile_interval_s = Float(
        1.0,
        help="How often the scheduler reconciles what it knows with the host (missed exits, SLURM's states, "
        "unwritten records, observed usage); admission itself happens on events.",
    ).tag(config=True)
    progress_interval_s = Float(0.2, help="How often running runs' summary.json files are checked for progress.").tag(
        config=True
    )
    fsync = Bool(False, help="fsync run files on every write (survives power loss, costs throughput).").tag(config=True)
    run_env = CliDict(value_trait=Unicode(), help="Environment added to every run (under the spec's own env).").tag(
        config=True
    )
    default_executor = Enum(
        ["local", "slurm"], "local", help="Where runs execute when their spec does not say: 'local' or 'slurm'."
    ).tag(config=True)

    # Leases (docs/reference.md, "Lease record").
    max_lease_ttl_s = Float(
        3600.0,
        help="The longest a lease without a pid is held: one that gives no ttl_s gets this one, and a longer "
        "ttl_s is refused (422). A lease with a pid ends when its process exits.",
    ).tag(config=True)
    max_leases = Int(
        256, help="Live (queued and granted) leases this server keeps at once; one more is refused (409)."
    ).tag(config=True)

    @validate("max_lease_ttl_s", "max_leases")
    def _check_lease_limits(self, proposal: dict[str, Any]) -> float:
        if not proposal["value"] > 0:
            raise ValueError(f"{proposal['trait'].name} must be > 0")
        return proposal["value"]

    # Admission (``policy.PolicyConfig``: see ``policy``).
    starvation_s = Float(600.0, help="A head-of-queue job waiting this long gets its resources reserved.").tag(
        config=True
    )
    starvation_passes = Int(50, help="... or after being passed over this many times.").tag(config=True)
    aging_s = Float(3600.0, help="A queued job is promoted one priority lane per this many seconds of waiting.").tag(
        config=True
    )
    preemption = Bool(
        True,
        help="A waiting job of a higher lane that cannot fit otherwise may stop preemptible runs of lower lanes "
        "(scheduling.preemptible) at an episode boundary; they resume later.",
    ).tag(config=True)
    preempt_min_runtime_s = Float(
        60.0, help="A run is preempted only after it has run this long (in its current attempt)."
    ).tag(config=True)
    max_preemptions = Int(3, help="A run preempted this many times is not preempted again.").tag(config=True)

    # Observed usage against declarations (docs/reference.md, "Observed usage").
    enforce_vram = Enum(
        ["off", "warn", "kill"],
        "warn",
        help="A run observed using more VRAM than it declared (beyond vram_tolerance): 'warn' (a warning on the "
        "run, an event), 'kill' (it is stopped, failed with over_vram), or 'off'.",
    ).tag(config=True)
    vram_tolerance = Float(0.1, help="How far above its declaration a run may go before enforce_vram acts.").tag(
        config=True
    )
    auto_margin = Float(
        0.1, help="marginal_vram_mb 'auto' declares the highest observed peak of earlier runs plus this fraction."
    ).tag(config=True)

    # Attempts (docs/reference.md, "Attempts"); the preemption guard rails are above.
    auto_resume = Bool(
        False,
        help="Runs interrupted by the server's death or shutdown are queued again at start (in their queue order) "
        "and resume from their episodes.jsonl, instead of ending aborted.",
    ).tag(config=True)
    retry_backoff_s = Float(
        10.0, help="A run's first automatic retry (spec 'retries') waits this long; each next one twice as long."
    ).tag(config=True)
    retry_backoff_max_s = Float(600.0, help="The longest back-off before an automatic retry.").tag(config=True)
    preempt_grace_s = Float(
        30.0, help="How long a preempted run has to reach its next episode boundary before it is signalled."
    ).tag(config=True)

    # Warm starts: runs forked from a zygote that preloaded these.
    warm_start = Bool(
        True,
        help="Fork runs from a pre-started interpreter (a zygote) that has imported the runner and "
        "preload_modules, so that a run does not pay for those imports. Runs whose spec sets "
        "fresh_interpreter, detached runs, and any run the zygote is in doubt about start cold.",
    ).tag(config=True)
    preload_modules = CliList(
        Unicode(),
        help="Modules the zygote imports before it forks runs (e.g. torch, transformers, numpy); they must not "
        "start threads or initialise CUDA at import. Default: $EVALSCHED_PRELOAD, comma-separated.",
    ).tag(config=True)

    @default("preload_modules")
    def _default_preload(self) -> list[str]:
        return [m.strip() for m in os.environ.get("EVALSCHED_PRELOAD", "").split(",") if m.strip()]

    max_zygotes = Int(
        4, help="Zygotes kept at once, one per run environment (runs whose environment differs where it matters)."
    ).tag(config=True)
    zygote_idle_s = Float(
        600.0, help="A zygote for another environment than the server's own is closed after this long unused."
    ).tag(config=True)
    zygote_start_timeout_s = Float(
        60.0,
        help="A zygote not ready this long after its start (a preload module that never returns) is killed; "
        "the runs waiting for it start cold, and so do the next runs of its environment, for 10 minutes, "
        "without waiting. 0: no deadline.",
    ).tag(config=True)

    _policy: PolicyConfig | None = None

    @property
    def policy(self) -> PolicyConfig:
        """The admission policy's settings as the pure policy takes them (a plain dataclass),
        made once: admission reads them for every queued job."""
        if self._policy is None:
            self._policy = PolicyConfig(**{name: getattr(self, name) for name in POLICY_SETTINGS})
        return self._policy

    @observe(*POLICY_SETTINGS)
    def _policy_changed(self, change: Any) -> None:
        self._policy = None

    @classmethod
    def from_settings(cls, settings: Any, **given: Any) -> SchedulerConfig:
        """The config of ``settings`` (an object with these traits: the app), ``given`` winning."""
        values = {name: _copy(getattr(settings, name)) for name in cls.class_own_traits()}
        return cls(**{**values, **given})


def _copy(value: Any) -> Any:
    """Lists and dicts copied: the scheduler's config does not change with the app's settings."""
    if isinstance(value, list | dict):
        return type(value)(value)
    return value
