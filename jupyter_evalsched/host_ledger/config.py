"""The host ledger's policy file (JSON), read once at start. Every mistake is a ConfigError
naming the key, so that a bad file stops the ledger with a clear message, never half-applies.

::

    {
      "usable_vram_mb": {"0": 22000, "1": 22000},   // or one number for every GPU
      "quota": {"default": {"vram_mb": 40000, "gpus": 2, "leases": 2},
                "alice": {"vram_mb": 20000}},
      "admin_group": "evalsched-admin",
      "socket_mode": "0660", "socket_group": "gpu-users",
      "reclaim_window_s": 30,
      "state_file": "/var/lib/evalsched/host-ledger.json",
      "virtual_gpus": [24000, 24000], "virtual_gpu_processes": "/path/table.json"
    }
"""

from __future__ import annotations

import grp
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .policy import Quota

DEFAULT_SOCKET = "/run/evalsched/ledger.sock"
DEFAULT_RECLAIM_WINDOW_S = 30.0
MAX_RECLAIM_WINDOW_S = 86400.0  # a day
KEYS = {
    "usable_vram_mb",
    "quota",
    "admin_group",
    "socket_mode",
    "socket_group",
    "reclaim_window_s",
    "state_file",
    "virtual_gpus",
    "virtual_gpu_processes",
}
QUOTA_KEYS = ("vram_mb", "gpus", "leases")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    usable_vram_mb: dict[int, int] = field(default_factory=dict)  # per GPU index
    usable_all_mb: int | None = None  # every GPU not named above
    quotas: dict[str, Quota] = field(default_factory=dict)
    default_quota: Quota = Quota()
    admin_group: str | None = None
    socket_mode: int = 0o666
    socket_group: str | None = None
    reclaim_window_s: float = DEFAULT_RECLAIM_WINDOW_S
    state_file: str | None = None  # default: next to the socket
    virtual_gpus: tuple[int, ...] = ()
    virtual_gpu_processes: str | None = None

    def quota_of(self, names: Iterable[str]) -> Quota:
        """The quota of a user known by ``names`` (a uid's names): of each limit, the strictest set
        under any of them (a quota set under one name holds, whichever the host tells), or the
        default quota when none is named."""
        found = [self.quotas[n] for n in sorted(set(names)) if n in self.quotas]
        if not found:
            return self.default_quota

        def strictest(limits: list[int | None]) -> int | None:
            return min((v for v in limits if v is not None), default=None)

        return Quota(*(strictest([getattr(q, k) for q in found]) for k in QUOTA_KEYS))

    def usable(self, index: int, total_mb: int) -> int:
        value = self.usable_vram_mb.get(index, self.usable_all_mb)
        return total_mb if value is None else max(0, min(value, total_mb))


def _count(value: Any, key: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if type(value) is not int or value < 0:
        raise ConfigError(f"{key} must be a whole number >= 0{' or null' if allow_none else ''}, got {value!r}")
    return value


def _quota(raw: Any, key: str) -> Quota:
    if not isinstance(raw, dict):
        raise ConfigError(f"{key} must be an object with {', '.join(QUOTA_KEYS)}")
    unknown = sorted(set(raw) - set(QUOTA_KEYS))
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r} (known: {', '.join(QUOTA_KEYS)})")
    return Quota(**{k: _count(raw.get(k), f"{key}.{k}") for k in QUOTA_KEYS})


def parse_config(raw: Any) -> LedgerConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the host ledger's config must be a JSON object")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    per_gpu: dict[int, int] = {}
    every: int | None = None
    usable = raw.get("usable_vram_mb")
    if isinstance(usable, dict):
        for k, v in usable.items():
            # ASCII digits only: "²" and "٣" are digits to str.isdigit, and no GPU's index.
            if not (str(k).isascii() and str(k).isdigit() and len(str(k)) <= 6):
                raise ConfigError(f"usable_vram_mb: {k!r} is not a GPU index")
            per_gpu[int(k)] = _count(v, f"usable_vram_mb.{k}", allow_none=False) or 0
    else:
        every = _count(usable, "usable_vram_mb")
    quotas_raw = raw.get("quota", {})
    if not isinstance(quotas_raw, dict):
        raise ConfigError('quota must be an object: {"default": {...}, "USER": {...}}')
    quotas = {str(user): _quota(q, f"quota.{user}") for user, q in quotas_raw.items() if user != "default"}
    default = _quota(quotas_raw.get("default", {}), "quota.default")
    mode_raw = raw.get("socket_mode", "0666")
    try:
        mode = int(mode_raw, 8) if isinstance(mode_raw, str) else int(mode_raw)
    except (TypeError, ValueError):
        raise ConfigError(f'socket_mode must be an octal string like "0660", got {mode_raw!r}') from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"socket_mode {mode_raw!r} is not a file mode")
    window = raw.get("reclaim_window_s", DEFAULT_RECLAIM_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, int | float) or not math.isfinite(window) or window < 0:
        raise ConfigError(f"reclaim_window_s must be a number of seconds >= 0, got {window!r}")
    if window > MAX_RECLAIM_WINDOW_S:  # (1e300 would be a window that never closes)
        raise ConfigError(f"reclaim_window_s must be at most {MAX_RECLAIM_WINDOW_S:g} seconds (a day), got {window!r}")
    sizes = raw.get("virtual_gpus") or []
    if not isinstance(sizes, list) or not all(type(s) is int and s > 0 for s in sizes):
        raise ConfigError(f"virtual_gpus must be a list of sizes in MB, got {sizes!r}")
    strings = {}
    for key in ("admin_group", "socket_group", "state_file", "virtual_gpu_processes"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{key} must be a non-empty string or null, got {value!r}")
        strings[key] = value
    group = strings["socket_group"]
    if group is not None:
        try:
            grp.getgrnam(group)
        except KeyError:
            raise ConfigError(f"socket_group: no group {group!r} on this host") from None
    return LedgerConfig(
        usable_vram_mb=per_gpu,
        usable_all_mb=every,
        quotas=quotas,
        default_quota=default,
        socket_mode=mode,
        reclaim_window_s=float(window),
        virtual_gpus=tuple(sizes),
        **strings,
    )


def load_config(path: str | None) -> LedgerConfig:
    if not path:
        return LedgerConfig()
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{os.path.basename(path)}: {exc}") from None
