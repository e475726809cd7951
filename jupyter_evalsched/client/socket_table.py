"""The host's listening TCP sockets and their owners, from the kernel's tables (``/proc/net/tcp``
and ``/proc/net/tcp6``, Linux): whose socket a connection to an address and port reaches, told
before anything is sent there. Standard library only: the client reads it (the server's
``internal.peer_uid`` has its own reader of ``/proc/net/tcp``)."""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
LISTEN = "0A"  # the state column of a listening socket (TCP_LISTEN)
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_V4_WILDCARD = ipaddress.IPv4Address("0.0.0.0")
_V6_WILDCARD = ipaddress.IPv6Address("::")


@dataclass(frozen=True)
class Listener:
    address: IPAddress
    port: int
    uid: int


def table_address(field: str) -> tuple[IPAddress, int]:
    """An address column of the tables, ``0100007F:1F90`` -> (127.0.0.1, 8080): the address as
    32-bit words, each printed in hex in the host's byte order (8 digits for IPv4, 32 for IPv6),
    and the port in hex. Raises ValueError for anything else."""
    hexaddr, sep, hexport = field.partition(":")
    if not sep or len(hexaddr) not in (8, 32):
        raise ValueError(f"not an address of /proc/net/tcp: {field!r}")
    raw = b"".join(int(hexaddr[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hexaddr), 8))
    return ipaddress.ip_address(raw), int(hexport, 16)


def parse_listeners(text: str) -> list[Listener]:
    """The listening sockets of a table's text (its header, and lines it cannot read, skipped)."""
    found = []
    for line in text.splitlines():
        fields = line.split()  # sl local_address rem_address st ... uid (the 8th)
        if len(fields) < 8 or fields[3] != LISTEN:
            continue
        try:
            address, port = table_address(fields[1])
            found.append(Listener(address, port, int(fields[7])))
        except ValueError:
            continue
    return found


def read_listeners() -> list[Listener] | None:
    """The host's listening TCP sockets, or None where the tables cannot be read (not Linux)."""
    found: list[Listener] = []
    read = False
    for path in TABLES:
        try:
            with open(path, encoding="ascii") as table:
                text = table.read()
        except (OSError, ValueError):
            continue  # (no tcp6: a kernel without IPv6)
        read = True
        found += parse_listeners(text)
    return found if read else None


def listening_uids(address: IPAddress, port: int, listeners: list[Listener]) -> set[int]:
    """The owners of the sockets a connection to ``address``:``port`` may reach: those that
    listen on that address, or on the wildcard of its family, and for an IPv4 address on the
    IPv6 wildcard or the address mapped into IPv6 too (an IPv6 socket takes IPv4 connections
    unless IPV6_V6ONLY, which the tables do not tell: counted, to be safe)."""
    reach = {address, _V4_WILDCARD if address.version == 4 else _V6_WILDCARD}
    if address.version == 4:
        reach |= {_V6_WILDCARD, ipaddress.IPv6Address(f"::ffff:{address}")}
    return {s.uid for s in listeners if s.port == port and s.address in reach}
