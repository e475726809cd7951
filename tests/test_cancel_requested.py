"""A cancel's answer says whether the run still ends: ``cancel_requested`` is true for a running
run that was signalled and has not stopped yet, false for one the cancel ended at once; the CLI's
``cancel`` line and ``--json`` read it (and derive it from the state where a server does not send
it). A real in-process server, a run that outlives SIGTERM until the test lets it go (no timing),
and the real CLI as a subprocess."""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

import pytest
from cli_subprocess import run_cli
from rest import submit
from waiting import async_wait_until

from jupyter_evalsched.cli import sweep_cancel_note, sweep_cancel_view, with_cancel_requested
from jupyter_evalsched.client.progress import TextProgress
from jupyter_evalsched.widget import run_row_html

REPO = Path(__file__).resolve().parents[1]

# Outlives a cancel's SIGTERM until the test writes its release file, then dies of it.
STUBBORN = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:stubborn"


@pytest.fixture
def evalsched_config():
    return {"cancel_grace_s": 3600.0}


async def test_the_cancel_answer_and_the_cli_tell_stopping_from_ended(api, wait_for, jp_serverapp, tmp_path):
    ready, release = tmp_path / "ready", tmp_path / "release"
    body = {"entrypoint": STUBBORN, "episodes": 1, "params": {"ready": str(ready), "release": str(release)}}
    running = await submit(api, body)
    behind = await submit(api, {**body, "depends_on": [running["id"]]})  # queued until it ends
    await async_wait_until(ready.exists, timeout=60)
    await wait_for(running["id"], states=("running",))

    # Queued: the cancel ends it, and says so.
    code, out, err = await run_cli(jp_serverapp, "cancel", behind["id"], "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert (answer["state"], answer["cancel_requested"]) == ("cancelled", False), answer

    # Running: signalled, still running (it ignores SIGTERM, and the grace is an hour).
    code, out, err = await run_cli(jp_serverapp, "cancel", running["id"], "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert (answer["state"], answer["cancel_requested"]) == ("running", True), answer
    # Its record says it is ending, who asked and what comes next, to every reader (the list, the
    # panel and widgets through their events); the first cancel's asker stays.
    ending = answer["reason"]
    assert re.fullmatch(
        r"cancelling: cancelled with jupyter evalsched cancel; SIGTERM sent to its process group;"
        r" SIGKILL if it still runs in 3\d{3}(\.\d)? s, at \d\d:\d\d:\d\d UTC",
        ending,
    ), answer
    assert answer["why"]["code"] == "cancelling", answer
    code, listed = await api("GET", "runs")
    assert [r["reason"] for r in listed["runs"] if r["id"] == running["id"]] == [ending], listed
    # The readers that show a running run's line say it is ending.
    assert "running (cancelling)" in TextProgress(stream=io.StringIO()).line(answer)
    assert html.escape(ending) in run_row_html(answer)
    code, rest_answer = await api("POST", f"runs/{running['id']}/cancel")  # the REST answer itself
    assert code == 200 and (rest_answer["state"], rest_answer["cancel_requested"]) == ("running", True)
    assert rest_answer["reason"] == ending, rest_answer
    code, out, err = await run_cli(jp_serverapp, "cancel", running["id"])
    assert code == 0 and f"{running['id']}" in out and "cancelling: signalled to stop" in out, (out, err)

    release.touch()
    ended = await wait_for(running["id"])
    assert ended["state"] == "cancelled" and ended["reason"].startswith("cancelled: cancelled with jupyter"), ended
    # Resumed, then cancelled by someone else: the reasons name who asked this time.
    ready.unlink()
    release.unlink()
    code, resumed = await api("POST", f"runs/{running['id']}/resume")
    assert code == 200 and resumed["state"] == "queued", resumed
    await async_wait_until(ready.exists, timeout=60)
    await wait_for(running["id"], states=("running",))
    code, again = await api("POST", f"runs/{running['id']}/cancel", params={"by": "panel"})
    assert code == 200 and again["reason"].startswith("cancelling: cancelled from the Lab panel;"), again
    release.touch()
    again = await wait_for(running["id"])
    assert again["state"] == "cancelled" and again["reason"].startswith("cancelled: cancelled from the Lab panel")
    code, answer = await api("POST", f"runs/{running['id']}/cancel")  # nothing to cancel any more
    assert code == 409, answer


@pytest.mark.parametrize(("state", "stopping"), [("running", True), ("queued", True), ("cancelled", False)])
def test_an_answer_without_the_field_is_read_by_its_state(state, stopping):
    # A server older than the field: the CLI derives it.
    assert with_cancel_requested({"id": "r", "state": state})["cancel_requested"] is stopping
    assert with_cancel_requested({"id": "r", "state": state, "cancel_requested": False})["cancel_requested"] is False


def test_a_sweep_cancel_answer_of_an_older_server_is_read_by_the_runs_states():
    """A server older than ``still_ending`` and the runs' ``cancel_requested`` answered the bare
    sweep view: the CLI counts the runs still ending from their states; a newer one's count
    stands as it says it."""
    old = {"id": "sweep-x", "runs": [{"id": "a", "state": "running"}, {"id": "b", "state": "cancelled"}]}
    view = sweep_cancel_view(old)
    assert view["still_ending"] == 1 and [r["cancel_requested"] for r in view["runs"]] == [True, False]
    assert "1 run is still ending" in sweep_cancel_note("sweep-x", view["still_ending"])
    new = {**old, "runs": [{**r, "cancel_requested": False} for r in old["runs"]], "still_ending": 0}
    assert sweep_cancel_view(new)["still_ending"] == 0
    assert "no run still ending" in sweep_cancel_note("sweep-x", 0)
