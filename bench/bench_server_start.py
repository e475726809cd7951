"""Server start to first answer, with the extension and without, alternated in the same run;
and whether the server process has torch loaded (it must not: the extension must not tax every
Jupyter start).

    .venv/bin/python bench/bench_server_start.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def start_once(with_extension: bool, models: bool) -> tuple[float, bool]:
    tmp = tempfile.mkdtemp(prefix="evalsched-start-")
    token = secrets.token_hex(8)
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=os.path.join(tmp, "rt"),
        JUPYTER_CONFIG_DIR=os.path.join(tmp, "cfg"),
        EVALSCHED_RUNS_DIR=os.path.join(tmp, "runs"),
        EVALSCHED_VIRTUAL_GPUS="24000,24000",
    )
    os.makedirs(env["JUPYTER_CONFIG_DIR"])
    if models:
        with open(os.path.join(env["JUPYTER_CONFIG_DIR"], "jupyter_server_config.json"), "w") as f:
            json.dump(
                {"EvalSchedApp": {"models": [{"name": "m", "task": "feature-extraction", "model": "/nonexistent"}]}}, f
            )
    ext = "{'jupyter_evalsched': %s}" % ("True" if with_extension else "False")
    cmd = [
        sys.executable,
        "-m",
        "jupyter_server",
        "--no-browser",
        "--ip=127.0.0.1",
        "--port=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={tmp}",
        f"--ServerApp.jpserver_extensions={ext}",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = os.path.join(env["JUPYTER_RUNTIME_DIR"], f"jpserver-{proc.pid}.json")
    try:
        while True:
            if time.monotonic() - t0 > 60:
                raise RuntimeError("server did not start")
            try:
                with open(info) as f:
                    url = json.load(f)["url"]
                req = urllib.request.Request(
                    url.rstrip("/") + "/api/status", headers={"Authorization": f"token {token}"}
                )
                with urllib.request.urlopen(req, timeout=1):
                    break
            except (OSError, ValueError, KeyError):
                time.sleep(0.01)
        elapsed = time.monotonic() - t0
        with open(f"/proc/{proc.pid}/maps") as f:
            torch_loaded = "libtorch" in f.read()
        return elapsed, torch_loaded
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    without, with_ext, with_models, torch_seen = [], [], [], False
    for _ in range(args.rounds):
        t, _ = start_once(False, False)
        without.append(t)
        t, torch1 = start_once(True, False)
        with_ext.append(t)
        t, torch2 = start_once(True, True)
        with_models.append(t)
        torch_seen |= torch1 or torch2
    base = statistics.median(without)
    print(f"server start -> first answer (median of {args.rounds}, alternated)")
    print(f"   without the extension           {base * 1000:7.0f} ms")
    print(
        f"   with the extension              {statistics.median(with_ext) * 1000:7.0f} ms   ratio {statistics.median(with_ext) / base:.2f}x"
    )
    print(
        f"   with the extension and a model  {statistics.median(with_models) * 1000:7.0f} ms   ratio {statistics.median(with_models) / base:.2f}x"
    )
    print(f"   torch loaded in the server process: {'YES' if torch_seen else 'no'}")
    print(
        f"   target <= 1.15x, no torch -> {'met' if statistics.median(with_ext) / base <= 1.15 and not torch_seen else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
