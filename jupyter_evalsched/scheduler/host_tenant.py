"""This server as a tenant of the host ledger (``c.EvalSchedApp.host_ledger``): the GPUs of a host
shared by several users, each with their own server.

Admission stays this server's own (``policy.decide``, pure); the host ledger changes what it is
given and has the last word on each GPU placement:

* capacity: the devices and their usable VRAM are the host ledger's; what the other users hold
  (their grants, their processes outside any grant) is foreign VRAM on each device, held by
  holders of kind ``user`` named by user name only (:func:`tenant_capacity`);
* while the host ledger is not connected, GPU work waits (``host_ledger_unavailable``) and CPU-only
  runs go on (:func:`gate_why`);
* a run's start and a lease's grant are granted by the host ledger first (:class:`HostTenant`,
  I/O at the edge, on the loop without blocking it); a refusal keeps the job queued with the
  ledger's reason (:func:`refusal_why`), a request the quota can never hold is a 422
  (:func:`never_reason`).

Pure functions first, then the link's owner.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import contract
from ..contract import Holder, Why
from ..host_ledger import policy as host_policy
from ..host_ledger.tenant import HostLedgerUnavailable, NeverFits, TenantLink
from .ledger import DeviceBudget, Unmanaged, capacity
from .policy import Capacity, Device

log = logging.getLogger("jupyter_evalsched")

__all__ = [
    "HostTenant",
    "budgets_from_view",
    "gate_why",
    "never_reason",
    "others_by_device",
    "own_unmanaged",
    "refusal_why",
    "tenant_capacity",
    "with_others",
]

# ----------------------------------------------------------------------------- pure decisions


def budgets_from_view(view: Mapping[str, Any]) -> list[DeviceBudget]:
    """The host ledger's devices as this server's budgets: its usable VRAM. (This server's own
    shared models are jobs of its own ledger, admitted within these budgets.)"""
    return [
        DeviceBudget(int(dev["index"]), str(dev["name"]), int(dev["total_mb"]), int(dev["usable_mb"]))
        for dev in view.get("devices", [])
    ]


def others_by_device(view: Mapping[str, Any] | None, user: str | None) -> dict[int, list[Holder]]:
    """What the other users hold on each device (their grants and their processes outside any
    grant, together), largest first, as holders of kind ``user`` named by user name only."""
    out: dict[int, list[Holder]] = {}
    for dev in (view or {}).get("devices", []):
        index = int(dev["index"])
        per: dict[str, int] = {}
        for entry in dev.get("users", []):
            per[entry["user"]] = per.get(entry["user"], 0) + int(entry["allocated_mb"])
        for proc in dev.get("unmanaged_processes", []):
            owner = proc.get("user")
            if owner == user:
                continue  # this user's own processes: this server observes them itself
            name = owner or "unknown"
            per[name] = per.get(name, 0) + int(proc.get("used_mb") or 0)
        held = sorted(((mb, name) for name, mb in per.items() if mb > 0), key=lambda t: (-t[0], t[1]))
        if held:
            out[index] = [Holder("user", name, name, index, mb) for mb, name in held]
    return out


def own_unmanaged(unmanaged: Mapping[int, Unmanaged], is_own: Callable[[int], bool]) -> dict[int, Unmanaged]:
    """This server's observation of unmanaged VRAM restricted to this user's processes: the other
    users' come from the host ledger (counting them here too would count them twice)."""
    out: dict[int, Unmanaged] = {}
    for index, entry in unmanaged.items():
        mine = [p for p in entry.processes if is_own(int(p["pid"]))]
        others_mb = sum(int(p["used_mb"]) for p in entry.processes if p.get("lease_id") is None and p not in mine)
        out[index] = Unmanaged(max(0, entry.mb - others_mb), mine)
    return out


def tenant_capacity(
    budgets: list[DeviceBudget],
    cpu_slots: int,
    own: Mapping[int, Unmanaged],
    others: Mapping[int, list[Holder]],
) -> Capacity:
    """Capacity with the other users' holdings as foreign VRAM on each device."""
    base = capacity(budgets, cpu_slots, own)
    devices = []
    for dev in base.devices:
        theirs = others.get(dev.index, [])
        if not theirs:
            devices.append(dev)
            continue
        holders = sorted([*theirs, *dev.holders], key=lambda h: (-(h.mb or 0), h.kind, h.id or ""))
        mb = dev.unmanaged_mb + sum(h.mb or 0 for h in theirs)
        devices.append(Device(dev.index, dev.usable_mb, mb, tuple(holders)))
    return Capacity(devices=tuple(devices), cpu_slots=base.cpu_slots)


