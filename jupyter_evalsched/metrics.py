"""The scheduler's Prometheus series, served by jupyter_server's own ``/metrics`` (and so behind
its ``authenticate_prometheus`` setting): a Grafana board of a GPU host needs no exporter.

One collector per process, registered once in ``prometheus_client``'s default registry (the one
``/metrics`` serves), follows whichever scheduler this server runs (``follow``). Gauges are read
at scrape time from the scheduler's own state (no bookkeeping to drift); counters and histograms
are fed by the run table's events (a transition seen: queued -> running is an admission, its wait
observed; running -> terminal, its duration). Model-host figures are the last the hosts reported
(refreshed in the background, every ``MODEL_REFRESH_S``): a scrape never waits on a host.

Series (all prefixed ``evalsched_``):

- ``runs{state, priority}``: queued and running runs by lane; ``runs_finished_total{state}``;
- ``admissions_total``; ``run_wait_seconds`` (queued -> started, each attempt) and
  ``run_duration_seconds{state}`` (started -> ended) histograms;
- ``gpu_memory_mb{gpu, kind}``, kind ``total``, ``usable``, ``allocated``, ``leased``, ``free``,
  ``unmanaged``; ``cpu_slots{kind}`` (``total``, ``used``); ``leases{state}``;
- ``model_requests_total{model}``, ``model_failed_requests_total{model}``,
  ``model_batch_size{model}`` (a histogram of the batches each host ran);
- ``scheduler_up`` (1 while this server schedules).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .contract import ACTIVE_STATES, QUEUED, RUNNING, TERMINAL_STATES

if TYPE_CHECKING:
    from .scheduler.service import Scheduler

log = logging.getLogger("jupyter_evalsched")

WAIT_BUCKETS = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
DURATION_BUCKETS = (0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODEL_REFRESH_S = 5.0
LANES = ("high", "normal", "low")


class _Histogram:
    """Cumulative bucket counts and a sum, as a Prometheus histogram needs them."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += times
                break
        else:
            self.counts[-1] += times
        self.total += value * times

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else _le(bound), running))
        return out


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


