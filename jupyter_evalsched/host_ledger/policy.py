"""May this grant be made now? Pure decisions over the host's devices, the grants held and the
users' quotas; no I/O.

A grant holds ``vram_mb`` on each of its devices, or a whole device when ``exclusive`` (it is
then charged the device's usable VRAM). A user's quota caps the VRAM they hold over all devices,
the GPUs they hold grants on, and their leases. Fair share: among the requests that could be
granted now, the next grant goes to the user holding least VRAM (then the earliest request), and
the turns rotate (see turned_since), for waiting requests and between users' servers alike.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Quota:
    """What one user may hold at once; None is no limit."""

    vram_mb: int | None = None
    gpus: int | None = None
    leases: int | None = None


def quota_names_learnt(
    learnt: Mapping[int, frozenset[str]], found: Mapping[str, int | None]
) -> dict[int, frozenset[str]]:
    """The quota names each uid is known by, once the directory told ``found`` (each configured
    name's uid, or None where its lookup failed) after ``learnt``. Names are only ever added: a
    lookup that failed (the directory slow or down, the user renamed) takes no name from its uid,
    so no quota learnt is lost to the default; a name the directory now gives another uid holds
    for both (the same name's quota, whichever uid the user has)."""
    out = dict(learnt)
    for name, uid in found.items():
        if uid is not None and name not in out.get(uid, frozenset()):
            out[uid] = out.get(uid, frozenset()) | {name}
    return out


@dataclass(frozen=True, slots=True)
class HostDevice:
    index: int
    usable_mb: int
    unmanaged_mb: int = 0  # held by processes no grant accounts for


@dataclass(frozen=True, slots=True)
class Holding:
    """A grant as the policy sees it."""

    user: str
    devices: tuple[int, ...]
    vram_mb: int  # per device
    exclusive: bool = False
    kind: str = "run"  # "run", "lease" or "model"


@dataclass(frozen=True, slots=True)
class Ask:
    user: str
    vram_mb: int  # per device
    gpus: int = 1
    exclusive: bool = False
    kind: str = "run"
    devices: tuple[int, ...] | None = None  # these exact devices, or the policy's choice


@dataclass(frozen=True, slots=True)
class Decision:
    """``state``: "granted" (on ``devices``), "waiting" or "never" (can never fit: a 422)."""

    state: str
    devices: tuple[int, ...] = ()
    reason: str = ""


def charge(holding: Holding, device: HostDevice) -> int:
    return device.usable_mb if holding.exclusive else holding.vram_mb


@dataclass(slots=True)
class _UserLoad:
    mb: int = 0  # the VRAM held over all devices
    gpus: set[int] = field(default_factory=set)  # the devices held (named ones the host lacks too)
    leases: int = 0


@dataclass(slots=True)
class _Load:
    """What every decision over one set of grants reads, made in one walk of them: a pass over
    the waiting asks (or a demand) then costs each ask its own work. Walked again for each ask,
    one user's 1,024 grants and 256 waiting asks cost every request a quarter of a million steps,
    on the loop that serves every user."""

    allocated: dict[int, int] = field(default_factory=dict)
    exclusive: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)  # devices with any grant, 0 MB ones too
    by_user: dict[int, dict[str, int]] = field(default_factory=dict)  # device -> user -> MB
    users: dict[str, _UserLoad] = field(default_factory=dict)

    def user(self, name: str) -> _UserLoad:
        return self.users.get(name) or _UserLoad()

    def add(self, h: Holding, devices: Mapping[int, HostDevice]) -> None:
        mine = self.users.get(h.user)
        if mine is None:
            mine = self.users[h.user] = _UserLoad()
        mine.gpus.update(h.devices)
        if h.kind == "lease":
            mine.leases += 1
        for index in h.devices:
            dev = devices.get(index)
            if dev is None:
                continue
            mb = charge(h, dev)
            mine.mb += mb
            self.allocated[index] = self.allocated.get(index, 0) + mb
            self.held.add(index)
            per = self.by_user.setdefault(index, {})
            per[h.user] = per.get(h.user, 0) + mb
            if h.exclusive:
                self.exclusive.add(index)

    def plus(self, h: Holding, devices: Mapping[int, HostDevice]) -> _Load:
        """This load with ``h`` added, this one unchanged: a copy of the sums, not a walk of the
        grants (weighing one more grant costs no pass over every grant held)."""
        out = _Load(
            dict(self.allocated),
            set(self.exclusive),
            set(self.held),
            {index: dict(per) for index, per in self.by_user.items()},
            {name: _UserLoad(u.mb, set(u.gpus), u.leases) for name, u in self.users.items()},
        )
        out.add(h, devices)
        return out


def _load(devices: Mapping[int, HostDevice], holdings: Iterable[Holding]) -> _Load:
    load = _Load()
    for h in holdings:
        load.add(h, devices)
    return load


def held_mb(user: str, devices: Mapping[int, HostDevice], holdings: Iterable[Holding]) -> int:
    """The VRAM a user holds over all devices."""
    return sum(charge(h, devices[i]) for h in holdings if h.user == user for i in h.devices if i in devices)


def free_mb(device: HostDevice, load: _Load) -> int:
    return device.usable_mb - load.allocated.get(device.index, 0) - device.unmanaged_mb


def _fits(ask: Ask, device: HostDevice, load: _Load) -> bool:
    if device.index in load.exclusive:
        return False
    if ask.exclusive:
        # Alone on it: a grant of 0 MB (a CPU-light share of the GPU) is someone there all the same.
        return device.index not in load.held and device.unmanaged_mb == 0
    return ask.vram_mb <= free_mb(device, load)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _quota_reason(ask: Ask, mine: _UserLoad, quota: Quota) -> str:
    """Why the user's quota stops this ask now, or ""."""
    if quota.leases is not None and ask.kind == "lease":
        leases = mine.leases
        if leases + 1 > quota.leases:
            return f"quota: user {ask.user} may hold {_plural(quota.leases, 'lease')}; holds {leases}"
    if quota.gpus is not None:
        gpus = mine.gpus
        wanted = set(ask.devices) if ask.devices is not None else set()
        # Without named devices the policy may place it on GPUs already held: count the new ones
        # it must take at least.
        new = len(wanted - gpus) if ask.devices is not None else max(0, ask.gpus - len(gpus))
        if len(gpus) + new > quota.gpus:
            return f"quota: user {ask.user} may hold {_plural(quota.gpus, 'GPU')}; holds {len(gpus)}"
    if quota.vram_mb is not None and not ask.exclusive:
        held = mine.mb
        if held + ask.vram_mb * ask.gpus > quota.vram_mb:
            return f"quota: user {ask.user} may hold {quota.vram_mb} MB of VRAM; holds {held} MB"
    return ""


def never_reason(ask: Ask, devices: Mapping[int, HostDevice], quota: Quota) -> str:
    """Why this ask can never be granted, even on an idle host, or "" when it could be."""
    if ask.gpus < 1 or ask.vram_mb < 0:
        return "a grant needs at least 1 GPU and no negative VRAM"
    if ask.devices is not None:
        unknown = [i for i in ask.devices if i not in devices]
        if unknown:
            return f"no GPU {unknown[0]} on this host (GPUs: {', '.join(map(str, sorted(devices))) or 'none'})"
        if len(set(ask.devices)) != ask.gpus:
            return f"{_plural(ask.gpus, 'GPU')} asked but {len(set(ask.devices))} named"
        candidates = [devices[i] for i in ask.devices]
    else:
        candidates = list(devices.values())
    if ask.gpus > len(candidates):
        return f"needs {_plural(ask.gpus, 'GPU')}; the host has {len(devices)}"
    if quota.gpus is not None and ask.gpus > quota.gpus:
        return f"quota: user {ask.user} may hold {_plural(quota.gpus, 'GPU')}; the request needs {ask.gpus}"
    if quota.leases is not None and ask.kind == "lease" and quota.leases < 1:
        return f"quota: user {ask.user} may hold no lease"
    big_enough = sorted((d.usable_mb for d in candidates), reverse=True)[: ask.gpus]
    if not ask.exclusive and big_enough[-1] < ask.vram_mb:
        return f"needs {ask.vram_mb} MB per GPU on {_plural(ask.gpus, 'GPU')}; the largest GPUs have {big_enough[-1]} MB usable"
    need = sum(big_enough) if ask.exclusive else ask.vram_mb * ask.gpus
    if quota.vram_mb is not None and need > quota.vram_mb:
        return f"quota: user {ask.user} may hold {quota.vram_mb} MB of VRAM; the request needs {need} MB"
    return ""


def _capacity_reason(ask: Ask, candidates: Sequence[HostDevice], load: _Load) -> str:
    """Why no placement fits now, naming the device that comes closest and who holds it."""
    best = max(candidates, key=lambda d: (free_mb(d, load), -d.index))
    what = "a whole GPU" if ask.exclusive else f"{ask.vram_mb} MB on {_plural(ask.gpus, 'GPU')}"
    text = f"needs {what}; GPU {best.index} has {max(0, free_mb(best, load))} MB free of {best.usable_mb} MB usable"
    others = sorted(load.by_user.get(best.index, {}).items(), key=lambda kv: (-kv[1], kv[0]))
    for user, mb in others[:2]:
        text += f"; user {user} holds {mb} MB on GPU {best.index}"
    if best.unmanaged_mb:
        text += f"; processes outside the ledger hold {best.unmanaged_mb} MB on GPU {best.index}"
    return text


def decide(
    ask: Ask,
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quota: Quota,
    load: _Load | None = None,
) -> Decision:
    """Whether ``ask`` may be granted now, on which devices (the fullest that fit: packing leaves
    room for large requests), or why not. ``load``: ``holdings``' own, made once by a caller that
    decides for many asks."""
    never = never_reason(ask, devices, quota)
    if never:
        return Decision("never", reason=never)
    if load is None:
        load = _load(devices, holdings)
    mine = load.user(ask.user)
    why = _quota_reason(ask, mine, quota)
    if why:
        return Decision("waiting", reason=why)
    candidates = [devices[i] for i in ask.devices] if ask.devices is not None else list(devices.values())
    fitting = [d for d in candidates if _fits(ask, d, load)]
    if len(fitting) < ask.gpus:
        return Decision("waiting", reason=_capacity_reason(ask, candidates, load))
    held = mine.gpus
    # GPUs the user already holds first (a GPU quota counts GPUs), then the fullest that fit.
    fitting.sort(key=lambda d: (d.index not in held, free_mb(d, load), d.index))
    chosen = fitting[: ask.gpus]
    if quota.gpus is not None and len(held | {d.index for d in chosen}) > quota.gpus:
        return Decision(
            "waiting", reason=f"quota: user {ask.user} may hold {_plural(quota.gpus, 'GPU')}; holds {len(held)}"
        )
    if quota.vram_mb is not None and ask.exclusive:  # charged the whole GPUs it takes
        holds = mine.mb
        if holds + sum(d.usable_mb for d in chosen) > quota.vram_mb:
            return Decision(
                "waiting", reason=f"quota: user {ask.user} may hold {quota.vram_mb} MB of VRAM; holds {holds} MB"
            )
    return Decision("granted", devices=tuple(sorted(d.index for d in chosen)))


def retold_reason(
    ask: Ask,
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quota: Quota,
    load: _Load | None = None,
) -> str:
    """Why a grant re-told to a ledger that lost its state cannot be learnt beside ``holdings``
    (the grants it knows), or "". ``ask`` is the grant as told, on the GPUs it names. It is
    learnt as it is held, not placed anew: its GPUs' usable VRAM (a whole GPU charged all of it)
    and the user's quota must hold it, whoever else holds 0 MB there (a ledger of an earlier
    version granted a whole GPU beside 0 MB shares of it, which ``decide`` no longer does).
    ``load``: ``holdings``' own (see Retold)."""
    assert ask.devices is not None
    never = never_reason(ask, devices, quota)
    if never:
        return never
    if load is None:
        load = _load(devices, holdings)
    mine = load.user(ask.user)
    why = _quota_reason(ask, mine, quota)
    if why:
        return why
    named = [devices[i] for i in ask.devices]
    if quota.vram_mb is not None and ask.exclusive and mine.mb + sum(d.usable_mb for d in named) > quota.vram_mb:
        return f"quota: user {ask.user} may hold {quota.vram_mb} MB of VRAM; holds {mine.mb} MB"
    for device in named:
        charged = device.usable_mb if ask.exclusive else ask.vram_mb
        if load.allocated.get(device.index, 0) + charged > device.usable_mb:
            return _capacity_reason(ask, [device], load)
    return ""


class Retold:
    """Grants re-told in one reclaim, learnt one at a time (see retold_reason), each beside the
    grants known and those learnt before it: their load is made once, and each grant learnt is
    added to it. Made anew for each, 1,024 grants re-told walked half a million grants (a second
    on the loop that serves every user)."""

    def __init__(self, devices: Mapping[int, HostDevice], holdings: Iterable[Holding]) -> None:
        self.devices = devices
        self._load = _load(devices, holdings)

    def reason(self, ask: Ask, quota: Quota) -> str:
        """Why ``ask`` cannot be learnt now, or "" (then ``learn`` it, or not: nothing changes)."""
        return retold_reason(ask, self.devices, (), quota, self._load)

    def learn(self, holding: Holding) -> None:
        self._load.add(holding, self.devices)


def key_mismatch(held: Holding, ask: Ask) -> str:
    """How ``ask`` differs from ``held``, the grant its key already names ("" when it asks the
    same again: a retry whose answer was lost, answered with that grant). Its processes are no
    part of it: a retry may name the run's, which a re-tie gives the grant."""
    diffs = []
    if ask.kind != held.kind:
        diffs.append(f"kind {ask.kind}, not {held.kind}")
    if ask.exclusive != held.exclusive:
        diffs.append("whole GPUs, not shares" if ask.exclusive else "shares, not whole GPUs")
    if ask.vram_mb != held.vram_mb:
        diffs.append(f"{ask.vram_mb} MB per GPU, not {held.vram_mb} MB")
    if ask.gpus != len(held.devices):
        diffs.append(f"{_plural(ask.gpus, 'GPU')}, not {len(held.devices)}")
    elif ask.devices is not None and set(ask.devices) != set(held.devices):
        named = ", ".join(map(str, sorted(set(ask.devices))))
        diffs.append(f"GPU {named}, not GPU {', '.join(map(str, sorted(held.devices)))}")
    return "; ".join(diffs)


class Pick(NamedTuple):
    """The waiting ask to grant next: its position, its decision, and whether it takes a turn."""

    position: int
    decision: Decision
    turn: bool  # it takes the room of another user's ask that fits now (see turned_since)


def next_grant(
    waiting: Sequence[Ask],
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quotas: Mapping[str, Quota],
    turns: Mapping[str, int] | None = None,
    granted: Mapping[str, int] | None = None,
    demand: Sequence[Ask] = (),
) -> Pick | None:
    """Fair share: of the waiting asks (in arrival order) that could be granted now, the one of
    the user holding least VRAM, earliest first; but the turns rotate, as between servers: a user
    who took a turn since another user whose ask fits now was last granted goes behind that user
    (see turned_since; ``turns`` and ``granted`` as there). Holdings alone would let a user queue
    the next ask and give back what they hold: holding least whenever room is freed, they would
    hold it all along, and another's waiting ask would never be granted. The pick is a turn when
    it takes the room of another user's ask that fits now (each user's earliest that fits), or
    of another user's told ``demand`` that fits now (as deferred_to weighs it: a user's server
    that asks again as soon as its run ends holds least then, and would otherwise hold the room
    all along without ever taking a turn). A waiting ask that gives_way to a told ``demand`` is
    no pick, as an ask that does not wait is refused (one rule for both: else a client that
    queues its next ask and then gives the room back would beat the servers' fair share); a later
    ask of its user that leaves room for that demand may be the pick."""
    turns, granted = turns or {}, granted or {}
    load = _load(devices, holdings)
    fitting: dict[str, tuple[int, Decision]] = {}  # each user's earliest ask that fits now
    for position, ask in enumerate(waiting):
        if ask.user in fitting:
            continue
        decision = decide(ask, devices, holdings, quotas.get(ask.user, Quota()), load)
        if decision.state != "granted":
            continue
        if demand and gives_way(ask, demand, devices, holdings, quotas, turns, granted, load) is not None:
            continue
        fitting[ask.user] = (position, decision)
    if not fitting:
        return None

    def rank(user: str) -> tuple[bool, int, int]:
        # (behind another user here: a turn of its own since that user was last granted; what it
        # holds; its ask's position). A turn comes after its user's last grant, so "behind" only
        # points at users granted earlier: never round in a circle, someone is always first.
        others = [granted.get(other, 0) for other in fitting if other != user]
        behind = bool(others) and turns.get(user, 0) > min(others)
        return behind, load.user(user).mb, fitting[user][0]

    user = min(fitting, key=rank)
    position, decision = fitting[user]
    theirs = {waiting[p] for other, (p, _) in fitting.items() if other != user}
    theirs |= {a for a in demand if a.user != user and takes_room(a)}  # (a set: a queue repeats its asks)
    if not theirs:
        return Pick(position, decision, False)
    ask = waiting[position]
    after = [*holdings, Holding(user, decision.devices, ask.vram_mb, ask.exclusive, ask.kind)]
    then = _load(devices, after)
    turn = any(
        decide(other, devices, holdings, quotas.get(other.user, Quota()), load).state == "granted"
        and decide(other, devices, after, quotas.get(other.user, Quota()), then).state != "granted"
        for other in theirs
    )
    return Pick(position, decision, turn)


def why_waiting(
    waiting: Sequence[Ask],
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quotas: Sequence[Quota],
) -> list[str]:
    """Why each of ``waiting`` (with its user's quota) is not granted now."""
    load = _load(devices, holdings)
    return [decide(ask, devices, holdings, quota, load).reason for ask, quota in zip(waiting, quotas, strict=True)]


# ---------------------------------------------------------------------- fair share between servers
# A user's server asks without waiting (its own admission decides) and tells the ledger the GPU
# work it has queued (its demand, as asks). These decide when an ask is held back for that demand.


def takes_room(ask: Ask) -> bool:
    """Whether ``ask`` needs any room: a 0 MB share of a GPU fits wherever no grant holds the GPU
    whole, so no grant but a whole GPU takes it, and a demand for it keeps nobody's room."""
    return ask.exclusive or ask.vram_mb > 0


def deferred_to(
    ask: Ask,
    demand: Sequence[Ask],
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quotas: Mapping[str, Quota],
    behind: Collection[str] = frozenset(),
    ahead: Collection[str] = frozenset(),
    load: _Load | None = None,
) -> int | None:
    """Fair share for an ask that does not wait: the position in ``demand`` (the other users'
    told asks) of the ask it must give way to, or None. It gives way only when granting it now
    would take the room of a demanded ask that fits now (that ask would no longer fit), of a user
    holding less VRAM than the asker and not ``behind`` it (see turned_since), or of a user
    ``ahead`` of it, whatever either holds (see owed_turns); of several, a user ahead first, then
    the one holding least, earliest first. An ask that leaves room for every such demanded ask is
    never held back, whatever the others tell. ``load``: ``holdings``' own (see decide)."""
    now = _load(devices, holdings) if load is None else load
    mine = decide(ask, devices, holdings, quotas.get(ask.user, Quota()), now)
    if mine.state != "granted":
        return None
    grant = Holding(ask.user, mine.devices, ask.vram_mb, ask.exclusive, ask.kind)
    after = [*holdings, grant]
    then = now.plus(grant, devices)
    asker = now.user(ask.user).mb
    best: tuple[bool, int, int] | None = None  # (not ahead, what its user holds, position)
    for position, other in enumerate(demand):
        if other.user == ask.user or other.user in behind or not takes_room(other):
            continue
        owed = other.user in ahead
        rank = (not owed, now.user(other.user).mb, position)
        if (not owed and rank[1] >= asker) or (best is not None and rank >= best):
            continue
        quota = quotas.get(other.user, Quota())
        fits_now = decide(other, devices, holdings, quota, now).state == "granted"
        if fits_now and decide(other, devices, after, quota, then).state != "granted":
            best = rank
    return None if best is None else best[2]


def gives_way(
    ask: Ask,
    demand: Sequence[Ask],
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quotas: Mapping[str, Quota],
    turns: Mapping[str, int],
    granted: Mapping[str, int],
    load: _Load | None = None,
) -> int | None:
    """Fair share against the other users' told ``demand``, for an ask that waits (next_grant)
    and for one that does not alike: deferred_to, with the users behind and ahead of ``ask``'s
    as the turns rotate (turned_since, owed_turns; ``turns`` and ``granted`` as there). The
    position in ``demand`` of the ask it gives way to, or None. Never both ways round: a user
    gives way to another holding less that took no turn since the asker's last grant, or to one
    whose last grant came before a turn of the asker's; a turn comes at its user's grant, so no
    two users can each give way to the other, and room given way for waits at most for a turn."""
    behind = turned_since(ask.user, turns, granted)
    ahead = owed_turns(ask.user, {a.user for a in demand}, turns, granted)
    return deferred_to(ask, demand, devices, holdings, quotas, behind, ahead, load)


def given_way_to(
    asks: Sequence[Ask],
    demand: Sequence[Ask],
    devices: Mapping[int, HostDevice],
    holdings: Sequence[Holding],
    quotas: Mapping[str, Quota],
    turns: Mapping[str, int],
    granted: Mapping[str, int],
) -> list[int | None]:
    """gives_way for each of ``asks``, over one walk of the grants."""
    load = _load(devices, holdings)
    return [gives_way(ask, demand, devices, holdings, quotas, turns, granted, load) for ask in asks]


def turned_since(asker: str, turns: Mapping[str, int], granted: Mapping[str, int]) -> frozenset[str]:
    """The users who go behind ``asker`` in fair share, between servers (deferred_to) and for
    waiting asks (next_grant): each took a turn (was granted room another user gave way for, or
    that another user's waiting ask fit in) after ``asker`` was last granted. ``turns`` and
    ``granted``: when each user last did, on one count of the grants made. A rotation: holdings
    alone would let a user holding little take each turn, give it back at once and be the one
    holding least again, holding the others back for ever while holding almost nothing."""
    since = granted.get(asker, 0)
    return frozenset(user for user, turn in turns.items() if turn > since)


def owed_turns(
    asker: str, users: Iterable[str], turns: Mapping[str, int], granted: Mapping[str, int]
) -> frozenset[str]:
    """Of ``users``, those ``asker`` goes behind (deferred_to's ``ahead``): it took a turn after
    each was last granted (turned_since, the other way round). Holding less is not all: a user's
    server that asks again as soon as its run ends holds least whenever room is freed."""
    mine = turns.get(asker, 0)
    return frozenset(user for user in users if user != asker and mine > granted.get(user, 0))


def covers(grant: Holding, ask: Ask) -> bool:
    """Whether ``grant`` is the room ``ask`` wants: as many GPUs (the ones it names), each with
    at least its VRAM, or whole GPUs (what an exclusive ask wants), and of its kind (a lease or
    a model's VRAM held by a user's server is no run's room: demand asks are runs' unless told)."""
    if grant.kind != ask.kind:
        return False
    if len(grant.devices) < ask.gpus:
        return False
    if ask.devices is not None and not set(ask.devices) <= set(grant.devices):
        return False
    if ask.exclusive:
        return grant.exclusive
    return grant.exclusive or grant.vram_mb >= ask.vram_mb


def met_by(grant: Holding, demand: Sequence[Ask]) -> int | None:
    """The position of the demanded ask that ``grant`` serves (the largest it covers: the queued
    work it was asked for), or None."""
    served = [(a.exclusive, a.vram_mb * a.gpus, -i) for i, a in enumerate(demand) if covers(grant, a)]
    return -max(served)[2] if served else None
