"""The host ledger's wire format: a 4-byte big-endian length, then that many bytes of one JSON
object (UTF-8). Standard library only.

Several users' processes share this socket, so nothing a peer sends may hold anyone else: a frame
is at most :data:`MAX_FRAME_BYTES` (its header alone says so, before anything is read), and once a
frame's first byte has arrived the rest must arrive within :data:`FRAME_DEADLINE_S`. A connection
that breaks either rule, or sends something that is not a JSON object, is closed; each connection
is served on its own, so the others never notice. The ledger's own answers may be larger (up to
:data:`MAX_ANSWER_BYTES`: the whole view of a busy host), as the ledger alone writes them.

Requests carry ``op`` and an ``id`` the answer repeats; answers have ``ok`` (and ``error`` when
not ok). Events the ledger sends unasked (a waiting request granted) have ``event`` and no ``id``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024  # what the ledger reads from anyone
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # what a client reads from the ledger (a busy host's view, itself bounded)
FRAME_DEADLINE_S = 2.0  # for the rest of a frame once its first byte is in
HELLO_DEADLINE_S = 5.0  # for a new connection's first frame


class ProtocolError(ConnectionError):
    """The peer closed the connection or broke the protocol; the connection is done."""


def encode(message: dict[str, Any], max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > max_bytes:
        raise ProtocolError(f"message of {len(payload)} bytes: over the {max_bytes}-byte limit")
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"not a JSON frame: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a JSON object, got {type(message).__name__}")
    return message


def _size(header: bytes, max_bytes: int) -> int:
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes announced: over the {max_bytes}-byte limit")
    return int(size)


async def read_frame(
    reader: asyncio.StreamReader, idle_s: float | None = None, max_bytes: int = MAX_FRAME_BYTES
) -> dict[str, Any]:
    """One message. ``idle_s``: how long to wait for its first byte (None: for ever)."""
    try:
        first = await asyncio.wait_for(reader.readexactly(1), idle_s)
        async with asyncio.timeout(FRAME_DEADLINE_S if max_bytes <= MAX_FRAME_BYTES else None):
            header = first + await reader.readexactly(HEADER.size - 1)
            payload = await reader.readexactly(_size(header, max_bytes))
    except asyncio.IncompleteReadError:
        raise ProtocolError("connection closed by the peer") from None
    except TimeoutError:
        raise ProtocolError("a frame did not arrive in time") from None
    return decode(payload)


def send_sync(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode(message))


def recv_sync(sock: socket.socket, timeout_s: float) -> dict[str, Any]:
    """One message from a blocking socket, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                chunk = sock.recv(n - len(out))
            except TimeoutError:
                raise ProtocolError("no answer in time") from None
            if not chunk:
                raise ProtocolError("connection closed by the peer")
            out += chunk
        return bytes(out)

    return decode(exactly(_size(exactly(HEADER.size), MAX_ANSWER_BYTES)))
