"""The Jupyter server extension: configuration, the scheduler singleton, the REST handlers."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from jupyter_core.paths import jupyter_data_dir, jupyter_runtime_dir
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.utils import url_path_join
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, Dict, Enum, Float, Int, List, Type, Unicode, default, validate

from .internal import InternalListener
from .metrics import collector
from .primary import HostRole, UnsafePath, new_secret
from .store import MODEL_LOGS_DIR

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp
from .scheduler import policy
from .scheduler.cgroups import Cgroups
from .scheduler.config import SchedulerConfig
from .scheduler.executors import Executor
from .scheduler.executors.local import LocalExecutor
from .scheduler.gpus import GpuProbe, NvmlProbe, VirtualProbe, parse_sizes
from .scheduler.kernels import OwnKernel
from .scheduler.service import Scheduler


def _env_int(name: str) -> int | None:
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


class EvalSchedApp(ExtensionApp):
    """One evaluation scheduler per host: queue, VRAM ledger, run subprocesses, shared models."""

    name = "jupyter_evalsched"
    load_other_extensions = True

    runs_dir = Unicode(
        help="Where run directories live. Default: $EVALSCHED_RUNS_DIR, else <jupyter data dir>/evalsched/runs."
    ).tag(config=True)

    @default("runs_dir")
    def _default_runs_dir(self) -> str:
        return os.environ.get("EVALSCHED_RUNS_DIR") or os.path.join(jupyter_data_dir(), "evalsched", "runs")

    virtual_gpus = CliList(
        Int(),
        help="Sizes in MB of virtual GPUs for a host without any (e.g. [24000, 24000]). "
        "Default: $EVALSCHED_VIRTUAL_GPUS (comma-separated). Empty: discover real GPUs through NVML.",
    ).tag(config=True)

    @default("virtual_gpus")
    def _default_virtual_gpus(self) -> list[int]:
        return parse_sizes(os.environ.get("EVALSCHED_VIRTUAL_GPUS", ""))

    virtual_gpu_processes = Unicode(
        help='With virtual GPUs: a JSON file [{"pid": 123, "gpu": 0, "used_mb": 5000}, ...] that the '
        "virtual probe reports as the processes holding VRAM (re-read when it changes). "
        "Default: $EVALSCHED_VIRTUAL_GPU_PROCESSES."
    ).tag(config=True)

    @default("virtual_gpu_processes")
    def _default_virtual_gpu_processes(self) -> str:
        return os.environ.get("EVALSCHED_VIRTUAL_GPU_PROCESSES", "")

    gpu_probe_class = Type(
        default_value=NvmlProbe,
        klass=object,
        help="The GPU probe used when no virtual GPUs are declared (must provide devices() and processes()).",
    ).tag(config=True)

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
        return _env_int("EVALSCHED_USABLE_VRAM_MB")

    cpu_slots = Int(help="CPU slots runs may take. Default: $EVALSCHED_CPU_SLOTS, else the host's cores.").tag(
        config=True
    )

    @default("cpu_slots")
    def _default_cpu_slots(self) -> int:
        return _env_int("EVALSCHED_CPU_SLOTS") or os.cpu_count() or 1

    @validate("cpu_slots")
    def _check_cpu_slots(self, proposal):
        if proposal["value"] < 1:
            raise ValueError("cpu_slots must be at least 1")
        return proposal["value"]

    cancel_grace_s = Float(10.0, help="Seconds between SIGTERM and SIGKILL when a run is cancelled or times out.").tag(
        config=True
    )
    sweep_interval_s = Float(1.0, help="Backstop sweep period; admission itself happens on events.").tag(config=True)
    progress_interval_s = Float(0.2, help="How often running runs' summary.json files are checked for progress.").tag(
        config=True
    )
    starvation_s = Float(600.0, help="A head-of-queue job waiting this long gets its resources reserved.").tag(
        config=True
    )
    starvation_passes = Int(50, help="... or after being passed over this many times.").tag(config=True)
    aging_s = Float(3600.0, help="A queued job is promoted one priority lane per this many seconds of waiting.").tag(
        config=True
    )
    fsync = Bool(False, help="fsync run files on every write (survives power loss, costs throughput).").tag(config=True)
    run_env = CliDict(value_trait=Unicode(), help="Environment added to every run (under the spec's own env).").tag(
        config=True
    )

    cgroups = Bool(
        True,
        help="Give each run a cgroup of its own where the host allows it: cancel, timeouts and clean-up then kill "
        "everything the run started, and scheduling.memory_mb is enforced. False: process groups only.",
    ).tag(config=True)
    cgroup_parent = Unicode(
        "",
        help="A delegated cgroup v2 directory to put run cgroups under (e.g. made with systemd-run --user --scope "
        "-p Delegate=yes). Default: found from this server's own cgroups.",
    ).tag(config=True)
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

    auto_resume = Bool(
        False,
        help="Runs interrupted by the server's death or shutdown are queued again at start (in their queue order) "
        "and resume from their episodes.jsonl, instead of ending aborted.",
    ).tag(config=True)
    retry_backoff_s = Float(
        10.0, help="A run's first automatic retry (spec 'retries') waits this long; each next one twice as long."
    ).tag(config=True)
    retry_backoff_max_s = Float(600.0, help="The longest back-off before an automatic retry.").tag(config=True)
    preemption = Bool(
        True,
        help="A waiting job of a higher lane that cannot fit otherwise may stop preemptible runs of lower lanes "
        "(scheduling.preemptible) at an episode boundary; they resume later.",
    ).tag(config=True)
    preempt_grace_s = Float(
        30.0, help="How long a preempted run has to reach its next episode boundary before it is signalled."
    ).tag(config=True)
    preempt_min_runtime_s = Float(
        60.0, help="A run is preempted only after it has run this long (in its current attempt)."
    ).tag(config=True)
    max_preemptions = Int(3, help="A run preempted this many times is not preempted again.").tag(config=True)

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

    promotion_interval_s = Float(
        1.0,
        help="How often a server that does not schedule (another holds the runs directory's lock) tries "
        "to take over, and the primary checks that its lock is still the runs directory's.",
    ).tag(config=True)

    slurm_enabled = Bool(
        help="Allow runs to be handed to SLURM (spec 'executor': 'slurm'). Default: $EVALSCHED_SLURM is 1."
    ).tag(config=True)

    @default("slurm_enabled")
    def _default_slurm_enabled(self) -> bool:
        return os.environ.get("EVALSCHED_SLURM", "") in ("1", "true", "yes")

    default_executor = Enum(
        ["local", "slurm"], "local", help="Where runs execute when their spec does not say: 'local' or 'slurm'."
    ).tag(config=True)

    slurm = CliDict(
        help="SLURM settings: partition, account, extra_sbatch_args (list), python (the interpreter "
        "on the compute nodes), poll_interval_s (1: squeue while jobs change) and max_poll_interval_s "
        "(15: while nothing changes, polls back off to this). Run directories must be on a filesystem "
        "the nodes share."
    ).tag(config=True)

    models = CliList(
        Dict(),
        help="Shared models: a list of dicts (name, task or loader, model, device, dtype, "
        "max_batch_size, max_wait_ms, vram_mb, ...). See the README.",
    ).tag(config=True)

    @property
    def _server(self) -> ServerApp:
        if self.serverapp is None:
            raise RuntimeError("the extension is not loaded into a server")
        return self.serverapp

    def initialize_settings(self) -> None:
        self.runs_path = Path(self.runs_dir).expanduser()
        if self.default_executor == "slurm" and not self.slurm_enabled:
            raise ValueError("EvalSchedApp.default_executor is 'slurm' but slurm_enabled is False")
        self.role = HostRole(self.runs_path)
        self.start_error: str | None = None  # why this server cannot schedule, when it cannot
        self._internal: InternalListener | None = None
        self._activity: PeriodicCallback | None = None
        self._watch: PeriodicCallback | None = None
        self._retry_at = 0.0
        self._make_scheduler()

    def _make_scheduler(self) -> None:
        """A scheduler (and model host) for one tenure as primary: a server that steps down and
        takes over again gets fresh ones."""
        probe: GpuProbe
        if self.virtual_gpus:
            probe = VirtualProbe(list(self.virtual_gpus), processes_file=self.virtual_gpu_processes or None)
        else:
            probe = cast(GpuProbe, self.gpu_probe_class())
        model_host = None
        if self.models:
            from .shared_models.manager import ModelHostManager

            model_host = ModelHostManager(
                list(self.models),
                socket_dir=Path(jupyter_runtime_dir()) / f"evalsched-models-{os.getpid()}",
                # Beside the runs, where a user finds them after the host (and its sockets) are gone.
                log_dir=str(self.runs_path / MODEL_LOGS_DIR),
                log=self.log,
            )
        config = SchedulerConfig(
            runs_dir=self.runs_path,
            cpu_slots=self.cpu_slots,
            reserve_mb=self.reserve_vram_mb,
            usable_override={int(k): int(v) for k, v in self.usable_vram_mb.items()},
            env_usable_mb=self.default_usable_vram_mb,
            policy=policy.PolicyConfig(
                starvation_s=self.starvation_s,
                starvation_passes=self.starvation_passes,
                aging_s=self.aging_s,
                preemption=self.preemption,
                preempt_min_runtime_s=self.preempt_min_runtime_s,
                max_preemptions=self.max_preemptions,
            ),
            cancel_grace_s=self.cancel_grace_s,
            sweep_interval_s=self.sweep_interval_s,
            progress_interval_s=self.progress_interval_s,
            default_cwd=str(Path(self._server.root_dir).expanduser()),
            fsync=self.fsync,
            run_env=dict(self.run_env),
            default_executor=self.default_executor,
            enforce_vram=self.enforce_vram,
            vram_tolerance=self.vram_tolerance,
            auto_margin=self.auto_margin,
            auto_resume=self.auto_resume,
            retry_backoff_s=self.retry_backoff_s,
            retry_backoff_max_s=self.retry_backoff_max_s,
            preempt_grace_s=self.preempt_grace_s,
            warm_start=self.warm_start,
            preload_modules=list(self.preload_modules),
            max_zygotes=self.max_zygotes,
            zygote_idle_s=self.zygote_idle_s,
        )
        executors: list[Executor] = [LocalExecutor(model_host, cgroups=self._host_cgroups())]
        if self.slurm_enabled:
            from .scheduler.executors.slurm import SlurmExecutor
            from .scheduler.slurm import SlurmCli, SlurmConfig

            settings = dict(self.slurm)
            poll = {k: settings.pop(k) for k in ("poll_interval_s", "max_poll_interval_s") if k in settings}
            executors.append(SlurmExecutor(SlurmCli(SlurmConfig(**settings)), **poll))
        self.scheduler = Scheduler(config, probe, models=model_host, executors=executors)
        self.scheduler.own_kernels = self._own_kernels
        self.model_host = model_host

    def _host_cgroups(self) -> Cgroups:
        """What cgroups this host gives runs, found once per server (detection probes the
        hierarchies), and said in the log."""
        found = getattr(self, "_cgroups_found", None)
        if found is None:
            setting = "off" if not self.cgroups else (self.cgroup_parent or "auto")
            # One namespace per user and runs directory: a server never touches the run cgroups of
            # another scheduler (another runs directory) on the host, stale ones included.
            digest = hashlib.sha256(os.path.realpath(self.runs_path).encode()).hexdigest()[:10]
            prefix = f"evalsched-{os.getuid()}-"
            found = self._cgroups_found = Cgroups.detect(setting, namespace=prefix + digest)
            found.remove_empty_siblings(prefix)  # left by killed servers of other runs directories
            support = found.support
            if found.enabled:
                self.log.info("evalsched: each run gets a cgroup (%s)", support.detail)
            elif self.cgroups:
                self.log.warning("evalsched: runs get no cgroup: %s", support.detail)
        return found

    def initialize_handlers(self) -> None:
        from .handlers import handlers

        self.handlers.extend(handlers())

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        # Live runs count as activity, so that JupyterHub never culls a server with work in flight.
        self._activity = PeriodicCallback(self._report_activity, 5000)
        self._activity.start()
        await self._take_over_if_free()
        if not self.role.is_primary and self.start_error is None:
            primary = self.role.primary()
            self.log.info(
                "evalsched: another server (pid %s, %s) schedules %s; forwarding /evalsched/ to it",
                primary.pid if primary else "?",
                primary.url if primary else "address not yet advertised",
                self.runs_path,
            )
        self._watch = PeriodicCallback(self._check_role, self.promotion_interval_s * 1000)
        self._watch.start()

    async def _check_role(self) -> None:
        """Primary: step down when the runs directory at its path is no longer the one locked;
        advertise again when the advertisement was removed. Otherwise: take over when free."""
        try:
            if self.role.is_primary:
                if not self.role.still_holds():
                    self.log.error(
                        "evalsched: the runs directory %s is no longer the directory this server locked "
                        "(renamed or replaced): this server stops scheduling it",
                        self.runs_path,
                    )
                    await self._step_down()
                elif not self.role.advertises_us() and self._internal is not None:
                    self._advertise()
                return
            if time.monotonic() >= self._retry_at:
                await self._take_over_if_free()
        except Exception:
            self.log.exception("evalsched: role check failed")

    async def _take_over_if_free(self) -> None:
        try:
            if not self.role.try_acquire():
                return
        except UnsafePath as exc:
            self._fail_start(str(exc))
            return
        if self._watch is not None:  # not the first start: a takeover
            self.log.warning("evalsched: no server schedules %s any more; this server takes over", self.runs_path)
        try:
            await self._become_primary()
        except Exception as exc:
            self.log.exception("evalsched: the scheduler could not start")
            await self._step_down()
            self._fail_start(f"{type(exc).__name__}: {exc}")

    def _fail_start(self, why: str) -> None:
        """This server cannot schedule the runs directory; requests are answered 503 with ``why``
        until a later try (every 10 s) succeeds or another server takes it."""
        if why != self.start_error:
            self.log.error("evalsched: this server cannot schedule %s: %s", self.runs_path, why)
        self.start_error = why
        self._retry_at = time.monotonic() + 10.0

    async def _become_primary(self) -> None:
        if self.model_host is not None:
            await self.model_host.start()
        await self.scheduler.start()
        collector().follow(self.scheduler)  # the scheduler's series on the server's /metrics
        from .handlers import handlers

        self._internal = InternalListener(handlers(), self._server.web_app.settings, new_secret())
        self._advertise()
        self.start_error = None
        self.log.info(
            "evalsched: this server schedules into %s with %d GPU(s) and %d CPU slots; API at %s",
            self.scheduler.store.root,
            len(self.scheduler.ledger()["devices"]),
            self.cpu_slots,
            url_path_join(self._server.base_url, "evalsched/"),
        )

    def _advertise(self) -> None:
        assert self._internal is not None
        secret = self._internal.app.settings["identity_provider"].secret
        self.role.advertise(self._own_url(), self._internal.url, secret)
        primary = self.role.primary()
        self.scheduler.primary_info = primary.public() if primary else None

    async def _step_down(self) -> None:
        """End this tenure as primary: runs stop (aborted), the lock is released, and a fresh
        scheduler waits for the next takeover."""
        if self._internal is not None:
            await self._internal.stop()
            self._internal = None
        if self.scheduler.started:
            await self.scheduler.stop()
        self._unfollow()
        if self.model_host is not None:
            await self.model_host.stop()
        self.role.release()
        self._make_scheduler()

    def _unfollow(self) -> None:
        metrics = collector()
        if metrics.following is self.scheduler:
            metrics.follow(None)

    async def describe_models(self) -> list[dict]:
        """``GET /evalsched/models``' list: every shared model and its host's figures."""
        return await self.model_host.describe() if self.model_host is not None else []

    async def _own_kernels(self) -> list[OwnKernel]:
        """This server's kernels: their pids (kernel manager) and notebooks (session manager)."""
        server = self._server
        paths: dict[str, str] = {}
        try:
            for session in await server.session_manager.list_sessions():
                kernel_id = (session.get("kernel") or {}).get("id")
                if kernel_id and session.get("path"):
                    paths[kernel_id] = session["path"]
        except Exception:
            self.log.debug("evalsched: sessions could not be listed", exc_info=True)
        out = []
        manager = server.kernel_manager
        for kernel_id in list(manager.list_kernel_ids()):
            pid = None
            try:
                provisioner = getattr(manager.get_kernel(kernel_id), "provisioner", None)
                pid = getattr(getattr(provisioner, "process", None), "pid", None) or getattr(provisioner, "pid", None)
            except Exception:
                pass
            out.append(OwnKernel(kernel_id, pid if isinstance(pid, int) else None, paths.get(kernel_id)))
        return out

    def _own_url(self) -> str:
        app = self._server
        host = app.ip if app.ip not in ("", "0.0.0.0", "::") else "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        scheme = "https" if app.certfile else "http"
        return f"{scheme}://{host}:{app.port}{app.base_url}"

    def _report_activity(self) -> None:
        if self.scheduler.has_live_runs:
            from jupyter_server._tz import utcnow

            self._server.web_app.settings["evalsched_last_activity"] = utcnow()

    async def stop_extension(self) -> None:
        for timer in (self._activity, self._watch):
            if timer is not None:
                timer.stop()
        if self.role.is_primary:
            if self._internal is not None:
                await self._internal.stop()
                self._internal = None
            await self.scheduler.stop()
            self._unfollow()
            if self.model_host is not None:
                await self.model_host.stop()
        self.role.release()


main = launch_new_instance = EvalSchedApp.launch_instance
