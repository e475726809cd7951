"""Sweeps and comparison from Python, the CLI and the magics (#18), against a real server
subprocess (see live_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import jupyter_evalsched
from jupyter_evalsched.client import SpecError, SweepHandle, sweep_from_options
from jupyter_evalsched.client.formatting import compare_table, ending_line

try:
    from .live_server import SLEEPY, clean_queue, cli, client, ip, live_server, wait_state
except ImportError:
    from live_server import SLEEPY, clean_queue, cli, client, ip, live_server, wait_state  # noqa: F401

HERE = Path(__file__).resolve().parent
SCORED = f"{HERE / 'evals_sweep.py'}:scored"


class Options:
    def __init__(self, sweep=None, sweep_points=None):
        self.sweep, self.sweep_points = sweep, sweep_points


def test_sweep_flags_parse_grids_and_points():
    grid = sweep_from_options(Options(sweep=["temperature=0.2,0.7,1", 'tag=a,"b,c",[1,2]']))
    assert grid == {"temperature": [0.2, 0.7, 1], "tag": ["a", "b,c", [1, 2]]}
    assert sweep_from_options(Options(sweep_points='[{"k": 1}, {"k": 5}]')) == [{"k": 1}, {"k": 5}]
    assert sweep_from_options(Options()) is None
    for bad in (
        Options(sweep=["k"]),
        Options(sweep=["k=1", "k=2"]),
        Options(sweep_points="{"),
        Options(sweep_points="{}"),
    ):
        with pytest.raises(SpecError):
            sweep_from_options(bad)
    with pytest.raises(SpecError):
        sweep_from_options(Options(sweep=["k=1"], sweep_points="[]"))


def test_python_sweep_wait_compare_and_plot(client, clean_queue, capsys):
    spec = {"entrypoint": SCORED, "episodes": 4, "params": {"base": 0.0}, "name": "py"}
    sweep = jupyter_evalsched.sweep(spec, {"base": [0.0, 1.0], "slope": [0.0, 0.5]}, client=client)
    assert isinstance(sweep, SweepHandle) and len(sweep.runs) == 4
    view = sweep.wait(timeout=60)
    assert view["counts"] == {"succeeded": 4}
    err = capsys.readouterr().err
    assert "sweep py (4 runs)" in err and "16/16" in err  # one progress bar for the sweep
    table = sweep.compare()
    assert table.params == ["base", "slope"] and list(table.index) == [r.id for r in sweep.runs]
    assert table["score_paired"].tolist() == [4, 4, 4, 4]
    # slope 0.5 adds 0.5 * i**2 to episode i: 1.75 on average over i = 0..3
    assert table["score_delta"].tolist() == pytest.approx([0.0, 1.75, 1.0, 2.75])
    assert table.loc[sweep.runs[2].id, "score"] - table.loc[sweep.runs[0].id, "score"] == pytest.approx(1.0)
    same = jupyter_evalsched.compare([r.id for r in sweep.runs[:2]], baseline=sweep.runs[1].id, client=client)
    assert same.baseline == sweep.runs[1].id and same.params == ["slope"]
    import matplotlib

    matplotlib.use("Agg")
    ax = table.plot("score", x="base")
    # One line per value of slope (an errorbar container each), each through that slope's runs in
    # the order of base: a single line for everything, or points in the wrong line, fails.
    assert len(ax.containers) == 2, ax.containers
    for container, slope, runs in zip(ax.containers, [0.0, 0.5], [(0, 2), (1, 3)], strict=True):
        line = container.lines[0]
        ids = [sweep.runs[i].id for i in runs]  # the points (base, slope): base 0.0, then 1.0
        assert container.get_label() == f"slope={slope}"
        assert list(line.get_xdata()) == [0.0, 1.0]
        assert list(line.get_ydata()) == pytest.approx([table.loc[i, "score"] for i in ids])
    assert ax.get_xlabel() == "base"
    with pytest.raises(KeyError):
        table.plot("nope")
    assert "sweep" in sweep._repr_html_() and repr(sweep).startswith("<SweepHandle")


def test_the_compare_table_and_the_ending_line():
    answer = {
        "params": ["t"],
        "metrics": ["acc"],
        "baseline": "r1",
        "rows": [
            {
                "id": "r1",
                "params": {"t": 0.2},
                "metrics": {"acc": {"mean": 0.5, "stderr": 0.1, "count": 4}},
                "delta": {"acc": {"mean": 0.0, "ci95": [0.0, 0.0], "paired": 4}},
                "wall_s": 3.0,
                "peak_vram_mb": None,
            },
            {
                "id": "r2",
                "params": {"t": 0.7},
                "metrics": {"acc": {"mean": 0.75, "stderr": 0.05, "count": 4}},
                "delta": {"acc": {"mean": 0.25, "ci95": [0.1, 0.4], "paired": 4}},
                "wall_s": 2.0,
                "peak_vram_mb": 1200,
            },
        ],
    }
    text = compare_table(answer)
    assert "r1 *" in text and "baseline" in text and "+0.25 [0.1, 0.4] (4)" in text and "0.75 ± 0.05" in text
    assert "1200 MB" in text
    record = {
        "name": "demo",
        "state": "failed",
        "reason": "exception: boom",
        "started_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:00:02+00:00",
        "summary": {"metrics": {"acc": {"mean": 0.5, "std": 0.5, "count": 5}, "other": {"mean": 1}}},
    }
    assert ending_line(record) == "demo: failed (exception: boom) in 2.0s · acc = 0.5 ± 0.25"


def test_cli_sweep_submit_wait_compare_and_cancel(live_server, clean_queue, tmp_path):
    proc = cli(
        live_server,
        "submit",
        SCORED,
        "--sweep",
        "base=0,2",
        "--episodes",
        "3",
        "--name",
        "cli",
        "--wait",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert view["counts"] == {"succeeded": 2} and view["id"].startswith("sweep-")
    table = cli(live_server, "compare", "--sweep", view["id"])
    assert table.returncode == 0, table.stderr
    assert "base" in table.stdout and "+2 " in table.stdout and "baseline" in table.stdout
    as_json = json.loads(cli(live_server, "compare", *[r["id"] for r in view["runs"]], "--json").stdout)
    assert as_json["params"] == ["base"] and len(as_json["rows"]) == 2
    listing = cli(live_server, "sweeps")
    assert view["id"] in listing.stdout and "2 succeeded" in listing.stdout

    slow = cli(live_server, "submit", SLEEPY, "--sweep-points", '[{"sleep_s": 0.01}, {"sleep_s": 60}]', "--json")
    made = json.loads(slow.stdout)
    client = live_server.client()
    wait_state(client, made["runs"][0]["id"])
    wait_state(client, made["runs"][1]["id"], states=("running",))
    cancel = cli(live_server, "cancel", made["id"])
    assert cancel.returncode == 0, cancel.stderr
    assert wait_state(client, made["runs"][1]["id"])["state"] == "cancelled"
    assert client.get(made["runs"][0]["id"])["state"] == "succeeded"
    wait = cli(live_server, "wait", made["id"], "-q")
    assert wait.returncode == 1  # a cancelled run: the sweep did not all succeed
    bad = cli(live_server, "compare")
    assert bad.returncode == 2 and "run ids, or --sweep" in bad.stderr


def test_eval_sweep_magic_line_and_cell_forms(ip, client, clean_queue):
    h = ip.run_line_magic("eval_sweep", f"{SCORED} --sweep base=1,2,3 --episodes 2 --out s")
    assert isinstance(h, SweepHandle) and ip.user_ns["s"] is h and len(h.runs) == 3
    h.wait(timeout=60, progress=False)
    after = ip.run_line_magic("eval_submit", f"{SLEEPY} --episodes 1 --param sleep_s=0.01 --depends-on s")
    spec = json.loads((Path(after.run_dir) / "spec.json").read_text())
    assert spec["depends_on"] == [r.id for r in h.runs]  # a sweep handle names its runs
    cell = ip.run_cell_magic(
        "eval_sweep",
        '--sweep-points \'[{"k": 1}, {"k": 5}]\' --episodes 2',
        "def episode(ctx, index):\n    return {'k': ctx.params['k']}\n",
    )
    assert isinstance(cell, SweepHandle)
    cell.wait(timeout=60, progress=False)
    table = cell.compare()
    assert table["k"].tolist() == [1, 5] and table.params == ["k"]
    assert table["metric:k"].tolist() == [1.0, 5.0] and table.metrics == ["metric:k"]  # named like the param
    with pytest.raises(UsageError, match="^eval_sweep: %eval_sweep needs --sweep"):  # no --sweep: one line
        ip.run_line_magic("eval_sweep", f"{SCORED} --episodes 2")
