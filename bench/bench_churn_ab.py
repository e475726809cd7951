"""Part 3 of ``bench_as_users_run.py`` (submissions, quiet and under churn) on this tree's default
server and another tree's, both up, alternated round by round: what a change moved in the
submission rate under churn, with the host's drift taken out.

    .venv/bin/python bench/bench_churn_ab.py --old DIR [--rounds 4] [--submissions 2000]
        [--host-processes N]

Two ``jupyter server`` subprocesses with the extension's defaults on this host (no virtual GPUs,
cgroups as detected, warm starts on), one per code tree: this one and ``--old`` (another
checkout, imported through ``PYTHONPATH``; its dependencies must be those of this environment).
Each round, each server (the order flips every round) has a quiet phase and a churn phase (their
order flips too): ``--submissions`` POSTs of no-op runs from 8 keep-alive clients, held behind a
dependency on a sleeping run that takes no CPU slot, so that they never run; under churn, 50
no-op runs a second are submitted, start and end meanwhile. Each phase has a blocker of its own,
cancelled at its end (which fails the held runs), so the next phase starts on an idle server.
Printed: each phase's submissions/s, its latency's 99th percentile and the server process's CPU per submission (every thread's,
``/proc/<pid>/task/*/schedstat``, over the phase's requests; under churn it includes the server's
work for the churn's runs, so a shorter phase has fewer of them in it), and per tree the medians
of quiet, churn and of the rounds' churn/quiet ratios, and the medians of the rounds' paired
differences of the quiet figures. Both figures swing by a fifth or more from phase to phase (the
disk's state on ext4 without a journal: the inodes the last phase freed); in the run that
docs/performance.md quotes, the CPU's paired difference kept its sign in every round, the rate's
in five of six.

``--host-processes N``: N more idle processes (``sleep``) live on the host meanwhile, as on a
shared GPU host (see ``bench_burst_ab.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_burst_ab import ab_parser, process_cpu_s, run_ab  # noqa: E402
from bench_rest import hammer, pct  # noqa: E402
from bench_warm_start import NOOP, SLEEPY, Churn  # noqa: E402

CLIENTS = 8


class Side:
    """One tree's server and its phases' figures."""

    def __init__(self, label: str, tree: Path) -> None:
        self.label = label
        self.tree = tree
        self.server = LocalServer(virtual_gpus=None, env={"PYTHONPATH": str(tree)})
        self.client = self.server.client()
        self.quiet: list[float] = []
        self.churn: list[float] = []
        self.quiet_cpu: list[float] = []  # the server's CPU per submission, ms
        self.churn_cpu: list[float] = []
        self.quiet_p99: list[float] = []  # each phase's 99th percentile of submission latency, ms
        self.churn_p99: list[float] = []

    def phase(self, submissions: int, churn: bool) -> tuple[float, float, float]:
        blocker = self.client.submit(
            {"entrypoint": SLEEPY, "episodes": 1, "params": {"sleep_s": 600}, "scheduling": {"cpus": 0}}
        )
        deadline = time.monotonic() + 60
        while self.client.get(blocker["id"])["state"] != "running":
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.label}: the blocker never started")
            time.sleep(0.02)
        body = json.dumps({"entrypoint": NOOP, "episodes": 1, "depends_on": [blocker["id"]]}).encode()
        runs = Churn(self.server.url, self.server.token) if churn else None
        try:
            if runs is not None:
                time.sleep(0.5)  # the churn under way
            pid = self.server.process.pid
            cpu0 = process_cpu_s(pid)
            rate, latencies, _ids, errors = hammer(
                self.server.url, self.server.token, CLIENTS, submissions // CLIENTS, "POST", "/evalsched/runs", body
            )
            cpu_ms = (process_cpu_s(pid) - cpu0) * 1000 / max(1, len(latencies))
        finally:
            if runs is not None:
                runs.stop()
            self.client.cancel(blocker["id"])
        if errors:
            raise SystemExit(f"{self.label}: {len(errors)} submissions failed, the first: {errors[0]}")
        (self.churn if churn else self.quiet).append(rate)
        (self.churn_cpu if churn else self.quiet_cpu).append(cpu_ms)
        if not latencies:
            raise SystemExit(f"{self.label}: no submission was timed (--submissions below {CLIENTS}?)")
        p99 = pct(latencies, 0.99) * 1000
        (self.churn_p99 if churn else self.quiet_p99).append(p99)
        time.sleep(1.0)  # the held runs failed and written, the churn's last runs ended
        return rate, cpu_ms, p99

    def close(self) -> None:
        self.server.cleanup()


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=4, help="rounds (a quiet and a churn phase per server each)")
    ap.add_argument("--submissions", type=int, default=2000, help="submissions per phase")
    run_ab(ap.parse_args(), measure)


def measure(args: argparse.Namespace) -> None:
    sides: list[Side] = []
    try:
        sides = [Side("new", REPO), Side("old", args.old.resolve())]
        print(
            f"new: {sides[0].tree}\nold: {sides[1].tree}\n{args.rounds} rounds of {args.submissions} submissions"
            f" per phase from {CLIENTS} clients; {args.host_processes} idle processes added to the host"
        )
        for side in sides:  # warm: spares forked, caches filled
            side.phase(min(args.submissions, 400), churn=False)
            side.quiet.clear()
            side.quiet_cpu.clear()
            side.quiet_p99.clear()
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                for churn in (False, True) if i % 2 == 0 else (True, False):
                    rate, cpu_ms, p99 = side.phase(args.submissions, churn)
                    print(
                        f"round {i + 1}: {side.label} {'churn' if churn else 'quiet'} {rate:.0f}/s,"
                        f" server CPU {cpu_ms:.2f} ms a submission, p99 {p99:.1f} ms",
                        flush=True,
                    )
        for side in sides:
            ratios = [c / q for q, c in zip(side.quiet, side.churn, strict=True)]
            print(
                f"{side.label}: quiet {statistics.median(side.quiet):.0f}/s, churn {statistics.median(side.churn):.0f}/s,"
                f" churn/quiet {statistics.median(ratios):.2f}; server CPU a submission {statistics.median(side.quiet_cpu):.2f}"
                f" ms quiet, {statistics.median(side.churn_cpu):.2f} ms under churn; p99"
                f" {statistics.median(side.quiet_p99):.1f} ms quiet, {statistics.median(side.churn_p99):.1f} ms under churn"
                f" (medians of {args.rounds} rounds)"
            )
        new, old = sides
        faster = statistics.median(n - o for n, o in zip(new.quiet, old.quiet, strict=True))
        cheaper = statistics.median(o - n for n, o in zip(new.quiet_cpu, old.quiet_cpu, strict=True))
        sooner = statistics.median(o - n for n, o in zip(new.quiet_p99, old.quiet_p99, strict=True))
        sooner_churn = statistics.median(o - n for n, o in zip(new.churn_p99, old.churn_p99, strict=True))
        print(
            f"quiet, new against old (medians of the rounds' paired differences): {faster:+.0f} submissions/s,"
            f" {cheaper:+.2f} ms less server CPU a submission, p99 {sooner:+.1f} ms sooner"
            f" ({sooner_churn:+.1f} ms sooner under churn)"
        )
    finally:
        for side in sides:
            side.close()


if __name__ == "__main__":
    main()
