"""Requests sent on a raw connection, for tests that abort it midway (a client gone)."""

from __future__ import annotations

import asyncio


def post_request(base_url: str, route: str, token: str, body: str) -> bytes:
    """``POST <base_url><route>`` with the server's token and a JSON ``body`` (ASCII), as bytes."""
    return (
        f"POST {base_url}{route} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


async def send(port: int, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``request`` sent on a new loopback connection to ``port``: (reader, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    return reader, writer
