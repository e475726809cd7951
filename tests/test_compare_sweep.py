"""Issue #30 (11): a sweep larger than 200 runs can be compared (a whole sweep, up to
``MAX_SWEEP_RUNS``), within the comparison's own time and size limits. The runs are finished run
directories written as a server leaves them, found by a real server at its start."""

from __future__ import annotations

import json

import pytest
from run_dirs import write_run_dir

from jupyter_evalsched.scheduler import compare, sweeps

SWEEP = "sweep-20260101T000000-abcdef"
POINTS = 300
EPISODES = 3


@pytest.fixture
def runs_dir(tmp_path):
    """300 succeeded runs of one sweep (``k`` = 0..299; metric ``score`` = k + episode index)."""
    path = tmp_path / "runs"
    for k in range(POINTS):
        run_id = f"20260101T000000.{k:06d}-aaaaaa"
        run_dir = path / run_id
        write_run_dir(
            run_dir,
            run_id,
            None,
            None,
            state="succeeded",
            seq=k + 1,
            started_at="2026-01-01T00:00:01.000000+00:00",
            finished_at="2026-01-01T00:00:03.000000+00:00",
            progress={"done": EPISODES, "total": EPISODES},
            sweep_id=SWEEP,
            sweep_point={"k": k},
            sweep_name="x",
        )
        spec = json.loads((run_dir / "spec.json").read_text())
        (run_dir / "spec.json").write_text(json.dumps({**spec, "params": {"k": k}}))
        lines = [{"index": i, "metrics": {"score": float(k + i)}, "attempt": 1} for i in range(EPISODES)]
        (run_dir / "episodes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (run_dir / "_DONE").touch()
    return path


def test_a_whole_sweep_can_be_compared():
    assert compare.MAX_COMPARE_RUNS >= sweeps.MAX_SWEEP_RUNS


async def test_a_sweep_of_300_runs_is_compared(api):
    code, view = await api("GET", f"sweeps/{SWEEP}")
    assert code == 200 and len(view["runs"]) == POINTS, view
    code, cmp = await api("GET", "compare", params={"sweep": SWEEP})
    assert code == 200, cmp
    rows = cmp["rows"]
    assert len(rows) == POINTS and cmp["params"] == ["k"] and cmp["metrics"] == ["score"], cmp["params"]
    assert [row["params"]["k"] for row in rows] == list(range(POINTS))
    last = rows[-1]
    assert last["metrics"]["score"]["mean"] == pytest.approx(POINTS - 1 + 1.0)
    assert last["delta"]["score"]["mean"] == pytest.approx(POINTS - 1) and last["delta"]["score"]["paired"] == EPISODES
    assert all(row["error"] is None for row in rows)
