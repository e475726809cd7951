"""The Jupyter server extension: configuration, the scheduler singleton, the REST handlers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from jupyter_core.paths import jupyter_runtime_dir
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.utils import url_path_join
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, Dict, Float, Int, Type, Unicode, default, observe

from .internal import InternalListener
from .metrics import collector
from .openai_cache import ResponseCache
from .primary import HostRole, UnsafePath, new_secret
from .store import MODEL_LOGS_DIR

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp
from .scheduler.cgroups import Cgroups
from .scheduler.config import CliDict, CliList, SchedulerConfig
from .scheduler.executors import Executor
from .scheduler.executors.local import LocalExecutor
from .scheduler.gpus import GpuProbe, NvmlProbe, VirtualProbe, parse_sizes
from .scheduler.kernels import OwnKernel
from .scheduler.service import Scheduler

# How long a stop waits, at most, for a start under way (its recovery's waits are bounded: 2 s
# for the earlier runs' processes, 2.5 s for each batch of 8 cgroups whose process is stuck).
STOP_WAITS_FOR_START_S = 60.0


class EvalSchedApp(ExtensionApp, SchedulerConfig):
    """One evaluation scheduler per host: queue, VRAM ledger, run subprocesses, shared models.

    The scheduler's settings are inherited from ``SchedulerConfig`` (declared there, once); those
    declared here are the server's own: the probe, cgroups, SLURM, shared models, tenure."""

    name = "jupyter_evalsched"
    load_other_extensions = True

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
    sweep_interval_s = Float(
        None,
        allow_none=True,
        help="Deprecated: the name reconcile_interval_s had before (a sweep is a parameter grid).",
    ).tag(config=True)

    @observe("sweep_interval_s")
    def _sweep_interval_renamed(self, change: Any) -> None:
        if change["new"] is None:
            return
        self.log.warning(
            "EvalSchedApp.sweep_interval_s is deprecated: set EvalSchedApp.reconcile_interval_s (now %s)", change["new"]
        )
        self.reconcile_interval_s = change["new"]

    promotion_interval_s = Float(
        1.0,
        help="How often a server that does not schedule (another holds the runs directory's lock) tries "
        "to take over, and the primary checks that its lock is still the runs directory's.",
    ).tag(config=True)

    freeze_startup_objects = Bool(
        True,
        help="Once the server has started, take the objects it holds then (its modules, classes, the state "
        "of the extensions started by then: about 235,000 in a default server) out of the cyclic garbage "
        "collector's scans (gc.freeze, after one full collection), so that a full collection scans only "
        "what came after: without the freeze, one paused the server for 125 to 207 ms about every 2,000 "
        "submissions on a 2-core host. They are still freed when their last reference goes, but a garbage "
        "cycle through one of them is kept. Skipped when something in the process froze objects already; "
        "undone when the extension stops.",
    ).tag(config=True)

    slurm_enabled = Bool(
        help="Allow runs to be handed to SLURM (spec 'executor': 'slurm'). Default: $EVALSCHED_SLURM is 1."
    ).tag(config=True)

    @default("slurm_enabled")
    def _default_slurm_enabled(self) -> bool:
        return os.environ.get("EVALSCHED_SLURM", "") in ("1", "true", "yes")

    slurm = CliDict(
        help="SLURM settings: partition, account, extra_sbatch_args (list), python (the interpreter "
        "on the compute nodes), poll_interval_s (1: squeue while jobs change) and max_poll_interval_s "
        "(15: while nothing changes, polls back off to this). Run directories must be on a filesystem "
        "the nodes share."
    ).tag(config=True)

    models = CliList(
        Dict(),
        help="Shared models: a list of dicts (name, task or loader, model, device, dtype, "
        "max_batch_size, max_wait_ms, vram_mb, idle_unload_s, ...). See the README.",
    ).tag(config=True)

    model_idle_unload_s = Float(
        300.0,
        allow_none=True,
        help="A shared model on a GPU that no caller used for this many seconds is unloaded when a run "
        "or lease waits for its room (never otherwise); None: never. A model's own idle_unload_s wins.",
    ).tag(config=True)

    openai_cache_mb = Int(
        0,
        help="The response cache of the OpenAI-compatible routes, in MB (0: off): deterministic requests "
        "(temperature 0, a seed, or scoring only) answered once are answered again from "
        "<runs_dir>/.openai-cache without the model, while the model's files are unchanged. "
        "Past this size, the entries used least recently are removed.",
    ).tag(config=True)

    @property
    def _server(self) -> ServerApp:
        if self.serverapp is None:
            raise RuntimeError("the extension is not loaded into a server")
        return self.serverapp

    def initialize_settings(self) -> None:
        # Absolute once, here: runs start in other working directories (their spec's cwd, the
        # zygote's), and a run's files are found through the paths the server gives it.
        self.runs_path = Path(os.path.abspath(Path(self.runs_dir).expanduser()))
        if self.default_executor == "slurm" and not self.slurm_enabled:
            raise ValueError("EvalSchedApp.default_executor is 'slurm' but slurm_enabled is False")
        self.role = HostRole(self.runs_path)
        self.start_error: str | None = None  # why this server cannot schedule, when it cannot
        self._internal: InternalListener | None = None
        self._activity: PeriodicCallback | None = None
        self._watch: PeriodicCallback | None = None
        self._froze = False  # gc.freeze() was called at the start (undone at the stop)
        self._retry_at = 0.0
        # A start or takeover under way (its recovery may wait seconds, in a thread, for what an
        # earlier server's runs left): a stop waits for it, then stops what it started.
        self._starting: asyncio.Future[None] | None = None
        self._stopping = False
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
            from .shared_models import socket_dirs
            from .shared_models.manager import ModelHostManager

            model_host = ModelHostManager(
                list(self.models),
                socket_dir=Path(jupyter_runtime_dir()) / socket_dirs.dir_name(),
                # Beside the runs, where a user finds them after the host (and its sockets) are gone.
                log_dir=str(self.runs_path / MODEL_LOGS_DIR),
                log=self.log,
                idle_unload_s=self.model_idle_unload_s,
            )
        config = SchedulerConfig.from_settings(
            self, runs_dir=self.runs_path, default_cwd=str(Path(self._server.root_dir).expanduser())
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
        self.openai_cache = (
            ResponseCache(self.runs_path, self.openai_cache_mb * 1024 * 1024)
            if model_host is not None and self.openai_cache_mb > 0
            else None
        )

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
            found.hold_namespace()  # this server's, while it lives
            found.remove_empty_siblings(prefix)  # left by servers of other runs directories that are gone
            support = found.support
            if found.enabled:
                self.log.info("evalsched: each run gets a cgroup (%s)", support.detail)
            elif self.cgroups:
                self.log.warning("evalsched: runs get no cgroup: %s", support.detail)
        return found

    def initialize_handlers(self) -> None:
        self.handlers.extend(_all_handlers())

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        with self._under_way():
            await self._start()

    async def _start(self) -> None:
        if self._stopping or not hasattr(self, "scheduler"):
            # Stopped before it began (an embedded server's), or its settings failed part-way
            # (jupyter_server starts it all the same): it takes no runs directory.
            return
        # Live runs count as activity, so that JupyterHub never culls a server with work in flight.
        self._activity = PeriodicCallback(self._report_activity, 5000)
        self._activity.start()
        await self._take_over_if_free()
        if self._stopping:
            return  # (stopped meanwhile: no timer of its own is started after the stop)
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
        if self.freeze_startup_objects and gc.get_freeze_count() == 0:
            # Garbage first, or it would be kept for good: one full collection, once.
            gc.collect()
            gc.freeze()
            self._froze = True

    @contextlib.contextmanager
    def _under_way(self) -> Iterator[None]:
        """A start or takeover under way, for ``stop_extension`` to wait for."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._starting = done
        try:
            yield
        finally:
            done.set_result(None)

    async def _check_role(self) -> None:
        """Primary: step down when the runs directory at its path is no longer the one locked;
        advertise again when the advertisement was removed. Otherwise: take over when free."""
        if self._stopping:
            return
        try:
            if self.role.is_primary:
                if self.start_error is not None:
                    return  # (suspended: its runs directory was moved; until the server restarts)
                if not self.role.still_holds():
                    await self._suspend(self.role.moved_message())
                elif not self.role.advertises_us() and self._internal is not None:
                    self._advertise()
                return
            if time.monotonic() >= self._retry_at:
                with self._under_way():
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
        cgroups = getattr(self, "_cgroups_found", None)
        if cgroups is not None and cgroups.enabled:
            # Held since this server started, unless the namespace was removed and made again
            # meanwhile (by hand, or by a server of an older version as it stopped): the lock
            # must be on the directory its runs' cgroups will be made in.
            cgroups.hold_namespace()
        if self.model_host is not None:
            self.model_host.api_base = self._own_url() + "evalsched/v1"
            await self.model_host.start()
        await self.scheduler.start()
        if not self.scheduler.started:
            return  # the extension stopped while the scheduler started: not advertised
        collector().follow(self.scheduler)  # the scheduler's series on the server's /metrics
        self._internal = InternalListener(_all_handlers(), self._server.web_app.settings, new_secret())
        self._advertise()
        self.start_error = None
        self.log.info(
            "evalsched: this server schedules into %s with %d GPU(s) and %d CPU slots; API at %s",
            self.scheduler.status_view().runs_dir,
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

    async def _suspend(self, why: str) -> None:
        """The runs directory was moved (or replaced) under this primary: it writes nothing more
        (every write of the store is refused: a write by path would land in whatever now has that
        name), admits nothing, and answers 503 with ``why``. It keeps the lock on the moved
        directory, so that no other server schedules it while this one may still hold runs of it,
        and never makes a new directory at the old path. A restart ends the suspension (the
        restarted server recovers the runs from the directory it is given)."""
        self.log.error("evalsched: %s", why)
        self.start_error = why
        self.scheduler.suspend(why)
        await self._stop_internal()  # (secondaries: nothing to forward to)

    async def _stop_internal(self) -> None:
        """The listener secondaries forward to stops, its advertisement removed first: once its
        port is free, anyone on the host may listen there (secondaries answer 503 meanwhile)."""
        internal, self._internal = self._internal, None
        if internal is not None:
            self.role.unadvertise()
            await internal.stop()

    async def _step_down(self) -> None:
        """End this tenure as primary: runs stop (aborted), the lock is released, and a fresh
        scheduler waits for the next takeover."""
        await self._stop_internal()
        if self.scheduler.started:
            await self.scheduler.stop()
        self._unfollow()
        if self.model_host is not None:
            await self.model_host.stop()
        self.role.release()
        self._make_scheduler()
        if self._froze:
            # The scheduler dropped here may be one made before the freeze: kept for good, unless
            # thawed for a collection (a step-down is rare; the collection is one pause).
            gc.unfreeze()
            gc.collect()
            gc.freeze()

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
        # A start or takeover under way admits nothing more and is waited for (its recovery's
        # clean-up included, which kills by run id: it must not outlive this server's role), so
        # that what it started is stopped below and nothing of it is left running.
        if not hasattr(self, "role"):
            return  # its settings failed before anything was made: nothing to stop
        self._stopping = True
        # (No scheduler where the settings failed part-way, such as a SLURM section that does not
        # parse: the stop must still end, or the server never exits.)
        scheduler: Scheduler | None = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.halt()
        if self._starting is not None and not self._starting.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._starting), STOP_WAITS_FOR_START_S)
            except TimeoutError:
                self.log.warning(
                    "evalsched: the start under way did not end within %g s; stopping all the same",
                    STOP_WAITS_FOR_START_S,
                )
        if self._froze:  # (a server embedded in a longer-lived process, as in tests, keeps nothing)
            gc.unfreeze()
            self._froze = False
        for timer in (self._activity, self._watch):
            if timer is not None:
                timer.stop()
        scheduler = getattr(self, "scheduler", None)  # (a takeover that failed made a new one)
        if self.role.is_primary and scheduler is not None:
            await self._stop_internal()
            await scheduler.stop()
            self._unfollow()
            model_host = getattr(self, "model_host", None)
            if model_host is not None:
                await model_host.stop()
        self.role.release()


main = launch_new_instance = EvalSchedApp.launch_instance


def _all_handlers() -> list[tuple[str, type]]:
    """The REST routes under ``/evalsched/`` and the OpenAI-compatible ones under ``/evalsched/v1/``."""
    from . import openai_api
    from .handlers import handlers

    return handlers() + openai_api.handlers()
