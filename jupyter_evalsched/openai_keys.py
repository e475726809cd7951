"""Per-run API keys for the OpenAI-compatible routes: ``OPENAI_API_KEY`` in a run's environment.

A key names its run and is signed with a secret of the serving model host manager (HMAC-SHA256),
so the server keeps no table of keys: it checks the signature, then that the run still lives.
A key is worth nothing once its run has ended, on another server, or after a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import re

PREFIX = "esk-"
_KEY = re.compile(r"esk-(?P<run>[A-Za-z0-9._-]{1,200})-(?P<mac>[0-9a-f]{64})")


def run_key(secret: bytes, run_id: str) -> str:
    return f"{PREFIX}{run_id}-{_mac(secret, run_id)}"


def run_of_key(secret: bytes, key: str) -> str | None:
    """The run a key was made for, or None when it is not one of this secret's keys."""
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    if not hmac.compare_digest(match["mac"], _mac(secret, match["run"])):
        return None
    return match["run"]


def _mac(secret: bytes, run_id: str) -> str:
    return hmac.new(secret, run_id.encode(), hashlib.sha256).hexdigest()
