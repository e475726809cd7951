"""Admission latency and no-op turnaround of the scheduler, each against a baseline measured in
the same run (these machines are noisy: never compare with a number from another run).

    .venv/bin/python bench/bench_scheduler.py [--rounds 30]

1. Admission latency: two runs that cannot share the GPU (16000 MB each on a 24000 MB virtual
   GPU). Measured from the first run's exit (its ``_DONE``, written just before it exits, and the
   moment the scheduler records the first run's end) to the second run's start (the process
   exists: spawned, or forked by the zygote). Baseline: the same scheduler with exit notification
   disabled, so that only its 1 s backstop reconciliation notices exits — the once-a-second tick that
   event-driven admission replaces.
2. No-op turnaround: ``submit`` of a run whose episode does nothing → its terminal state, against
   ``Popen`` + ``wait`` of ``python -c pass`` with the same interpreter.
3. The cost of a run's cgroup: the no-op turnaround with a cgroup per run (where the host has
   cgroups) against the same without, the two schedulers alternating run by run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jupyter_evalsched.scheduler.cgroups import Cgroups
from jupyter_evalsched.scheduler.config import SchedulerConfig
from jupyter_evalsched.scheduler.executors.local import LocalExecutor
from jupyter_evalsched.scheduler.gpus import VirtualProbe
from jupyter_evalsched.scheduler.service import Scheduler
from jupyter_evalsched.schemas import EvalSpec

NOOP = "jupyter_evalsched.examples.basic:noop"


class TimedScheduler(Scheduler):
    """Records when each run's end is recorded and each run starts (monotonic clock): the start is
    when the process exists (spawned, or forked by the zygote)."""

    def __init__(
        self, config: SchedulerConfig, probe: VirtualProbe, event_driven: bool = True, cgroups: Cgroups | None = None
    ):
        # not event-driven: the 1 s reconciliation alone
        self.local = LocalExecutor(notify_exits=event_driven, cgroups=cgroups)
        super().__init__(config, probe, executors=[self.local])
        self.noticed: dict[str, float] = {}
        # The run's exit noticed: its resources released, before its verdict is read and its end
        # recorded (RunTable.exited).
        self.exited: dict[str, float] = {}
        self.spawned: dict[str, float] = {}
        self.finished: dict[str, asyncio.Future] = {}
        started = self.local._started  # called once the run's process exists, warm or cold

        def timed_started(run, *args, **kwargs):
            self.spawned[run.id] = time.monotonic()
            return started(run, *args, **kwargs)

        self.local._started = timed_started
        exited = self.table.exited

        def timed_exited(run):
            self.exited[run.id] = time.monotonic()
            return exited(run)

        self.table.exited = timed_exited
        self.table.subscribe(self._changed)  # told of an end before the admission it triggers

    def _changed(self, event: dict) -> None:
        run = event["run"]
        if run["state"] not in ("succeeded", "failed", "cancelled", "aborted"):
            return
        now = time.monotonic()
        self.noticed[run["id"]] = now
        fut = self.finished.get(run["id"])
        if fut is not None and not fut.done():
            fut.set_result(now)

    async def submit_record(self, spec: EvalSpec) -> dict:
        record, _ = await self.submit(spec)
        return record


async def zygote_ready(sched: TimedScheduler, timeout: float = 30.0) -> None:
    """Measure warm starts only once the zygote is ready (else the first runs queue behind it)."""
    pool = sched.local.zygotes
    deadline = time.monotonic() + timeout
    while pool is not None and not any(z.state == "ready" for z in pool.zygotes) and pool.refused is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no zygote became ready")
        await asyncio.sleep(0.01)


def mono_of_wall(wall: float) -> float:
    return time.monotonic() - (time.time() - wall)


async def admission_latency(rounds: int, event_driven: bool, root: Path) -> tuple[list[float], list[float]]:
    runs = root / ("event" if event_driven else "tick")
    sched = TimedScheduler(
        # The baseline is the reconciliation alone: no pidfd, and no zygote either (it reports exits too).
        SchedulerConfig(
            runs_dir=runs, cpu_slots=4, reconcile_interval_s=1.0, progress_interval_s=10, warm_start=event_driven
        ),
        VirtualProbe([24000]),
        event_driven=event_driven,
    )
    await sched.start()
    await zygote_ready(sched)
    from_done, from_notice = [], []
    try:
        for _ in range(rounds):
            spec = EvalSpec(entrypoint=NOOP, episodes=1, cwd=str(root), scheduling={"marginal_vram_mb": 16000})
            a = await sched.submit_record(spec)
            b = await sched.submit_record(spec)
            sched.finished[b["id"]] = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(sched.finished[b["id"]], 30)
            done_mtime = (runs / a["id"] / "_DONE").stat().st_mtime
            from_done.append(sched.spawned[b["id"]] - mono_of_wall(done_mtime))
            from_notice.append(sched.spawned[b["id"]] - sched.exited[a["id"]])
    finally:
        await sched.stop()
    return from_done, from_notice


async def noop_turnaround(rounds: int, root: Path) -> list[float]:
    sched = TimedScheduler(
        SchedulerConfig(runs_dir=root / "noop", cpu_slots=4, progress_interval_s=10), VirtualProbe([])
    )
    await sched.start()
    await zygote_ready(sched)
    out = []
    try:
        for _ in range(rounds):
            t0 = time.monotonic()
            rec = await sched.submit_record(EvalSpec(entrypoint=NOOP, episodes=1, cwd=str(root)))
            fut = sched.finished.setdefault(rec["id"], asyncio.get_running_loop().create_future())
            t1 = await asyncio.wait_for(fut, 30)
            out.append(t1 - t0)
            assert sched.get(rec["id"]).state == "succeeded"
    finally:
        await sched.stop()
    return out


async def cgroup_cost(rounds: int, root: Path) -> tuple[str, list[float], list[float]]:
    """No-op turnarounds with and without a cgroup per run, alternating (the same noise for both)."""
    cgroups = Cgroups.detect("auto", namespace=f"evalsched-bench-{os.getpid()}")
    schedulers = {
        with_cgroup: TimedScheduler(
            SchedulerConfig(runs_dir=root / f"cg-{with_cgroup}", cpu_slots=4, progress_interval_s=10),
            VirtualProbe([]),
            cgroups=cgroups if with_cgroup else None,
        )
        for with_cgroup in (True, False)
    }
    for sched in schedulers.values():
        await sched.start()
        await zygote_ready(sched)
    out: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for with_cgroup, sched in schedulers.items():
                t0 = time.monotonic()
                rec = await sched.submit_record(EvalSpec(entrypoint=NOOP, episodes=1, cwd=str(root)))
                fut = sched.finished.setdefault(rec["id"], asyncio.get_running_loop().create_future())
                out[with_cgroup].append(await asyncio.wait_for(fut, 30) - t0)
    finally:
        for sched in schedulers.values():
            await sched.stop()
        await asyncio.sleep(0.2)  # the last clean-ups (cgroup removal) run in a thread
        cgroups.remove_namespace()
    return cgroups.support.detail, out[True], out[False]


def bare_popen(rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.monotonic()
        subprocess.Popen([sys.executable, "-c", "pass"]).wait()
        out.append(time.monotonic() - t0)
    return out


def file_creations(root: Path, rounds: int, per_round: int = 11) -> list[float]:
    """What the contract's files cost on this disk: a run directory and the files a no-op run
    creates (spec, job, shared_urls, two logs, summary, episodes, _DONE, and the atomic-rename
    temporaries), as plain create+write+close, no fsync."""
    out = []
    for i in range(rounds):
        d = root / f"files-{i}"
        t0 = time.monotonic()
        d.mkdir()
        for k in range(per_round - 1):
            fd = os.open(d / f"f{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, b"{}" * 100)
            os.close(fd)
        out.append(time.monotonic() - t0)
    return out


def ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(len(xs) * 0.9))]
    return f"median {statistics.median(xs) * 1000:8.2f} ms   p90 {p90 * 1000:8.2f} ms   (n={len(xs)})"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tick-rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"python {sys.executable}; {os.cpu_count()} cores\n")
        ev_done, ev_notice = await admission_latency(args.rounds, True, root)
        tick_done, tick_notice = await admission_latency(args.tick_rounds, False, root)
        print("1. admission latency: a run's exit -> the next admitted run's start (spawned or forked)")
        print(f"   event-driven, from _DONE        {ms(ev_done)}")
        print(f"   event-driven, from exit noticed {ms(ev_notice)}")
        print(f"   baseline 1 s reconcile, _DONE   {ms(tick_done)}")
        print(
            f"   ratio baseline/event-driven (median, from _DONE): {statistics.median(tick_done) / statistics.median(ev_done):.1f}x"
        )
        print(f"   target: <= 10 ms median -> {'met' if statistics.median(ev_done) <= 0.010 else 'NOT met'}\n")

        bare = bare_popen(args.rounds)
        noop = await noop_turnaround(args.rounds, root)
        bare2 = bare_popen(args.rounds)  # again after, so that drift on a noisy host shows
        base = statistics.median(bare + bare2)
        print("2. no-op run turnaround: submit -> succeeded")
        print(f"   Popen(python -c pass).wait()    {ms(bare + bare2)}")
        print(f"   no-op run through the scheduler {ms(noop)}")
        ratio = statistics.median(noop) / base
        print(
            f"   ratio run/bare interpreter (median): {ratio:.2f}x   target: <= 2x -> {'met' if ratio <= 2 else 'NOT met'}"
        )
        detail, with_cg, without_cg = await cgroup_cost(args.rounds, root)
        print("\n3. a cgroup per run: no-op turnaround with / without (alternating)")
        print(f"   cgroups here: {detail}")
        print(f"   with a cgroup per run           {ms(with_cg)}")
        print(f"   process group only              {ms(without_cg)}")
        print(f"   ratio with/without (median): {statistics.median(with_cg) / statistics.median(without_cg):.2f}x\n")
        files = file_creations(root, args.rounds)
        print(f"   context: a directory + 10 small files on this disk {ms(files)}")
        print(
            f"   ratio (run - file creations)/bare interpreter: {(statistics.median(noop) - statistics.median(files)) / base:.2f}x"
        )


if __name__ == "__main__":
    asyncio.run(main())
