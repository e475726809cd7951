"""A run's log rewritten in place (its process reopens it with "w": the same inode, truncated)
and grown past a reader's offset between two of its reads: the sizes alone look like growth; the
reader sees that the bytes before its offset changed, says so (``on_rewritten``) and reads the log
again from its start. Against a real server subprocess and a real run; the steps are gated by
files, not timed."""

from __future__ import annotations

import os
from pathlib import Path

try:
    from .live_server import clean_queue, client, live_server, wait_state, wait_until
except ImportError:
    from live_server import clean_queue, client, live_server, wait_state, wait_until  # noqa: F401

# Writes the old text, waits for gate-0, reopens its stdout log with "w" (as a process that opens
# its log by name would) and writes the new, longer text, says so (rewrote), waits for gate-1.
REWRITES_ITS_LOG = """
import os, sys, time

def _wait(path):
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never came")
        time.sleep(0.01)

def episode(ctx, index):
    gates = ctx.params["gates"]
    os.write(1, ctx.params["old"].encode())
    _wait(os.path.join(gates, "gate-0"))
    with open("/proc/self/fd/1", "w") as log:
        log.write(ctx.params["new"])
    open(os.path.join(gates, "rewrote"), "w").close()
    _wait(os.path.join(gates, "gate-1"))
    return {}
"""


def test_a_log_rewritten_and_grown_past_the_offset_is_read_again(client, clean_queue, tmp_path):
    gates = tmp_path / "gates"
    gates.mkdir()
    old = "old line %d\n" * 8 % tuple(range(8))
    new = "".join(f"NEW, longer line {i}: rewritten in place\n" for i in range(20))
    assert len(new) > len(old) + 256
    rec = client.submit(
        {"source": REWRITES_ITS_LOG, "episodes": 1, "cwd": "/", "params": {"gates": str(gates), "old": old, "new": new}}
    )
    rewritten: list[bool] = []
    reader = client.log_reader(rec["id"])
    reader.on_rewritten = lambda: rewritten.append(True)
    seen = [""]

    def read_all_of(text: str) -> bool:
        seen[0] += reader.read()
        return seen[0] == text

    wait_until(lambda: read_all_of(old), timeout=60, message="the old text read")
    assert reader.offset == len(old)
    (gates / "gate-0").touch()
    wait_until((gates / "rewrote").exists, timeout=60, message="the log rewritten")
    log = Path(client.get(rec["id"])["run_dir"]) / "stdout.log"
    assert log.read_text() == new and os.stat(log).st_size > reader.offset
    assert reader.read() == new and rewritten == [True]
    (gates / "gate-1").touch()
    assert wait_state(client, rec["id"])["state"] == "succeeded"
    assert reader.read(final=True) == "" and rewritten == [True]
