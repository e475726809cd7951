"""A tenant of the host ledger driven by a test: started as a system user, it reads commands as
JSON lines on stdin and answers each (its ``tag`` repeated) on stdout when it is done, so that a
request that waits is answered when granted while other commands go on.

Commands (``do``): connect (hello, re-telling the grants held), request, retie, release, cancel,
view, demand (the queued work a server tells), events (the names of the events received), raw (send one message as it is, the answer as it is), spawn (a ``sleep`` in its own session:
what a run is to the ledger; it outlives this process), kill (one of the spawned).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

from jupyter_evalsched.host_ledger.client import HostLedgerClient, HostLedgerError


async def main(socket_path: str) -> None:
    events: list[str] = []  # the names of the events the ledger sent unasked, in order
    client = HostLedgerClient(socket_path, tenant="test agent", on_event=lambda e: events.append(e["event"]))
    out = sys.stdout
    spawned: dict[int, subprocess.Popen] = {}

    def answer(tag: object, **fields: object) -> None:
        out.write(json.dumps({"tag": tag, **fields}) + "\n")
        out.flush()

    async def run(command: dict) -> None:
        tag, do = command.pop("tag"), command.pop("do")
        try:
            if do == "connect":
                result: object = await client.connect()
            elif do == "request":
                reasons: list[str] = []
                result = await client.request(**command, on_waiting=reasons.append)
            elif do == "retie":
                result = await client.retie(command["grant"], command["pids"])
            elif do == "release":
                result = await client.release(command["grant"])
            elif do == "cancel":
                result = await client.cancel(command["key"])
            elif do == "view":
                result = await client.view()
            elif do == "grants":
                result = sorted(client.grants)
            elif do == "events":
                result = list(events)
            elif do == "demand":
                result = await client.demand(command["asks"])
            elif do == "raw":
                _, fut = await client._send(**command["message"])
                result = await fut
            elif do == "spawn":
                proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
                spawned[proc.pid] = proc
                result = proc.pid
            elif do == "kill":
                os.kill(command["pid"], signal.SIGKILL)
                spawned.pop(command["pid"]).wait()
                result = True
            else:
                raise ValueError(f"unknown command {do!r}")
        except HostLedgerError as exc:
            answer(tag, error=exc.code, reason=exc.reason)
        except Exception as exc:
            answer(tag, error=type(exc).__name__, reason=str(exc))
        else:
            answer(tag, result=result)

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        task = asyncio.create_task(run(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
