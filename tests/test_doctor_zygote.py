"""Issue #30 ("also"): ``jupyter evalsched doctor`` without a server also tries a zygote, as the
server would start it (the runner and ``EVALSCHED_PRELOAD``), and says whether runs could be
forked warm on this host. A real CLI process, a real zygote."""

from __future__ import annotations

import json

import pytest
from live_server import cli

PRELOADS = {
    "doc_thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n",
    "doc_crash": "import os\nos._exit(3)\n",
}


def doctor(tmp_path, preload: str) -> dict:
    (tmp_path / "preload").mkdir(exist_ok=True)
    for name, text in PRELOADS.items():
        (tmp_path / "preload" / f"{name}.py").write_text(text)
    env = {
        "JUPYTER_RUNTIME_DIR": str(tmp_path),
        "EVALSCHED_PRELOAD": preload,
        "PYTHONPATH": str(tmp_path / "preload"),
    }
    proc = cli(None, "doctor", "--json", with_server=False, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # no server: an error
    return {item["name"]: item for item in json.loads(proc.stdout)}


def test_doctor_without_a_server_starts_a_zygote(tmp_path):
    checks = doctor(tmp_path, "json")
    assert checks["server"]["status"] == "error"
    warm = checks["warm_start"]
    assert warm["status"] == "ok" and "1 zygote(s) ready" in warm["detail"] and "preloaded json" in warm["detail"], warm


@pytest.mark.parametrize(
    ("preload", "says"),
    [("doc_thread", "made it unsafe to fork"), ("doc_crash", "died before it was ready")],
)
def test_doctor_without_a_server_says_why_a_zygote_fails(tmp_path, preload, says):
    warm = doctor(tmp_path, preload)["warm_start"]
    assert warm["status"] == "degraded" and says in warm["detail"] and warm["fix"], warm