def with_others(ledger: dict[str, Any], view: Mapping[str, Any] | None, user: str | None) -> dict[str, Any]:
    """``GET /evalsched/ledger`` on a shared host: each device gains ``users`` (the other users'
    grants, by user name only), and the other users' processes outside any grant join its
    ``unmanaged_processes`` with their ``user``; ``free_mb`` counts both."""
    by_index = {int(d["index"]): d for d in (view or {}).get("devices", [])}
    for dev in ledger["devices"]:
        host = by_index.get(dev["index"], {})
        users = [dict(u) for u in host.get("users", [])]
        theirs = [
            {"pid": p["pid"], "gpu": p["gpu"], "used_mb": p["used_mb"], "user": p.get("user")}
            for p in host.get("unmanaged_processes", [])
            if p.get("user") != user
        ]
        mine = [{**p, "user": user} for p in dev["unmanaged_processes"]]
        dev["users"] = users
        dev["unmanaged_processes"] = [*mine, *theirs]
        dev["unmanaged_mb"] += sum(int(p["used_mb"]) for p in theirs)
        dev["free_mb"] = (
            dev["usable_mb"] - dev["allocated_mb"] - dev["unmanaged_mb"] - sum(u["allocated_mb"] for u in users)
        )
    return ledger


def gate_why(socket_path: str, connected: bool, has_view: bool, error: str | None) -> Why | None:
    """Why GPU work waits now (no host ledger to grant it), or None."""
    if connected and has_view:
        return None
    return Why(
        contract.HOST_LEDGER_UNAVAILABLE,
        f"GPU work waits for the host ledger at {socket_path}: {error or 'not connected'}",
    )


def refusal_why(reason: str, holders: list[Holder]) -> Why:
    """The host ledger's refusal as a waiting reason: ``quota: ...`` as the ledger says it, else
    ``host_ledger: <its reason>`` with the other users on the devices asked for as holders."""
    if reason.startswith("quota: "):
        return Why(contract.QUOTA, reason[len("quota: ") :])
    return Why(contract.HOST_LEDGER, reason, holders=holders)


def never_reason(
    view: Mapping[str, Any] | None, user: str | None, vram_mb: int, gpus: int, exclusive: bool, kind: str
) -> str:
    """Why a request can never be granted on this host under this user's quota ("" when it could)."""
    if view is None or user is None:
        return ""
    devices = {
        int(d["index"]): host_policy.HostDevice(int(d["index"]), int(d["usable_mb"])) for d in view.get("devices", [])
    }
    quota = host_policy.Quota(
        **{k: v for k, v in (view.get("quota") or {}).items() if k in ("vram_mb", "gpus", "leases")}
    )
    ask = host_policy.Ask(user, max(0, vram_mb), max(1, gpus), exclusive, kind)
    return host_policy.never_reason(ask, devices, quota)


# ----------------------------------------------------------------------------- the link's owner


@dataclass(frozen=True, slots=True)
class _Adopt:
    """What a job found live at start holds (to learn its grant again)."""

    vram_mb: int
    devices: tuple[int, ...]
    exclusive: bool
    kind: str
    pid: int | None


