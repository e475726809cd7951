"""Leases: VRAM held for interactive work (a notebook kernel that loads a model), in the same
ledger and queue as runs.

A lease is requested (``queued``), granted by admission (``granted``, with its devices) and ends
(``ended``) when it is released, when the process that holds it exits (its pid together with its
start time, so a recycled pid never keeps a lease alive; noticed through a pidfd at once, by the
reconciliation otherwise) or ``ttl_s`` after its grant. Leases persist in ``<runs_dir>/.leases/`` so that a
server restart keeps those whose process still lives. So that every lease ends, its pid must be a process
that ends (``refused_holder``), and one without a pid holds at most ``max_lease_ttl_s`` (the scheduler
gives it that ttl when asked, ``recover`` when it finds an older one).

This module owns a lease's record and life; admission (the scheduler) decides when it is granted.
All of it runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psutil

from .. import contract
from ..contract import LEASE_ENDED, LEASE_GRANTED, LEASE_QUEUED
from ..schemas import LeaseRecord, utcnow_iso
from ..store import RunStore, StoreError
from .launcher import is_same_process, process_create_time
from .runs import parse_timestamp

log = logging.getLogger("jupyter_evalsched")

EndListener = Callable[["Lease"], None]

LEASE_ID_PREFIX = "lease-"
KEEP_ENDED = 500  # ended leases kept (in memory and on disk) for GET /leases/{id}


def new_lease_id() -> str:
    return LEASE_ID_PREFIX + datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%f") + "-" + secrets.token_hex(3)


def refused_holder(pid: int) -> tuple[str, str] | None:
    """Why ``pid`` may not hold a lease, as ``(error type, sentence)``, or None when it may.

    The server cannot see who sent the request, nor tell a kernel of another Jupyter server (or
    of nbclient) from any other process, so the rule is what it can check: a live process of the
    server's own user that is not pid 1, not the server itself, nor one of the server's ancestors
    other than its parent (a shell, a terminal multiplexer, a user manager: they outlive the
    server, so a lease they held would never end). The parent may: a program or a notebook that
    started this server (``LocalServer``) leases for itself. Run in the I/O thread."""
    gone = ("no_such_process", f"no live process with pid {pid}")
    if pid == 1:
        return ("pid_refused", "pid 1 (init) never exits: a lease's pid must be a process that ends")
    me = os.getpid()
    if pid == me:
        return ("pid_refused", f"pid {pid} is this server itself: a lease's pid must be a process that ends")
    try:
        proc = psutil.Process(pid)
        uid = proc.uids().real
        if proc.status() == psutil.STATUS_ZOMBIE:
            return gone
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return gone
    except psutil.AccessDenied:
        return ("pid_refused", f"process {pid} cannot be inspected: a lease's pid must be this server's user's")
    if uid != os.getuid():
        return (
            "pid_refused",
            f"process {pid} belongs to another user (uid {uid}): a lease's pid must be this server's user's "
            f"(uid {os.getuid()})",
        )
    try:
        ancestors = [p.pid for p in psutil.Process(me).parents()]
    except psutil.Error:
        ancestors = []
    if pid in ancestors[1:]:
        return (
            "pid_refused",
            f"process {pid} is an ancestor of this server and outlives it: a lease's pid must be a process that ends",
        )
    return None


@dataclass(eq=False, slots=True)
class Lease:
    record: dict[str, Any]
    requested_ts: float
    passed_over: int = 0
    pidfd: int | None = None
    ttl_timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # The lease's process and its descendants (refreshed by the reconciliation): their VRAM is the lease's.
    holder_pids: frozenset[int] = frozenset()
    # VRAM its process tree holds now, per device: absorbed by the lease when it is granted.
    observed: dict[int, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return str(self.record["id"])

    @property
    def state(self) -> str:
        return str(self.record["state"])

    @property
    def live(self) -> bool:
        return self.record["state"] != LEASE_ENDED

    @property
    def pid(self) -> int | None:
        pid = self.record.get("pid")
        return pid if isinstance(pid, int) else None

    @property
    def holder(self) -> str:
        """Who holds it, for the reasons of what waits: its label, else its notebook, else its pid."""
        rec = self.record
        if rec.get("label"):
            return str(rec["label"])
        if rec.get("session_path"):
            return os.path.basename(str(rec["session_path"])) or str(rec["session_path"])
        return f"pid {rec['pid']}" if rec.get("pid") else ""

    def charge(self, device: int, usable_mb: int) -> int:
        """What the lease holds on ``device`` (all of its usable VRAM when exclusive)."""
        if device not in self.record["devices"]:
            return 0
        return usable_mb if self.record["exclusive_gpu"] else int(self.record["vram_mb"])


class LeaseTable:
    def __init__(self, store: RunStore, emit: Callable[[dict[str, Any]], None]) -> None:
        self.store = store
        self._emit = emit  # the one event stream of the scheduler (RunTable.emit)
        self._leases: dict[str, Lease] = {}
        self._end_listeners: list[EndListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.version = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # ------------------------------------------------------------------ registry

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def live(self) -> list[Lease]:
        """Granted and queued leases, in request order."""
        return [lease for lease in self._leases.values() if lease.live]

    def queued(self) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.state == LEASE_QUEUED]

    def granted(self) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.state == LEASE_GRANTED]

    # ------------------------------------------------------------------ listeners

    def on_end(self, listener: EndListener) -> None:
        self._end_listeners.append(listener)

    def changed(self, lease: Lease) -> None:
        self.version += 1
        self._emit({"type": "lease", "lease": lease.record})

    # ------------------------------------------------------------------ life

    def request(
        self,
        *,
        vram_mb: int,
        gpus: int,
        exclusive_gpu: bool,
        priority: str,
        pid: int | None,
        ttl_s: float | None,
        label: str,
        seq: int,
        kernel_id: str | None = None,
        session_path: str | None = None,
    ) -> Lease:
        """A new queued lease, on disk before it is returned. StoreError when it cannot be written;
        ValueError when ``pid`` is not a live process."""
        create_time = None
        if pid is not None:
            create_time = process_create_time(pid)
            if create_time is None:
                raise ValueError(f"no live process with pid {pid}")
        lease_id = new_lease_id()
        while lease_id in self._leases:
            lease_id = new_lease_id()
        record = LeaseRecord(
            id=lease_id,
            state=LEASE_QUEUED,
            vram_mb=vram_mb,
            gpus=gpus,
            exclusive_gpu=exclusive_gpu,
            priority=priority,
            pid=pid,
            pid_create_time=create_time,
            label=label,
            kernel_id=kernel_id,
            session_path=session_path,
            ttl_s=ttl_s,
            requested_at=utcnow_iso(),
            seq=seq,
        ).model_dump(mode="json")
        lease = Lease(record=record, requested_ts=time.time())
        self.store.write_lease(lease_id, record)
        self._leases[lease_id] = lease
        self._watch(lease)
        self.changed(lease)
        return lease

    def grant(self, lease: Lease, devices: tuple[int, ...]) -> None:
        rec = lease.record
        rec.update(
            state=LEASE_GRANTED,
            reason=None,
            why=None,
            devices=list(devices),
            cuda_visible_devices=",".join(str(d) for d in devices),
            granted_at=utcnow_iso(),
        )
        self._arm_ttl(lease)
        self._save(lease)
        self.changed(lease)

    def set_reason(self, lease: Lease, why: contract.Why | None) -> None:
        """Why a queued lease waits (its ``reason`` and ``why``, from one fact)."""
        data = contract.why_dict(why)
        if lease.record["why"] != data or lease.record["reason"] != (why.reason if why else None):
            lease.record["reason"] = why.reason if why else None
            lease.record["why"] = data
            self.changed(lease)

    def set_observed(self, lease: Lease, observed: dict[int, int], over_mb: int) -> None:
        """What its process uses now (the last observation's figures): news, not worth a write."""
        lease.observed = dict(observed)
        figures = {str(k): v for k, v in sorted(observed.items()) if v}
        if figures != lease.record["observed_mb"] or over_mb != lease.record["over_lease_mb"]:
            lease.record["observed_mb"] = figures
            lease.record["over_lease_mb"] = over_mb
            self.changed(lease)

    def set_kernel(self, lease: Lease, kernel_id: str | None, session_path: str | None) -> None:
        rec = lease.record
        if (rec["kernel_id"], rec["session_path"]) != (kernel_id, session_path):
            rec["kernel_id"], rec["session_path"] = kernel_id, session_path
            self._save(lease)
            self.changed(lease)

    def end(self, lease: Lease, code: str, detail: str | None = None) -> bool:
        """End a lease (idempotent: False when it had ended already)."""
        if not lease.live:
            return False
        lease.record.update(state=LEASE_ENDED, reason=contract.reason(code, detail), why=None, ended_at=utcnow_iso())
        self._unwatch(lease)
        self._save(lease)
        self._prune()
        self.changed(lease)
        for listener in list(self._end_listeners):
            try:
                listener(lease)
            except Exception:
                log.exception("evalsched: lease end listener failed for %s", lease.id)
        return True

    # ------------------------------------------------------------------ its process and its ttl

    def _watch(self, lease: Lease) -> None:
        pid = lease.pid
        if pid is None or self._loop is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._loop.call_soon(self.check_process, lease)
            return
        except (AttributeError, OSError):
            return  # no pidfd here: the reconciliation checks the process (check_processes)
        if not is_same_process(pid, lease.record.get("pid_create_time")):
            os.close(fd)  # the pid was recycled between our look and the pidfd
            self._loop.call_soon(self.check_process, lease)
            return
        lease.pidfd = fd
        self._loop.add_reader(fd, self.check_process, lease)

    def _unwatch(self, lease: Lease) -> None:
        if lease.pidfd is not None:
            if self._loop is not None:
                self._loop.remove_reader(lease.pidfd)
            os.close(lease.pidfd)
            lease.pidfd = None
        if lease.ttl_timer is not None:
            lease.ttl_timer.cancel()
            lease.ttl_timer = None

    def check_process(self, lease: Lease) -> None:
        """End the lease if its process is gone (pid + start time)."""
        pid = lease.pid
        if pid is None or not lease.live:
            return
        if not is_same_process(pid, lease.record.get("pid_create_time")):
            self.end(lease, contract.PROCESS_EXITED, f"its process (pid {pid}) exited")

    def check_processes(self) -> None:
        """The reconciliation's backstop, for hosts without pidfd and for missed wake-ups."""
        for lease in self.live():
            if lease.pidfd is None:
                self.check_process(lease)

    def _arm_ttl(self, lease: Lease) -> None:
        ttl = lease.record.get("ttl_s")
        if not ttl or self._loop is None or lease.record["granted_at"] is None:
            return
        left = parse_timestamp(lease.record["granted_at"]) + float(ttl) - time.time()
        if lease.ttl_timer is not None:
            lease.ttl_timer.cancel()
        lease.ttl_timer = self._loop.call_later(max(0.0, left), self._expire, lease)

    def _expire(self, lease: Lease) -> None:
        lease.ttl_timer = None
        self.end(lease, contract.TTL_EXPIRED, f"held for its ttl_s={lease.record['ttl_s']:g} s")

    # ------------------------------------------------------------------ persistence

    def _save(self, lease: Lease) -> None:
        try:
            self.store.write_lease(lease.id, lease.record)
        except (StoreError, OSError) as exc:
            # The state is right in memory; only a restart would lose this change.
            log.error("evalsched: cannot write lease %s: %s", lease.id, exc)

    def _prune(self) -> None:
        ended = [lease for lease in self._leases.values() if not lease.live]
        for lease in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self._leases[lease.id]
            self.store.delete_lease(lease.id)

    def recover(self, found_files: list[tuple[str, dict[str, Any]]], max_ttl_s: float | None = None) -> None:
        """Leases of an earlier server: live ones whose process lives go on (a queued one stays in
        its place, a granted one keeps its devices); those whose process exited while no server
        watched end ``process_exited``. A live lease without a pid holds at most ``max_ttl_s``
        (one written before that limit, or under a larger one, gets it: counted from its grant)."""
        found: list[dict[str, Any]] = []
        for lease_id, raw in found_files:
            try:
                found.append(LeaseRecord.model_validate({**raw, "id": lease_id}).model_dump(mode="json"))
            except ValueError as exc:
                log.warning("evalsched: lease file %s is not a lease record (%s); ignored", lease_id, exc)
        found.sort(key=lambda rec: (rec["seq"], rec["id"]))
        for rec in found:
            lease = Lease(record=rec, requested_ts=parse_timestamp(rec["requested_at"]))
            self._leases[lease.id] = lease
            ttl = rec.get("ttl_s")
            if max_ttl_s and lease.live and lease.pid is None and (not ttl or ttl > max_ttl_s):
                rec["ttl_s"] = max_ttl_s
                self._save(lease)
        for lease in self.live():
            pid = lease.pid
            if pid is not None and not is_same_process(pid, lease.record.get("pid_create_time")):
                self.end(lease, contract.PROCESS_EXITED, f"its process (pid {pid}) exited while no server watched")
                continue
            self._watch(lease)
            if lease.state == LEASE_GRANTED:
                self._arm_ttl(lease)
        self._prune()

    def stop(self) -> None:
        """Server shutdown: stop watching. Leases stay as they are on disk for the next start."""
        for lease in self.live():
            self._unwatch(lease)
