"""Interactive work in the ledger: :func:`lease` holds VRAM for this process, :func:`model` gives a
kernel the host's shared models.

A notebook that loads a 14 GB model asks for a lease first::

    with jupyter_evalsched.lease(14000, label="exploration") as held:   # waits (interruptibly) until granted
        model = AutoModel.from_pretrained(...).to(held.cuda_device)

The lease is held by the calling process (its pid): it ends on ``release()`` (or the end of the
``with``), when the process exits, or after ``ttl_s``. Granted before CUDA starts in the process,
it sets ``CUDA_VISIBLE_DEVICES`` to the GPUs of the process's live leases in grant order (the first
lease's is ``cuda:0``; a later one's is added at the end, so no live lease's index moves);
``cuda_device`` says which index to use. :func:`model` returns the client that runs get from ``ctx.model(name)``: the one copy
the host's model host holds, no second load.

Standard library only, like the rest of the client.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from html import escape
from typing import Any
from urllib.parse import quote

from ..contract import LEASE_ENDED, LEASE_GRANTED, LEASE_QUEUED
from .errors import EvalSchedClientError, EvalSchedError, ServerNotFound
from .live_feed import LiveFeed
from .rest_client import EvalSchedClient

__all__ = ["Lease", "LeaseTimeout", "lease", "lease_path", "looks_like_lease_id", "model"]

# What the server's ids look like (``lease-20261201T193620.619700-28238d``, docs/how-it-works.md).
_LEASE_ID = re.compile(r"lease-[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_lease_id(text: str) -> bool:
    return _LEASE_ID.fullmatch(text) is not None


def lease_path(lease_id: str) -> str:
    """The API path of one lease: the id one quoted path segment, so that no id (``../runs/X``)
    reaches another resource; ``.`` and ``..``, which quoting leaves as they are, are refused."""
    if lease_id in ("", ".", ".."):
        raise EvalSchedClientError(f"{lease_id!r} is not a lease id (lease-...)")
    return "leases/" + quote(lease_id, safe="")


class LeaseTimeout(EvalSchedClientError, TimeoutError):
    """The lease was not granted within ``timeout`` seconds (it was released)."""


class Lease:
    """A lease of VRAM held by this process: ``id``, ``devices``, ``cuda_device``, ``record``;
    ``release()``; a context manager (released at the end of the ``with``)."""

    def __init__(self, client: EvalSchedClient, record: dict) -> None:
        self.client = client
        self.record = dict(record)
        self.id: str = record["id"]
        self.cuda_device: str | None = None  # what to pass to torch: "cuda:0"...
        self.note = ""  # how the CUDA devices were set (or why not)

    @property
    def devices(self) -> list[int]:
        """The leased GPU indices, in NVML's (PCI bus) order."""
        return list(self.record.get("devices") or [])

    @property
    def state(self) -> str:
        return str(self.record.get("state"))

    def refresh(self) -> dict:
        self.record = self.client.request("GET", lease_path(self.id))
        if self.record.get("state") == LEASE_ENDED:
            _forget(self.id)
        return self.record

    def release(self) -> None:
        """End the lease (idempotent); what it held goes to what waits, and its GPUs leave this
        process's ``CUDA_VISIBLE_DEVICES`` if CUDA has not started."""
        if self.record.get("state") != LEASE_ENDED:
            self.client.request("DELETE", lease_path(self.id))
            self.record = {**self.record, "state": LEASE_ENDED}
        _forget(self.id)
        with _held_lock:
            _answered.discard(self.id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        where = ", ".join(f"GPU {d}" for d in self.devices) or "no GPU yet"
        return f"<Lease {self.id} {self.state} {self.record.get('vram_mb')} MB on {where}>"

    def _repr_html_(self) -> str:
        rows = [
            ("lease", self.id),
            ("state", self.state),
            (
                "VRAM",
                f"{self.record.get('vram_mb')} MB per GPU"
                + (" (exclusive)" if self.record.get("exclusive_gpu") else ""),
            ),
            ("GPUs", ", ".join(str(d) for d in self.devices) or "-"),
            ("use", self.cuda_device or "-"),
            ("note", self.note),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows if v
        )
        return f"<table class='evalsched-lease'>{body}</table>"


def default_label() -> str:
    """The notebook's name in a kernel started for one, else the program and pid."""
    session = os.environ.get("JPY_SESSION_NAME")
    if session:
        return os.path.basename(session) or session
    return f"{os.path.basename(sys.argv[0] or 'python')} (pid {os.getpid()})"


def lease(
    vram_mb: int = 0,
    gpus: int = 1,
    exclusive_gpu: bool = False,
    timeout: float | None = None,
    label: str | None = None,
    *,
    priority: str = "high",
    ttl_s: float | None = None,
    pid: int | None = None,
    set_cuda_visible_devices: bool = True,
    progress: bool = True,
    client: EvalSchedClient | None = None,
) -> Lease:
    """Reserve ``vram_mb`` MB on each of ``gpus`` GPUs (or whole GPUs: ``exclusive_gpu``) in the
    host's ledger, for this process (``pid``, default: this one); wait until it is granted.

    While it waits, the reason is shown (a line that updates in a notebook, stderr elsewhere);
    interrupting the kernel (or Ctrl-C) stops waiting and withdraws the request, also one that
    comes while the request is sent (the lease its lost answer named is found and withdrawn). After ``timeout``
    seconds without a grant the request is withdrawn and :class:`LeaseTimeout` raised. Granted
    before CUDA is initialised in this process, ``CUDA_VISIBLE_DEVICES`` is set to the GPUs of this
    process's live leases, this one's added at the end (the first lease's GPU is ``cuda:0``);
    ``cuda_device`` names the index to use (docs/leases.md).
    """
    client = client or EvalSchedClient()
    body = {
        "vram_mb": vram_mb,
        "gpus": gpus,
        "exclusive_gpu": exclusive_gpu,
        "priority": priority,
        "pid": os.getpid() if pid is None else pid,
        "ttl_s": ttl_s,
        "label": label if label is not None else default_label(),
    }
    # The request and its withdrawal in one try: a Ctrl-C (a kernel's interrupt) at any point
    # leaves nothing on the server; the caller never got the lease to release it.
    held: Lease | None = None
    try:
        # (a Ctrl-C while another thread's request holds the lock: nothing was sent)
        with _requesting:
            try:
                held = Lease(client, client.request("POST", "leases", body=body))
                with _held_lock:
                    _answered.add(held.id)
            except BaseException as exc:
                if held is None and _may_be_recorded(exc):
                    _withdraw_unanswered(client, body)  # still under the lock: see _requesting
                raise
        if held.state == LEASE_QUEUED:
            _wait_for_grant(held, timeout, progress)
        if held.state != LEASE_GRANTED:
            raise EvalSchedClientError(f"lease {held.id} ended before it was granted: {held.record.get('reason')}")
        if pid is None or pid == os.getpid():
            _forget_ended(held)
            _point_cuda_at(held, set_cuda_visible_devices)
        return held
    except BaseException:
        if held is not None:
            _withdraw(held)
        raise


def _may_be_recorded(exc: BaseException) -> bool:
    """Whether a lease request that raised ``exc`` may be on the server all the same: its answer
    was lost (a Ctrl-C while it was read, a timeout, a dropped connection), not refused."""
    if isinstance(exc, EvalSchedError):
        # A 4xx: refused, nothing made. A 5xx may come from a proxy in front of the server
        # (JupyterHub's: 502, 504) after the server took the request; a 200 that is not JSON
        # made the lease.
        return not 400 <= exc.status < 500
    if isinstance(exc, ServerNotFound):
        return exc.maybe_received
    return True


def _withdraw_unanswered(client: EvalSchedClient, body: dict[str, Any]) -> None:
    """Withdraw the lease a request whose answer was lost may have made: a live lease for the same
    pid, with the same figures and label, that no ``lease()`` of this process was answered with
    (another thread's, one held). Best effort: a server gone or slow, the lease ends with its
    process."""
    try:
        live = client.request("GET", "leases", timeout=_FORGET_TIMEOUT_S)["leases"]
    except (EvalSchedClientError, KeyError, TypeError):
        return
    with _held_lock:
        known = set(_answered)
    # As the server records the request: it strips the label.
    wanted = {**body, "label": str(body["label"]).strip()}
    for record in live:
        if record.get("id") not in known and all(record.get(k) == wanted[k] for k in _REQUEST_FIGURES):
            try:
                client.request("DELETE", lease_path(record["id"]), timeout=_FORGET_TIMEOUT_S)
            except EvalSchedClientError:
                pass


# What a lease record repeats of its request (``ttl_s`` not: the server may fill it in).
_REQUEST_FIGURES = ("vram_mb", "gpus", "exclusive_gpu", "priority", "pid", "label")


# How long a refresh of another held lease may take in lease(): one whose server is gone must not
# hold up the new lease for the client's whole timeout (30 s), each.
_FORGET_TIMEOUT_S = 3.0


def _forget_ended(new: Lease) -> None:
    """Forget the leases of this process that ended without a word here (ttl, released by id
    elsewhere, ended and then pruned by the server: a 404), so that their GPUs do not stay in
    ``CUDA_VISIBLE_DEVICES`` beside ``new``'s."""
    with _held_lock:
        others = [held for held in _held.values() if held.id != new.id]
    for held in others:
        try:
            record = held.client.request("GET", lease_path(held.id), timeout=_FORGET_TIMEOUT_S)
        except EvalSchedError as e:
            if e.status == 404:  # the server keeps the newest ended leases only
                held.record = {**held.record, "state": LEASE_ENDED}  # (its release() sends nothing)
                _forget(held.id)
            continue  # otherwise unsure: keep it
        except EvalSchedClientError:
            continue  # its server is gone or slow: keep it
        held.record = record
        if record.get("state") == LEASE_ENDED:
            _forget(held.id)


def _withdraw(held: Lease) -> None:
    try:
        held.release()
    except EvalSchedClientError:
        pass  # the server is gone: the lease ends with this process anyway


class _LeaseTracker:
    """Keeps one lease's record current for a :class:`LiveFeed`; done once it is not queued."""

    queue_limit = 0  # the snapshot's queue is not read

    def __init__(self, held: Lease, on_change: Any) -> None:
        self.held = held
        self.on_change = on_change
        self._shown: dict | None = None

    @property
    def done(self) -> bool:
        return self.held.record.get("state") != LEASE_QUEUED

    def apply(self, event: dict) -> None:
        rec = event.get("lease") if event.get("type") == "lease" else None
        if isinstance(rec, dict) and rec.get("id") == self.held.id:
            self.held.record = dict(rec)

    def wants_read(self, now: float) -> bool:
        return False

    def read(self, client: Any) -> None:
        self.held.refresh()

    def notify(self) -> None:
        if self.held.record != self._shown:
            self._shown = dict(self.held.record)
            self.on_change(self.held.record)


def _wait_for_grant(held: Lease, timeout: float | None, progress: bool) -> None:
    show = _WaitDisplay(held) if progress else None
    tracker = _LeaseTracker(held, show.update if show is not None else (lambda record: None))
    feed = LiveFeed(held.client, tracker, poll_s=1.0, safety_poll_s=3.0)
    try:
        if not feed.run(timeout):
            raise LeaseTimeout(
                f"lease {held.id} was not granted within {timeout:g} s ({held.record.get('reason')}); "
                "the request was withdrawn"
            )
    finally:
        if show is not None:
            show.finish()


class _WaitDisplay:
    """What a waiting lease shows: an updating line in a notebook, a line on stderr elsewhere."""

    def __init__(self, held: Lease) -> None:
        self.held = held
        self.started = time.monotonic()
        self._handle: Any = None
        self._last = ""
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
            from IPython.display import HTML, display

            self._handle = display(HTML(self._html(held.record)), display_id=True)

    def _text(self, record: dict) -> str:
        waited = time.monotonic() - self.started
        return f"lease {record.get('id')}: waiting {waited:.0f} s: {record.get('reason') or 'queued'}"

    def _html(self, record: dict) -> str:
        return f"<code>{escape(self._text(record))}</code>"

    def update(self, record: dict) -> None:
        if record.get("state") != LEASE_QUEUED:
            return
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(self._html(record)))
        else:
            text = self._text(record)
            if text != self._last:
                print(text, file=sys.stderr)
                self._last = text

    def finish(self) -> None:
        record = self.held.record
        state = record.get("state")
        line = f"lease {record.get('id')}: {state}" + (
            f" on GPU {', '.join(str(d) for d in record.get('devices') or [])}" if state == LEASE_GRANTED else ""
        )
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(f"<code>{escape(line)}</code>"))
        elif self._last:
            print(line, file=sys.stderr)