def _own_process(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


class HostTenant:
    """The scheduler's side of the link: the view as capacity, grants by job id (a run's or a
    lease's), re-tied to the run's process once it exists and released at the job's end."""

    def __init__(self, socket_path: str, on_change: Callable[[], None], tenant: str = "") -> None:
        self.socket_path = socket_path
        self.link = TenantLink(socket_path, tenant=tenant, on_change=self._changed)
        self._on_change = on_change
        self.grants: dict[str, dict[str, Any]] = {}  # job id -> its grant
        self.retied: dict[str, int] = {}  # job id -> the pid its grant is tied to
        self._last_view: dict[str, Any] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.is_own: Callable[[int], bool] = _own_process
        # Jobs an earlier server was granted for, found live at start (a detached run, a lease):
        # their grants are learned again from the host ledger, never asked for twice.
        self.adopting: dict[str, _Adopt] = {}
        self._adopting_now = False

    async def start(self) -> None:
        await self.link.start()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.link.stop()

    def _changed(self) -> None:
        if self.link.view is not None:
            self._last_view = self.link.view
        if self.adopting and self.link.connected and not self._adopting_now:
            self._adopting_now = True
            self._spawn(self._adopt_all())
        self._on_change()

    # ------------------------------------------------------------------ what admission sees

    @property
    def view(self) -> dict[str, Any] | None:
        """The host's view now (None while disconnected)."""
        return self.link.view

    @property
    def known_view(self) -> dict[str, Any] | None:
        """The last view seen: the devices stay known while the ledger is away."""
        return self.link.view or self._last_view

    def gate(self) -> Why | None:
        return gate_why(self.socket_path, self.link.connected, self.link.view is not None, self.link.error)

    def budgets(self) -> list[DeviceBudget] | None:
        view = self.known_view
        return None if view is None else budgets_from_view(view)

    def capacity(self, budgets: list[DeviceBudget], cpu_slots: int, unmanaged: Mapping[int, Unmanaged]) -> Capacity:
        return tenant_capacity(budgets, cpu_slots, self.own(unmanaged), others_by_device(self.view, self.link.user))

    def ledger(self, ledger: dict[str, Any]) -> dict[str, Any]:
        return with_others(ledger, self.view, self.link.user)

    def own(self, unmanaged: Mapping[int, Unmanaged]) -> dict[int, Unmanaged]:
        return own_unmanaged(unmanaged, self.is_own)

    def never(self, vram_mb: int, gpus: int, exclusive: bool, kind: str) -> str:
        return never_reason(self.known_view, self.link.user, vram_mb, gpus, exclusive, kind)

    def status(self) -> dict[str, Any]:
        return self.link.status()

    # ------------------------------------------------------------------ grants

    async def grant(
        self,
        job_id: str,
        vram_mb: int,
        devices: tuple[int, ...],
        exclusive: bool,
        kind: str,
        pids: list[int] | None = None,
    ) -> dict[str, Any] | Why:
        """The grant for a job on ``devices``, or why it waits. ``pids``: the processes it is
        for, when they exist already (a lease's holder); else this server's, re-tied later."""
        held = self.grants.get(job_id)
        if held is not None and tuple(held["devices"]) == tuple(devices):
            return held
        try:
            answer = await self.link.try_grant(
                job_id, vram_mb, list(devices), exclusive=exclusive, kind=kind, pids=pids
            )
        except NeverFits as exc:
            return refusal_why(exc.reason, [])
        except HostLedgerUnavailable as exc:
            return gate_why(self.socket_path, False, False, exc.reason) or Why(contract.HOST_LEDGER_UNAVAILABLE)
        except Exception as exc:  # an error answer (bad_request, too_many): the job waits, says why
            return Why(contract.HOST_LEDGER, str(getattr(exc, "reason", exc)))
        if isinstance(answer, str):
            others = others_by_device(self.view, self.link.user)
            return refusal_why(answer, [h for i in devices for h in others.get(i, [])])
        self.grants[job_id] = answer
        return answer

    def retie(self, job_id: str, pid: int) -> None:
        """Tie the job's grant to its process (from the server's own, which asked), off the caller."""
        grant = self.grants.get(job_id)
        if grant is None or self.retied.get(job_id) == pid:
            return
        self.retied[job_id] = pid
        self._spawn(self._retie(job_id, grant["id"], pid))

    async def _retie(self, job_id: str, grant_id: str, pid: int) -> None:
        try:
            grant = await self.link.retie(grant_id, [pid])
        except Exception as exc:  # gone already, or the ledger away: the grant stays the server's
            log.info("evalsched: host ledger grant %s not re-tied to pid %s: %s", grant_id, pid, exc)
            self.retied.pop(job_id, None)
            return
        if job_id in self.grants:
            self.grants[job_id] = grant

    def release(self, job_id: str) -> None:
        """The job no longer holds its GPUs: its grant goes back now (or once the ledger is back)."""
        grant = self.grants.pop(job_id, None)
        self.retied.pop(job_id, None)
        self.adopting.pop(job_id, None)
        if grant is not None:
            self._spawn(self.link.release(grant["id"]))

    # ------------------------------------------------------------------ after a restart

    def adopt(
        self, job_id: str, vram_mb: int, devices: tuple[int, ...], exclusive: bool, kind: str, pid: int | None
    ) -> None:
        """A job an earlier server placed, found live at start (a detached run re-attached, a
        granted lease kept): its grant (key = the job's id) is learned from the host ledger and
        kept tied to ``pid``; one that ended meanwhile (tied to the earlier server alone) is
        asked for again for ``pid``. Until then the job holds its devices here as before."""
        self.adopting[job_id] = _Adopt(vram_mb, tuple(devices), exclusive, kind, pid)
        if self.link.connected and not self._adopting_now:
            self._adopting_now = True
            self._spawn(self._adopt_all())

    async def _adopt_all(self) -> None:
        try:
            for job_id, want in list(self.adopting.items()):
                if not self.link.connected:
                    return  # the next connection tries again (_changed)
                if self.adopting.get(job_id) is not want:
                    continue  # released (the job ended) meanwhile
                await self._adopt(job_id, want)
        finally:
            self._adopting_now = False

    async def _adopt(self, job_id: str, want: _Adopt) -> None:
        pids = [want.pid] if want.pid is not None else None
        try:
            # The same key: the ledger answers with the grant it holds under it, if any.
            answer = await self.link.try_grant(
                job_id, want.vram_mb, list(want.devices), exclusive=want.exclusive, kind=want.kind, pids=pids
            )
        except NeverFits as exc:
            log.warning("evalsched: host ledger refuses %s %s for good: %s", want.kind, job_id, exc.reason)
            self.adopting.pop(job_id, None)
            return
        except Exception as exc:  # the ledger away, the process gone: the next connection tries
            log.info("evalsched: host ledger grant of %s %s not learned yet: %s", want.kind, job_id, exc)
            return
        if isinstance(answer, str):  # no room for it now (its grant ended with the earlier server)
            log.warning("evalsched: %s %s runs without a host ledger grant for now: %s", want.kind, job_id, answer)
            return
        if self.adopting.get(job_id) is not want:  # it ended while the answer was on its way
            self._spawn(self.link.release(answer["id"]))
            return
        del self.adopting[job_id]
        self.grants[job_id] = answer
        tied = [p["pid"] for p in answer.get("pids", [])]
        if want.pid is not None and tied != [want.pid]:
            self.retie(job_id, want.pid)
        elif want.pid is not None:
            self.retied[job_id] = want.pid

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
