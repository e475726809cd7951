"""bench/bench_as_users_run.py is a script, not a test: this checks only that it starts (its
``--help``) and that its pure helpers (quantiles, the verdict table, the README table) say what
the figures say. The bench itself is run by hand (``--quick`` to check that it works)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_as_users_run

        yield bench_as_users_run
    finally:
        sys.path.remove(str(BENCH))


def test_help_runs():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_as_users_run.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--rounds", "--idle-rounds", "--quick", "--markdown", "--parts"):
        assert option in proc.stdout


def test_quantiles(bench):
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert bench.pct(xs, 0.5) == 51.0
    assert bench.pct(xs, 0.9) == 91.0
    assert bench.pct(xs, 0.99) == 100.0
    assert bench.pct([3.0, 1.0, 2.0], 0.0) == 1.0
    assert bench.med([3.0, 1.0, 2.0, 10.0]) == 2.5


def test_tables_say_pass_miss_and_reference(bench):
    rows = [
        bench.Target("1. a ratio", "0.40x", "tsp 10 ms", "<= 0.6x", True),
        bench.Target("2. a makespan", "0.90x", "tsp 1 s", "<= 0.8x", False),
        bench.Target("3. a reference", "7 ms", "as above", "(reference)", None),
    ]
    lines = bench.target_table(rows).splitlines()
    assert lines[0].startswith("target") and lines[0].endswith("verdict")
    assert [line.split()[-1] for line in lines[1:]] == ["PASS", "MISS", "-"]
    md = bench.markdown_table(rows, "Linux, 2 CPUs; default server: cgroups hybrid").splitlines()
    assert "cgroups hybrid" in md[0]
    assert md[4] == "| 1. a ratio | 0.40x | tsp 10 ms | <= 0.6x | PASS |"
    assert md[5].endswith("| MISS |") and md[6].endswith("| - |")


def test_ratios_never_read_as_the_bound_they_miss(bench):
    assert bench.ratio_text(0.643, 0.6) == "0.64x"
    assert bench.ratio_text(0.598, 0.6) == "0.598x"  # two decimals would print a failing 0.60x
    assert bench.ratio_text(0.6004, 0.6) == "0.6004x"
    assert bench.ratio_text(0.5, 0.5) == "0.50x"  # exactly at the bound: it meets it
    assert bench.ratio_text(0.4999, 0.5) == "0.4999x"
    assert bench.ratio_text(0.59996, 0.6) == "0.59996x"
    assert bench.ratio_text(0.6 - 1e-12, 0.6) == f"{0.6 - 1e-12!r}x"  # never the bound itself


def test_cpu_split_says_who_took_the_cpu(bench):
    # 2 s of wall: the machine busy 3 CPU s, the server 1, the bench 0.5, the rest 1.5.
    split = bench.cpu_split((10.0, 100.0, 20.0, 5.0), (12.0, 103.0, 21.0, 5.5))
    assert split == {"busy": 1.5, "server": 0.5, "bench": 0.25, "rest": 0.75}
    assert "server 0.50" in bench.cpu_text(split) and "everything else 0.75" in bench.cpu_text(split)
    wall, busy, server, me = bench.cpu_sample(os.getpid())
    assert busy > 0 and me > 0 and server > 0  # this process is its own 'server' here


def test_round_counts_below_their_minimum_are_refused():
    """A count the bench cannot measure with (no rounds: a median of nothing) is an error before
    anything starts, not a crash after minutes of measuring."""
    for args in (["--rounds", "0"], ["--idle-rounds", "-1"], ["--burst-rounds", "0"]):
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_as_users_run.py"), *args], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "must be at least" in proc.stderr