class SchedulerCollector:
    """The collector; ``follow(scheduler)`` when a server starts scheduling, ``follow(None)`` when
    it stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # scrapes run on the server's loop, but be safe with threads
        self._scheduler: Scheduler | None = None
        self._seen: dict[str, tuple[str, float]] = {}  # run id -> (state, since: monotonic)
        self.admissions = 0
        self.finished: dict[str, int] = {}
        self.wait = _Histogram(WAIT_BUCKETS)
        self.duration: dict[str, _Histogram] = {}
        self.model_figures: list[dict[str, Any]] = []
        self._refresh: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ following a scheduler

    @property
    def following(self) -> Scheduler | None:
        return self._scheduler

    def follow(self, scheduler: Scheduler | None) -> None:
        with self._lock:
            if self._scheduler is not None:
                self._scheduler.table.unsubscribe(self._event)
            if self._refresh is not None:
                self._refresh.cancel()
                self._refresh = None
            self._scheduler = scheduler
            self._seen.clear()
            self.model_figures = []
            if scheduler is None:
                return
            now = time.monotonic()
            for run in scheduler.table.active():
                self._seen[run.id] = (run.state, now)
            scheduler.table.subscribe(self._event)
        if scheduler is not None and list(scheduler.models.names()):
            try:
                self._refresh = asyncio.get_running_loop().create_task(self._refresh_models(scheduler))
            except RuntimeError:
                self._refresh = None

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("type") != "run":
            return
        record = event["run"]
        run_id, state = record["id"], record["state"]
        now = time.monotonic()
        with self._lock:
            before = self._seen.get(run_id)
            if before is not None and before[0] == state:
                return
            if state == RUNNING:
                self.admissions += 1
                if before is not None and before[0] == QUEUED:
                    self.wait.observe(now - before[1])
            if state in TERMINAL_STATES:
                self._seen.pop(run_id, None)
                self.finished[state] = self.finished.get(state, 0) + 1
                if before is not None and before[0] == RUNNING:
                    self.duration.setdefault(state, _Histogram(DURATION_BUCKETS)).observe(now - before[1])
                return
            self._seen[run_id] = (state, now)

    async def _refresh_models(self, scheduler: Scheduler) -> None:
        while True:
            try:
                describe = getattr(scheduler.models, "describe", None)
                if describe is not None:
                    self.model_figures = list(await describe())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("evalsched: model figures for /metrics unavailable", exc_info=True)
            await asyncio.sleep(MODEL_REFRESH_S)

    # ------------------------------------------------------------------ the scrape

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            scheduler = self._scheduler
            up = GaugeMetricFamily("evalsched_scheduler_up", "1 while this server runs the host's scheduler")
            up.add_metric([], 1.0 if scheduler is not None and scheduler.started else 0.0)
            yield up
            if scheduler is None:
                return
            runs = GaugeMetricFamily("evalsched_runs", "Queued and running runs, by lane", labels=["state", "priority"])
            counts = {(s, p): 0 for s in sorted(ACTIVE_STATES) for p in LANES}
            for run in scheduler.table.active():
                key = (run.state, run.record["priority"])
                counts[key] = counts.get(key, 0) + 1
            for (state, priority), n in sorted(counts.items()):
                runs.add_metric([state, priority], n)
            yield runs
            finished = CounterMetricFamily(
                "evalsched_runs_finished",
                "Runs that reached a terminal state since the server started",
                labels=["state"],
            )
            for state in sorted(TERMINAL_STATES):
                finished.add_metric([state], self.finished.get(state, 0))
            yield finished
            admissions = CounterMetricFamily("evalsched_admissions", "Runs admitted (started) since the server started")
            admissions.add_metric([], self.admissions)
            yield admissions
            wait = HistogramMetricFamily("evalsched_run_wait_seconds", "Time from queued to started, per attempt")
            wait.add_metric([], self.wait.buckets(), self.wait.total)
            yield wait
            duration = HistogramMetricFamily(
                "evalsched_run_duration_seconds", "Time from started to ended, by how it ended", labels=["state"]
            )
            for state, hist in sorted(self.duration.items()):
                duration.add_metric([state], hist.buckets(), hist.total)
            yield duration
            yield from self._ledger(scheduler)
            yield from self._models()

    def _ledger(self, scheduler: Scheduler) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        view = scheduler.ledger()
        memory = GaugeMetricFamily("evalsched_gpu_memory_mb", "Per-GPU VRAM in MB, by kind", labels=["gpu", "kind"])
        for dev in view.get("devices") or []:
            gpu = str(dev["index"])
            leased = sum(int(lease.get("vram_mb") or 0) for lease in dev.get("leases") or [])
            for kind, value in (
                ("total", dev.get("total_mb")),
                ("usable", dev.get("usable_mb")),
                ("allocated", dev.get("allocated_mb")),
                ("leased", leased),
                ("free", dev.get("free_mb")),
                ("unmanaged", dev.get("unmanaged_mb")),
            ):
                memory.add_metric([gpu, kind], float(value or 0))
        yield memory
        slots = view.get("cpu_slots") or {}
        cpu = GaugeMetricFamily("evalsched_cpu_slots", "CPU slots runs may take, and those taken", labels=["kind"])
        cpu.add_metric(["total"], float(slots.get("total") or 0))
        cpu.add_metric(["used"], float(slots.get("allocated") or 0))  # the ledger's word for taken
        yield cpu
        leases = GaugeMetricFamily("evalsched_leases", "Live leases (VRAM held for interactive work)", labels=["state"])
        live = scheduler.leases.live()
        for state in ("queued", "granted"):
            leases.add_metric([state], sum(1 for lease in live if lease.state == state))
        yield leases

    def _models(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        if not self.model_figures:
            return
        requests = CounterMetricFamily(
            "evalsched_model_requests", "Requests served by a shared model's host (since it started)", labels=["model"]
        )
        failed = CounterMetricFamily(
            "evalsched_model_failed_requests", "Requests a shared model's host failed", labels=["model"]
        )
        batches = HistogramMetricFamily(
            "evalsched_model_batch_size", "The sizes of the batches a shared model's host ran", labels=["model"]
        )
        for figures in self.model_figures:
            name = str(figures.get("name"))
            requests.add_metric([name], float(figures.get("requests") or 0))
            failed.add_metric([name], float(figures.get("failed_requests") or 0))
            hist = _Histogram(tuple(float(b) for b in BATCH_BUCKETS))
            for size, count in (figures.get("batch_sizes") or {}).items():
                hist.observe(float(size), int(count))
            batches.add_metric([name], hist.buckets(), hist.total)
        yield requests
        yield failed
        yield batches


_collector: SchedulerCollector | None = None


def collector() -> SchedulerCollector:
    """The process's collector, registered in ``prometheus_client``'s default registry once."""
    global _collector
    if _collector is None:
        from prometheus_client import REGISTRY

        _collector = SchedulerCollector()
        try:
            REGISTRY.register(_collector)
        except ValueError:  # names taken (another copy of this module): the series stay off
            log.warning("evalsched: the scheduler's Prometheus series could not be registered", exc_info=True)
    return _collector
