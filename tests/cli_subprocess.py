"""The real CLI (``python -m jupyter_evalsched.cli``) as a subprocess against a test's server."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def run_cli(server, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``jupyter evalsched ARGS`` against ``server`` (a
    ServerApp), with none of the environment's own server settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID")}
    env.update(
        EVALSCHED_URL=server.connection_url,
        EVALSCHED_TOKEN=server.identity_provider.token,
        PYTHONPATH=str(REPO),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jupyter_evalsched.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()
