"""Wire format between runs and the model host. Standard library only (runs import it).

A message is an 8-byte big-endian length followed by a pickle (protocol 5) of a dict.

Why pickle and not JSON: the socket is reachable only by the owner (0600 socket in a 0700
directory, and the host checks the peer's uid with SO_PEERCRED), and that user can already run
code as itself, so unpickling from the peer grants nothing new. In exchange, inputs may be any
picklable value (bytes of an image, tuples, ints as dict keys, NaN) with no base64 or schema, and
nested float lists encode and decode several times faster than JSON. Outputs are still converted
to plain Python by the host (tensors and numpy arrays become lists, numpy scalars floats or ints),
and the client unpickles them with ``PlainUnpickler``, which refuses any class outside a short
list of builtins: a run never imports torch or numpy because of something the host sent.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct

HEADER = struct.Struct(">Q")
PROTOCOL = 5
MAX_MESSAGE_BYTES = 4 << 30  # 4 GiB: anything bigger is a corrupted header, not a message

_SAFE_BUILTINS = frozenset({"set", "frozenset", "complex", "bytearray", "slice", "range"})


class ProtocolError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: containers, numbers, strings, bytes and a few builtins."""

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data is accepted")


def encode(message: dict) -> bytes:
    payload = pickle.dumps(message, protocol=PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        n = sock.recv_into(view[received:], size - received)
        if n == 0:
            raise ProtocolError("connection closed by the peer")
        received += n
    return bytes(buffer)


def recv_message(sock: socket.socket, *, plain_only: bool) -> dict:
    """Read one message; ``plain_only`` selects the restricted unpickler (the client side)."""
    (size,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {size} bytes announced: not a message of this protocol")
    payload = _recv_exact(sock, size)
    try:
        if plain_only:
            message = PlainUnpickler(io.BytesIO(payload)).load()
        else:
            message = pickle.loads(payload)
    except Exception as exc:  # a broken payload is a protocol error, whatever pickle raised
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a dict message, got {type(message).__name__}")
    return message


def send_message(sock: socket.socket, message: dict) -> None:
    sock.sendall(encode(message))
