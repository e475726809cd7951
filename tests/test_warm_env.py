"""Issue #30 (11): a warm run's environment is the run's own, as a fresh interpreter's would be.
Its ``TZ`` takes effect; a preloaded module's unseeded ``random.Random()`` and the ``random``
module differ from run to run; and runs whose environments differ only in variables nothing
reads before the fork share one zygote (a preload that iterates the environment, as torch does,
does not make every ``env`` a zygote of its own). A real server, real zygotes, real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rest import spec, submit
from waiting import async_wait_until

import jupyter_evalsched
from jupyter_evalsched.scheduler.zygotes import incompatible

HERE = Path(__file__).resolve().parent
CLOCK = f"{HERE / 'evals_env.py'}:clock_and_env"

# A preload that iterates the whole environment (as torch does) and makes its own generators.
WARM_ITER = (
    "import os, random\n"
    "SEEN = dict(os.environ)\n"
    "OWN = random.Random()\n"
    "SEEDED = random.Random(42)\n"
    "def draw():\n"
    "    return [OWN.random(), random.random(), SEEDED.random()]\n"
)


@pytest.fixture
def evalsched_config(tmp_path):
    path = tmp_path / "preload"
    path.mkdir()
    (path / "warm_iter.py").write_text(WARM_ITER)
    # The package under test first: the zygote and its runs import this copy of it.
    package = Path(jupyter_evalsched.__file__).resolve().parent.parent
    return {"run_env": {"PYTHONPATH": f"{package}:{path}"}, "preload_modules": ["warm_iter"]}


async def ready_zygotes(api) -> list[dict]:
    answer = {}

    async def ready():
        code, body = await api("GET", "status")
        assert code == 200, body
        answer["zygotes"] = [z for z in body["warm_start"]["zygotes"] if z["state"] == "ready"]
        return answer["zygotes"]

    await async_wait_until(ready, timeout=30, message="no zygote became ready")
    return answer["zygotes"]


async def run_clock(api, wait_for, out: Path, **kw) -> tuple[dict, dict]:
    rec = await submit(api, spec(entry=CLOCK, params={"out": str(out)}, **kw))
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded", final
    return final, json.loads(out.read_text())


async def test_warm_runs_honour_tz_reseed_and_share_a_zygote_across_harmless_env(api, wait_for, tmp_path):
    zygote = (await ready_zygotes(api))[0]
    assert "warm_iter" in zygote["preloaded"], zygote
    env = {"TZ": "Asia/Kolkata"}
    warm, fp_warm = await run_clock(api, wait_for, tmp_path / "w.json", env=env)
    cold, fp_cold = await run_clock(api, wait_for, tmp_path / "c.json", env=env, fresh_interpreter=True)
    assert warm["start"] == "warm" and cold["start"] == "cold", (warm, cold)
    for key in ("tzname", "timezone", "gmtoff", "strftime"):
        assert fp_warm[key] == fp_cold[key], (key, fp_warm, fp_cold)
    assert fp_warm["gmtoff"] == 19800  # +05:30
    # Two runs that differ in a variable nothing reads before the fork: one zygote, own values.
    one, fp_one = await run_clock(api, wait_for, tmp_path / "1.json", env={"MY_FLAG": "1"})
    two, fp_two = await run_clock(api, wait_for, tmp_path / "2.json", env={"MY_FLAG": "2"})
    assert one["start"] == two["start"] == "warm", (one, two)
    assert one["start_detail"] == two["start_detail"] == f"forked by zygote {zygote['pid']}", (one, two)
    assert (fp_one["flag"], fp_two["flag"]) == ("1", "2")
    assert [z["pid"] for z in await ready_zygotes(api)] == [zygote["pid"]]
    # The preload's own unseeded generator and the module's differ between runs, as in two fresh
    # interpreters; its seeded one does not.
    draws = [fp["draws"] for fp in (fp_warm, fp_one, fp_two)]
    assert len({d[0] for d in draws}) == 3 and len({d[1] for d in draws}) == 3, draws
    assert len({d[2] for d in draws}) == 1, draws


def test_which_variables_select_a_zygote():
    zygote = {"PATH": "/bin", "HOME": "/h", "PYTHONPATH": "/p", "LANG": "C.UTF-8"}
    run = {**zygote, "MY_FLAG": "1", "TZ": "Asia/Kolkata", "CUDA_VISIBLE_DEVICES": "1"}
    # A preload that iterated the environment: the start-up and import-time variables alone.
    assert incompatible(zygote, ["*"], run) is None
    assert incompatible(zygote, ["*"], {**run, "TORCH_HOME": "/t"}) == "TORCH_HOME"
    assert incompatible(zygote, ["*"], {**run, "HF_HOME": "/hf"}) == "HF_HOME"
    # Read by name alone: that variable matters too.
    assert incompatible(zygote, ["HOME", "MY_FLAG"], run) == "MY_FLAG"
    assert incompatible(zygote, ["HOME"], run) is None
    # Locale variables act at the interpreter's start, whatever the preloads read.
    assert incompatible(zygote, [], {**run, "LANG": "de_DE.UTF-8"}) == "LANG"
    assert incompatible(zygote, [], {**run, "LC_ALL": "C"}) == "LC_ALL"
    # A zygote still starting (reads unknown): only its very environment.
    assert incompatible(zygote, None, run) == "MY_FLAG"
