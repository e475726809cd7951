"""A model host with many API requests in flight: each holds three descriptors there (its
connection and a socket pair that wakes it), so a few hundred reach descriptor numbers past
1,024, and the process's limit. Neither may end the host, which every caller of the model shares:
a request is watched whatever its descriptors' numbers, and a connection that cannot be accepted
for want of descriptors waits in the backlog until some are free."""

from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import threading

from jupyter_evalsched.shared_models.config import parse_model
from jupyter_evalsched.shared_models.host import ModelHost, _Call
from jupyter_evalsched.shared_models.protocol import recv_message

UPPER = "jupyter_evalsched.shared_models.testing:upper"


def test_a_request_whose_descriptors_are_numbered_past_1024_is_watched(tmp_path):
    """The host's wait for a request's answer (``_await``) with its connection and its wake-up
    socket both numbered past 1,024: ``select`` cannot watch those (it raised, and the request
    was computed for nobody); the answer is sent once the batch finishes it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard > 1200, f"this host's hard limit ({hard}) is too low for the test"
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096 if hard == resource.RLIM_INFINITY else min(hard, 4096), hard))
    filler: list[int] = []
    try:
        while len(filler) < 1100:  # (inside the try: whatever was opened is closed, the limit restored)
            filler.append(os.open(os.devnull, os.O_RDONLY))
        host = ModelHost(
            parse_model({"name": "m", "loader": UPPER}), str(tmp_path / "unused.sock"), lambda *a, **k: None
        )
        server_end, host_end = socket.socketpair()
        call = _Call([{"prompt": "x"}], {}, openai=True, client="c")
        assert call.wake_r is not None
        assert min(host_end.fileno(), call.wake_r.fileno()) >= 1024
        outcome: list[object] = []
        waiting = threading.Thread(target=lambda: outcome.append(host._await(call, host_end, stream=False)))
        waiting.start()
        with host.cond:
            call.outputs[0] = {"text": "X"}
            call.remaining = 0
            host._finish(call, None)
        waiting.join(30)
        assert outcome == [True] and not call.cancelled
        server_end.close()
        host_end.close()
        call.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# A host process (serve_forever, as ``main`` runs it) whose descriptors are all taken once it is
# ready, until the file named by its second argument appears.
HOST_OUT_OF_DESCRIPTORS = f"""
import os, resource, sys, threading, time
import jupyter_evalsched.shared_models.testing
from jupyter_evalsched.shared_models.config import parse_model
from jupyter_evalsched.shared_models.host import ModelHost

socket_path, release = sys.argv[1], sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ready = threading.Event()
host = ModelHost(parse_model({{"name": "m", "loader": "{UPPER}"}}), socket_path, lambda event, **_: event == "ready" and ready.set())

def take_every_descriptor():
    ready.wait()
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("full", flush=True)
    while not os.path.exists(release):
        time.sleep(0.01)
    for fd in held:
        os.close(fd)

threading.Thread(target=take_every_descriptor, daemon=True).start()
host.serve_forever()
"""


def test_a_host_out_of_descriptors_accepts_once_some_are_free_and_lives_on(tmp_path):
    socket_path, release = tmp_path / "m.sock", tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST_OUT_OF_DESCRIPTORS, str(socket_path), str(release)],
        stdout=subprocess.PIPE,
        text=True,
    )
    clients = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # (liveness only: a host that hangs fails here)
        assert ready and proc.stdout.readline().strip() == "full"
        # Two: an accept already waiting when the descriptors ran out had taken its own before
        # it waited (the kernel's order), so only a second accept is sure to find none.
        for client in clients:
            client.settimeout(30)
            client.connect(str(socket_path))  # (in the backlog until the host accepts it)
        release.touch()
        for client in clients:
            hello = recv_message(client, plain_only=True)
            assert hello["ok"] and hello["hello"]["model"] == "m", hello
        assert proc.poll() is None
    finally:
        for client in clients:
            client.close()
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