# ------------------------------------------------------------- CUDA_VISIBLE_DEVICES of this process

# The live leases this process holds (by id, in grant order) and what CUDA_VISIBLE_DEVICES and
# CUDA_DEVICE_ORDER were before the first of them set them: several leases share the one variable.
_held: dict[str, Lease] = {}
_held_lock = threading.RLock()
# The ids lease() was answered with in this process, until released here: a lease request whose
# answer was lost is any other (_withdraw_unanswered).
_answered: set[str] = set()
# Held by lease() while its request is in flight, and while it looks for the lease of a request
# whose answer was lost: another thread's request with the same figures, recorded but not yet
# answered, would be taken for it. One request of this process at a time (a POST, not the wait
# for the grant).
_requesting = threading.Lock()
_CUDA_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_saved_env: dict[str, str | None] | None = None  # None: the variables are not ours


def visible_order(current: list[int], held: list[list[int]]) -> list[int]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` should show for the leases ``held`` (each one's devices,
    in grant order): those of ``current`` still held, in their order, so that no live lease's
    index moves when a lease is added, then the new ones at the end."""
    wanted = {d for devices in held for d in devices}
    order = [d for d in current if d in wanted]
    for devices in held:
        order.extend(d for d in devices if d not in order)
    return order


def cuda_index(visible: str | None, device: int) -> str | None:
    """``cuda:N`` for GPU ``device`` (NVML index) under ``CUDA_VISIBLE_DEVICES=visible``; None
    when it is not visible."""
    if visible is None:
        return f"cuda:{device}"
    order = [part.strip() for part in visible.split(",") if part.strip()]
    return f"cuda:{order.index(str(device))}" if str(device) in order else None


def _renumber(leases: list[Lease]) -> None:
    """Each lease's ``cuda_device`` (and note) under the current ``CUDA_VISIBLE_DEVICES``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for held in leases:
        if not held.devices:
            continue
        first = held.devices[0]
        held.cuda_device = cuda_index(visible, first)
        if held.cuda_device is None:
            held.note = (
                f"GPU {first} is not visible to this process (CUDA_VISIBLE_DEVICES={visible}): restart the "
                "kernel and take the lease before CUDA starts"
            )
        elif _saved_env is not None:
            held.note = f"CUDA_VISIBLE_DEVICES={visible}: {held.cuda_device} is GPU {first}"
        elif _cuda_initialized():
            held.note = f"CUDA was already initialised in this process: use {held.cuda_device} (GPU {first})"
        else:
            held.note = f"use {held.cuda_device} (GPU {first})"


def _show_held() -> None:
    """Point ``CUDA_VISIBLE_DEVICES`` at the GPUs of the leases held (where CUDA has not started)
    and renumber them; with none held, give the variables back the values they had."""
    global _saved_env
    leases = list(_held.values())
    if not _cuda_initialized():
        if leases:
            if _saved_env is None:
                _saved_env = {name: os.environ.get(name) for name in _CUDA_VARS}
                current: list[int] = []
            else:  # what we set last: the indices the live leases were given
                shown = os.environ.get("CUDA_VISIBLE_DEVICES") or ""
                current = [int(part) for part in shown.split(",") if part.strip().isdigit()]
            order = visible_order(current, [held.devices for held in leases])
            if order:
                os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices as NVML (and the ledger) number them
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in order)
        elif _saved_env is not None:
            for name, value in _saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _saved_env = None
    _renumber(leases)


def _point_cuda_at(held: Lease, set_visible: bool) -> None:
    """Count ``held`` among this process's leases; ``CUDA_VISIBLE_DEVICES`` = the GPUs of all of
    them (this one's added at the end) if CUDA has not started in this process; else (or without
    ``set_visible``) ``cuda_device`` is the index of its first GPU among those this process sees."""
    if not held.devices:
        return
    with _held_lock:
        _held[held.id] = held
        if set_visible:
            _show_held()
        else:
            _renumber([held])
    if not held.note.startswith("CUDA_VISIBLE_DEVICES="):
        print(f"lease {held.id}: {held.note}", file=sys.stderr)


def _forget(lease_id: str) -> None:
    """``lease_id`` ended: its GPUs leave ``CUDA_VISIBLE_DEVICES`` (where CUDA has not started)."""
    with _held_lock:
        if _held.pop(lease_id, None) is not None:
            _show_held()


def _cuda_initialized() -> bool:
    """Whether a CUDA context may exist in this process already (then CUDA_VISIBLE_DEVICES is read)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return True
        except Exception:
            return True  # cannot tell: assume the worst
    # Other frameworks read CUDA_VISIBLE_DEVICES when they first touch the GPU; once imported we
    # cannot tell whether they did, so only torch (which can say) counts as "not yet".
    return any(name in sys.modules for name in ("jax", "cupy", "tensorflow", "numba.cuda"))


# --------------------------------------------------------------------------- shared models

_models: dict[tuple[str, str], Any] = {}
_models_lock = threading.Lock()


def model(name: str, *, client: EvalSchedClient | None = None) -> Any:
    """The host's shared model ``name``: the same client a run gets from ``ctx.model(name)``
    (``client(inputs, **kwargs) -> outputs``; a list is a batch), served by the model host's one
    copy. Its host is started if it is not running; the model loads at the first call."""
    from ..shared_models.client import connect

    client = client or EvalSchedClient()
    key = (client.base_url, name)
    with _models_lock:
        known = _models.get(key)
        if known is not None:
            return known
    answer = client.request("POST", f"models/{quote(name, safe='')}/connect", body={})
    shared = connect(answer["url"])
    with _models_lock:
        return _models.setdefault(key, shared)
