"""The admission policy with plain data, and properties over random job mixes (hypothesis)."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_evalsched import contract, schemas
from jupyter_evalsched.contract import Holder, Why
from jupyter_evalsched.scheduler.policy import (
    Capacity,
    Device,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    admission_order,
    decide,
    effective_lane,
    never_fits,
)

ONE_GPU = Capacity(devices=(Device(0, 24000),), cpu_slots=8)
TWO_GPUS = Capacity(devices=(Device(0, 24000), Device(1, 24000)), cpu_slots=8)


def q(id, seq, **kw):
    return QueuedJob(id=id, seq=seq, **kw)


def test_second_big_job_waits_for_vram_with_numbers():
    d = decide([q("a", 1, marginal_vram_mb=16000), q("b", 2, marginal_vram_mb=16000)], [], ONE_GPU, {})
    assert [s.id for s in d.starts] == ["a"]
    assert d.starts[0].devices == (0,)
    assert d.waiting["b"] == "waiting_vram: needs 16000 MB on 1 GPU; most free is 8000 MB (GPU 0)"


def test_cpu_only_jobs_take_cpu_slots_and_no_gpu():
    jobs = [q(f"j{i}", i, cpus=3) for i in range(4)]
    d = decide(jobs, [], ONE_GPU, {})
    assert [s.id for s in d.starts] == ["j0", "j1"]
    assert all(s.devices == () for s in d.starts)
    assert d.waiting["j2"] == "waiting_cpu: needs 3 CPU slots; 2 of 8 free"


def test_multi_gpu_job_gets_k_devices_each_with_room():
    running = [RunningJob("r", (0,), 10000)]
    d = decide([q("a", 1, marginal_vram_mb=15000, gpus=2)], running, TWO_GPUS, {})
    assert d.starts == [] and d.waiting["a"].startswith(
        "waiting_vram: needs 15000 MB on each of 2 GPUs; 1 of 2 have room"
    )
    d = decide([q("a", 1, marginal_vram_mb=14000, gpus=2)], running, TWO_GPUS, {})
    assert d.starts[0].devices == (0, 1)


def test_best_fit_keeps_the_emptier_gpu_for_big_jobs():
    running = [RunningJob("r", (1,), 10000)]
    d = decide([q("small", 1, marginal_vram_mb=4000), q("big", 2, marginal_vram_mb=20000)], running, TWO_GPUS, {})
    placed = {s.id: s.devices for s in d.starts}
    assert placed == {"small": (1,), "big": (0,)}


def test_exclusive_needs_an_idle_gpu_and_blocks_it():
    running = [RunningJob("r0", (0,), 1000)]
    d = decide([q("x", 1, exclusive=True), q("y", 2, marginal_vram_mb=1000)], running, TWO_GPUS, {})
    placed = {s.id: s.devices for s in d.starts}
    assert placed["x"] == (1,)
    assert placed["y"] == (0,)  # GPU 1 is held whole by the exclusive run
    d = decide([q("z", 3, marginal_vram_mb=10)], [RunningJob("x", (0,), 0, exclusive=True)], ONE_GPU, {})
    assert d.starts == [] and d.waiting["z"].startswith("waiting_vram")
    d = decide([q("x2", 1, exclusive=True)], running, ONE_GPU, {})
    assert d.waiting["x2"] == "waiting_gpu_exclusive: needs 1 GPU with nothing else on it; GPU 0: run r0"


def test_exclusive_waits_for_foreign_processes_too():
    cap = Capacity(devices=(Device(0, 24000, unmanaged_mb=2000),), cpu_slots=4)
    d = decide([q("x", 1, exclusive=True)], [], cap, {})
    assert d.starts == []


def test_unmanaged_vram_reduces_free_and_is_named_in_the_reason():
    cap = Capacity(devices=(Device(0, 24000, unmanaged_mb=10000),), cpu_slots=4)
    d = decide([q("a", 1, marginal_vram_mb=16000)], [], cap, {})
    assert d.waiting["a"] == (
        "waiting_vram: needs 16000 MB on 1 GPU; most free is 14000 MB (GPU 0); "
        "10000 MB held by processes outside the scheduler"
    )


def test_lanes_then_fifo():
    jobs = [q("low", 1, priority="low"), q("n1", 2), q("high", 3, priority="high"), q("n2", 4)]
    assert [j.id for j in admission_order(jobs, PolicyConfig())] == ["high", "n1", "n2", "low"]


def test_aging_promotes_one_lane_per_period():
    cfg = PolicyConfig(aging_s=100)
    assert effective_lane(q("a", 1, priority="low", waited_s=99), cfg) == 2
    assert effective_lane(q("a", 1, priority="low", waited_s=100), cfg) == 1
    assert effective_lane(q("a", 1, priority="low", waited_s=250), cfg) == 0


def test_backfill_lets_a_small_job_pass_a_big_one():
    running = [RunningJob("r", (0,), 16000)]
    d = decide([q("big", 1, marginal_vram_mb=16000), q("small", 2, marginal_vram_mb=4000)], running, ONE_GPU, {})
    assert [s.id for s in d.starts] == ["small"]
    assert d.passed_over == ["big"]


def test_starving_head_reserves_its_gpu_and_cpus():
    running = [RunningJob("r", (0,), 16000)]
    big = q("big", 1, marginal_vram_mb=16000, waited_s=601)
    d = decide([big, q("small", 2, marginal_vram_mb=4000)], running, ONE_GPU, {})
    assert d.starts == []
    assert d.reserved_for == "big"
    assert d.waiting["small"] == "reserved_for:big: GPU 0 and 1 CPU slot held for an older job, run big"
    # Passed over too often counts the same as waiting too long.
    d = decide(
        [q("big", 1, marginal_vram_mb=16000, passed_over=50), q("small", 2, marginal_vram_mb=4000)],
        running,
        ONE_GPU,
        {},
    )
    assert d.reserved_for == "big" and d.starts == []


def test_reservation_leaves_other_gpus_usable():
    running = [RunningJob("r", (0,), 16000)]
    big = q("big", 1, marginal_vram_mb=16000, gpus=1, waited_s=10_000)
    cap = Capacity(devices=(Device(0, 24000), Device(1, 10000)), cpu_slots=8)
    d = decide([big, q("small", 2, marginal_vram_mb=4000)], running, cap, {})
    assert [(s.id, s.devices) for s in d.starts] == [("small", (1,))]


def test_dependencies_wait_then_fail_without_running():
    deps = {"d1": "running", "d2": "succeeded", "d3": "failed"}
    d = decide(
        [q("a", 1, depends_on=("d1", "d2")), q("b", 2, depends_on=("d2",)), q("c", 3, depends_on=("d3",))],
        [],
        ONE_GPU,
        deps,
    )
    assert [s.id for s in d.starts] == ["b"]
    assert d.waiting["a"] == "waiting_dependency: run d1 is running"
    assert d.dependency_failed == {"c": "d3"}
    d = decide([q("e", 1, depends_on=("gone",))], [], ONE_GPU, {})
    assert d.dependency_failed == {"e": "gone"}


def test_never_fits():
    assert never_fits(q("a", 1, marginal_vram_mb=30000), ONE_GPU) == (
        "marginal_vram_mb",
        "needs 30000 MB on 1 GPU; the largest usable is 24000 MB",
    )
    assert never_fits(q("a", 1, marginal_vram_mb=1, gpus=3), TWO_GPUS)[1] == "needs 3 GPUs; the host has 2"
    assert never_fits(q("a", 1, cpus=9), TWO_GPUS)[1] == "needs 9 CPU slots; the host has 8"
    assert never_fits(q("a", 1, exclusive=True), Capacity((), 4))[1] == "needs 1 GPU; the host has 0"
    assert never_fits(q("a", 1, marginal_vram_mb=24000), ONE_GPU) is None
    assert never_fits(q("a", 1), Capacity((), 1)) is None


# ---------------------------------------------------------------- properties

jobs_st = st.lists(
    st.builds(
        lambda i, prio, vram, gpus, excl, cpus, waited, passed: (prio, vram, gpus, excl, cpus, waited, passed),
        st.integers(0, 10**6),
        st.sampled_from(["high", "normal", "low"]),
        st.sampled_from([0, 0, 1000, 4000, 8000, 12000, 16000, 20000, 24000]),
        st.integers(1, 3),
        st.sampled_from([False, False, False, True]),
        st.integers(0, 4),
        st.floats(0, 2000),
        st.integers(0, 60),
    ),
    max_size=25,
)

capacity_st = st.builds(
    lambda sizes, unmanaged, cpus: Capacity(
        tuple(
            Device(i, s, min(u, s)) for i, (s, u) in enumerate(zip(sizes, unmanaged + [0] * len(sizes), strict=False))
        ),
        cpus,
    ),
    st.lists(st.sampled_from([8000, 16000, 24000, 40000]), min_size=0, max_size=4),
    st.lists(st.sampled_from([0, 0, 0, 2000, 9000]), max_size=4),
    st.integers(1, 12),
)


def _queued(raw):
    return [
        QueuedJob(
            id=f"q{i}", seq=i, priority=p, marginal_vram_mb=v, gpus=g, exclusive=e, cpus=c, waited_s=w, passed_over=po
        )
        for i, (p, v, g, e, c, w, po) in enumerate(raw)
    ]


def _running_from(decision, queued_by_id):
    out = []
    for s in decision.starts:
        j = queued_by_id[s.id]
        out.append(RunningJob(s.id, s.devices, j.marginal_vram_mb, j.exclusive, j.cpus))
    return out


def _check_no_overcommit(running, cap):
    usable = {d.index: d.usable_mb - d.unmanaged_mb for d in cap.devices}
    used = {i: 0 for i in usable}
    holders = {i: [] for i in usable}
    for r in running:
        for dev in r.devices:
            used[dev] += (
                (next(d.usable_mb for d in cap.devices if d.index == dev)) if r.exclusive else r.marginal_vram_mb
            )
            holders[dev].append(r)
    for i in usable:
        assert used[i] <= max(usable[i], 0) or all(r.marginal_vram_mb == 0 and not r.exclusive for r in holders[i])
        if any(r.exclusive for r in holders[i]):
            assert len(holders[i]) == 1, f"exclusive GPU {i} shared: {holders[i]}"
    assert sum(r.cpus for r in running) <= cap.cpu_slots


@settings(max_examples=300, deadline=None)
@given(raw=jobs_st, cap=capacity_st, pre=jobs_st)
def test_ledger_never_overcommits(raw, cap, pre):
    # Start from whatever an earlier decision admitted, then admit more: still never overcommitted.
    first = _queued(pre)
    d1 = decide([j for j in first if never_fits(j, cap) is None], [], cap, {})
    running = _running_from(d1, {j.id: j for j in first})
    _check_no_overcommit(running, cap)
    second = [replace(j, id="n" + j.id, seq=100 + j.seq) for j in _queued(raw)]
    second = [j for j in second if never_fits(j, cap) is None]
    d2 = decide(second, running, cap, {})
    _check_no_overcommit(running + _running_from(d2, {j.id: j for j in second}), cap)
    # Every queued job either starts or has a reason.
    assert {s.id for s in d2.starts} | set(d2.waiting) == {j.id for j in second}
    for reason in d2.waiting.values():
        assert reason.split(":")[0] in {"waiting_vram", "waiting_cpu", "waiting_gpu_exclusive", "reserved_for"}


@settings(max_examples=300, deadline=None)
@given(raw=jobs_st, cap=capacity_st)
def test_fifo_within_a_lane_among_jobs_that_fit(raw, cap):
    """If a later job of the same lane started while an earlier one waits, the earlier one did
    not fit: placing it first (alone, on the same state) must fail or be blocked by a reservation."""
    cfg = PolicyConfig()
    jobs = [j for j in _queued(raw) if never_fits(j, cap) is None]
    d = decide(jobs, [], cap, {}, cfg)
    started = [s.id for s in d.starts]
    by_id = {j.id: j for j in jobs}
    order = [j.id for j in admission_order(jobs, cfg)]
    for waiting_id in d.waiting:
        w = by_id[waiting_id]
        for sid in started:
            s = by_id[sid]
            if effective_lane(s, cfg) == effective_lane(w, cfg) and order.index(sid) > order.index(waiting_id):
                # Replay: admit only what started before w in order, then try w.
                before = [x for x in started if order.index(x) < order.index(waiting_id)]
                running = _running_from(type(d)(starts=[st_ for st_ in d.starts if st_.id in before]), by_id)
                alone = decide([w], running, cap, {}, cfg)
                assert alone.starts == [] or d.waiting[waiting_id].startswith("reserved_for"), (waiting_id, sid)


@settings(max_examples=300, deadline=None)
@given(raw=jobs_st, cap=capacity_st)
def test_anti_starvation_reservation_is_never_taken(raw, cap):
    """Once the head of the queue starves, nothing behind it takes what it reserved."""
    cfg = PolicyConfig(starvation_s=600, starvation_passes=50)
    jobs = [j for j in _queued(raw) if never_fits(j, cap) is None]
    if not jobs:
        return
    # Half-fill every GPU so that the head may not fit, then make the head starve.
    half = [RunningJob(f"r{d.index}", (d.index,), d.usable_mb // 2, False, 1) for d in cap.devices][: cap.cpu_slots]
    head = admission_order(jobs, cfg)[0]
    jobs = [replace(j, waited_s=10_000) if j.id == head.id else j for j in jobs]
    d = decide(jobs, half, cap, {}, cfg)
    if d.reserved_for is None:
        assert head.id in {s.id for s in d.starts}
        return
    assert d.reserved_for == head.id and head.id not in {s.id for s in d.starts}
    by_id = {j.id: j for j in jobs}
    for s in d.starts:
        assert not set(s.devices) & set(d.reserved_devices), (s, d.reserved_devices)
    cpu_free = cap.cpu_slots - sum(r.cpus for r in half)
    taken = sum(by_id[s.id].cpus for s in d.starts)
    assert taken == 0 or cpu_free - taken >= d.reserved_cpus


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 40))
def test_a_starving_head_eventually_runs(n):
    """Simulate: small jobs keep arriving and finishing; the big head job must start within a
    bounded number of rounds once it starves (its GPU drains)."""
    cap = ONE_GPU
    cfg = PolicyConfig(starvation_s=1e9, starvation_passes=5)
    running: list[RunningJob] = [RunningJob("s0", (0,), 6000)]
    passed = 0
    for round_ in range(200):
        smalls = [QueuedJob(f"s{round_}-{k}", 1 + round_ * 10 + k, marginal_vram_mb=6000) for k in range(n % 4 + 1)]
        head = QueuedJob("big", 0, marginal_vram_mb=20000, passed_over=passed)
        d = decide([head, *smalls], running, cap, {}, cfg)
        if "big" in {s.id for s in d.starts}:
            assert round_ <= cfg.starvation_passes + 5
            return
        passed += d.passed_over.count("big")
        by_id = {j.id: j for j in smalls}
        # The oldest running small job finishes each round; new ones start.
        running = running[1:] + _running_from(d, by_id)
    raise AssertionError("the big job starved")


# ---------------------------------------------------------------- preemption

PREEMPT = PolicyConfig(preempt_min_runtime_s=60, max_preemptions=3)


def r(id, vram, prio="low", preemptible=True, runtime=600.0, **kw):
    return RunningJob(id, (0,), vram, False, 1, priority=prio, preemptible=preemptible, runtime_s=runtime, **kw)


def test_a_high_job_that_cannot_fit_preempts_a_low_run():
    d = decide([q("h", 5, priority="high", marginal_vram_mb=16000)], [r("low", 16000)], ONE_GPU, {}, PREEMPT)
    assert d.preempt == {"low": "h"} and not d.starts
    assert d.waiting["h"].startswith("waiting_vram")


def test_preemption_guard_rails():
    high = [q("h", 5, priority="high", marginal_vram_mb=16000)]
    # Not preemptible, too young, preempted too often, or of the same lane: never.
    for running in (
        r("a", 16000, preemptible=False),
        r("a", 16000, runtime=59.0),
        r("a", 16000, preemptions=3),
        r("a", 16000, prio="high"),
    ):
        assert decide(high, [running], ONE_GPU, {}, PREEMPT).preempt == {}, running
    # A lower lane never preempts a higher one.
    low_job = [q("l", 5, priority="low", marginal_vram_mb=16000)]
    assert decide(low_job, [r("a", 16000, prio="normal")], ONE_GPU, {}, PREEMPT).preempt == {}
    # A job that fits needs nobody to stop; with preemption off nothing is preempted.
    assert (
        decide([q("h", 5, priority="high", marginal_vram_mb=8000)], [r("a", 16000)], ONE_GPU, {}, PREEMPT).preempt == {}
    )
    off = replace(PREEMPT, preemption=False)
    assert decide(high, [r("a", 16000)], ONE_GPU, {}, off).preempt == {}
    # A job held back by a dependency waits for it, not for room.
    dep = [q("h", 5, priority="high", marginal_vram_mb=16000, depends_on=("x",))]
    assert decide(dep, [r("a", 16000)], ONE_GPU, {"x": "running"}, PREEMPT).preempt == {}


def test_preemption_takes_the_fewest_then_the_newest_runs():
    running = [r("old-big", 16000, runtime=900), r("b", 4000, runtime=300), r("c", 4000, runtime=100)]
    d = decide([q("h", 5, priority="high", marginal_vram_mb=16000)], running, ONE_GPU, {}, PREEMPT)
    assert d.preempt == {"old-big": "h"}  # one run frees enough; two small ones would not
    running = [r("older", 12000, runtime=900), r("newer", 12000, runtime=100)]
    d = decide([q("h", 5, priority="high", marginal_vram_mb=12000)], running, ONE_GPU, {}, PREEMPT)
    assert d.preempt == {"newer": "h"}
    # Normal work is preempted for high work only when it is preemptible; low work goes first.
    running = [r("n", 12000, prio="normal", preemptible=True, runtime=100), r("l", 12000, runtime=900)]
    d = decide([q("h", 5, priority="high", marginal_vram_mb=12000)], running, ONE_GPU, {}, PREEMPT)
    assert d.preempt == {"n": "h"}  # both may go; the newest is chosen


def test_a_run_already_stopping_makes_the_room_and_is_not_doubled():
    running = [r("a", 16000, stopping=True), r("b", 8000)]
    high = [q("h", 5, priority="high", marginal_vram_mb=16000)]
    assert decide(high, running, ONE_GPU, {}, PREEMPT).preempt == {}
    # Two high jobs: the stopping run's room is claimed by the first; the second gets b stopped.
    two = [q("h", 5, priority="high", marginal_vram_mb=16000), q("h2", 6, priority="high", marginal_vram_mb=8000)]
    assert decide(two, running, ONE_GPU, {}, PREEMPT).preempt == {"b": "h2"}


def test_cpu_slots_are_room_too():
    cap = Capacity(devices=(), cpu_slots=2)
    running = [RunningJob("l", (), 0, False, 2, priority="low", preemptible=True, runtime_s=600)]
    d = decide([q("h", 5, priority="high", cpus=1)], running, cap, {}, PREEMPT)
    assert d.preempt == {"l": "h"} and d.waiting["h"].startswith("waiting_cpu")


running_st = st.lists(
    st.tuples(
        st.sampled_from(["high", "normal", "low"]),
        st.booleans(),
        st.sampled_from([0, 4000, 8000, 12000, 16000]),
        st.integers(0, 3),  # device (mod the host's)
        st.integers(0, 2),  # cpus
        st.sampled_from([0.0, 30.0, 120.0, 5000.0]),
        st.integers(0, 4),
        st.sampled_from([False, False, False, True]),
    ),
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(raw=jobs_st, cap=capacity_st, run_raw=running_st)
def test_preemption_properties(raw, cap, run_raw):
    """Only preemptible runs of strictly lower lanes, old enough, preempted fewer times than the
    limit, not stopping already, for a job that waits for room and does not start, and only when
    that job could not fit with the runs already stopping gone. Lanes strictly decrease along a
    preemption, so a preempted run can never preempt its preemptor: no cycles."""
    if not cap.devices:
        return
    running = [
        RunningJob(
            f"r{i}",
            (dev % len(cap.devices),) if vram else (),
            vram,
            False,
            cpus,
            priority=prio,
            preemptible=pre,
            runtime_s=rt,
            preemptions=n,
            stopping=stopping,
        )
        for i, (prio, pre, vram, dev, cpus, rt, n, stopping) in enumerate(run_raw)
    ]
    queued = [j for j in _queued(raw) if never_fits(j, cap) is None]
    d = decide(queued, running, cap, {}, PREEMPT)
    by_id = {j.id: j for j in queued}
    victims = {v.id: v for v in running}
    started = {s.id for s in d.starts}
    lane = {"high": 0, "normal": 1, "low": 2}
    for victim_id, job_id in d.preempt.items():
        v, job = victims[victim_id], by_id[job_id]
        assert v.preemptible and not v.stopping and v.kind == "run"
        assert v.runtime_s >= PREEMPT.preempt_min_runtime_s and v.preemptions < PREEMPT.max_preemptions
        assert lane[v.priority] > lane[job.priority]
        assert job_id not in started and d.waiting[job_id].split(":")[0] in {
            "waiting_vram",
            "waiting_cpu",
            "waiting_gpu_exclusive",
        }
    if not d.preempt:
        return
    # The first job that preempts could not have fitted once the stopping runs were gone, and does
    # fit once its victims are gone too (what the decision admitted counted).
    first = next(j for j in admission_order(queued, PREEMPT) if j.id in d.preempt.values())
    admitted = _running_from(d, by_id)
    earlier = [j.id for j in admission_order(queued, PREEMPT)]
    earlier = earlier[: earlier.index(first.id)]
    if any(job_id in earlier for job_id in d.preempt.values()):
        return
    off = replace(PREEMPT, preemption=False)
    base = [v for v in running if not v.stopping] + admitted
    # (Earlier waiting jobs may have claimed the stopping runs' room: only then may it not fit.)
    mine = [v for v in base if d.preempt.get(v.id) != first.id]
    assert first.id in {s.id for s in decide([first], mine, cap, {}, off).starts}


# --------------------------------------------------------------------------- why: reasons as data


def test_a_job_blocked_by_a_run_names_it_with_its_gpu_and_mb():
    running = [RunningJob("big", (0,), 16000, name="train llama")]
    d = decide([q("b", 2, marginal_vram_mb=16000)], running, ONE_GPU, {})
    why = d.why["b"]
    assert (why.code, why.arg) == ("waiting_vram", None)
    assert why.holders == (Holder("run", "big", "train llama", 0, 16000),)
    # The string of today, derived from the data.
    assert d.waiting["b"] == why.reason == "waiting_vram: needs 16000 MB on 1 GPU; most free is 8000 MB (GPU 0)"


def test_a_job_started_in_the_same_decision_is_a_holder_too():
    d = decide([q("a", 1, marginal_vram_mb=16000, name="first"), q("b", 2, marginal_vram_mb=16000)], [], ONE_GPU, {})
    assert d.why["b"].holders == (Holder("run", "a", "first", 0, 16000),)


def test_the_holders_are_those_of_the_gpu_the_job_is_nearest_to_fit_on():
    running = [RunningJob("r0", (0,), 20000, name="on zero"), RunningJob("r1", (1,), 12000, name="on one")]
    d = decide([q("b", 2, marginal_vram_mb=16000)], running, TWO_GPUS, {})
    assert d.why["b"].holders == (Holder("run", "r1", "on one", 1, 12000),)


def test_a_job_blocked_by_a_lease_names_it_by_its_label():
    lease = RunningJob("lease-1", (0,), 20000, kind="lease", label="analysis.ipynb", cpus=0)
    d = decide([q("b", 2, marginal_vram_mb=16000)], [lease], ONE_GPU, {})
    assert d.why["b"].holders == (Holder("lease", "lease-1", "analysis.ipynb", 0, 20000),)
    assert "lease lease-1 (analysis.ipynb) holds 20000 MB on GPU 0" in d.waiting["b"]


def test_a_job_blocked_by_a_kernels_memory_names_the_notebook():
    kernel = Holder("kernel", "k-1", "work/analysis.ipynb", 0, 15000)
    other = Holder("process", "4242", "python", 0, 5000)
    cap = Capacity(devices=(Device(0, 24000, unmanaged_mb=20000, holders=(kernel, other)),), cpu_slots=4)
    d = decide([q("a", 1, marginal_vram_mb=8000)], [], cap, {})
    assert d.why["a"].code == "waiting_vram"
    assert d.why["a"].holders == (kernel, other)
    assert d.waiting["a"] == (
        "waiting_vram: needs 8000 MB on 1 GPU; most free is 4000 MB (GPU 0); "
        "15000 MB held by kernel of work/analysis.ipynb; 5000 MB held by processes outside the scheduler"
    )


def test_a_kernels_memory_absorbed_by_its_own_lease_is_not_named():
    # The lease of the kernel that holds 15000 MB is granted in this decision: that memory is the
    # lease's from then on, and what waits behind it is told of the lease, not of the kernel.
    kernel = Holder("kernel", "k-1", "analysis.ipynb", 0, 15000)
    cap = Capacity(devices=(Device(0, 24000, unmanaged_mb=15000, holders=(kernel,)),), cpu_slots=4)
    own = q("lease-k", 1, marginal_vram_mb=16000, cpus=0, kind="lease", held=((0, 15000),), name="analysis.ipynb")
    d = decide([own, q("b", 2, marginal_vram_mb=16000)], [], cap, {})
    assert [s.id for s in d.starts] == ["lease-k"]
    assert d.why["b"].holders == (Holder("lease", "lease-k", "analysis.ipynb", 0, 16000),)
    assert "kernel" not in d.waiting["b"]


def test_an_exclusive_job_names_everything_on_the_busy_gpus():
    running = [RunningJob("r", (0,), 1000, name="small")]
    foreign = Holder("process", "7", "x", 1, 2000)
    cap = Capacity(devices=(Device(0, 24000), Device(1, 24000, 2000, (foreign,))), cpu_slots=8)
    d = decide([q("x", 1, exclusive=True)], running, cap, {})
    assert d.why["x"].code == "waiting_gpu_exclusive"
    assert d.why["x"].holders == (foreign, Holder("run", "r", "small", 0, 1000))


def test_reserved_for_names_the_job_it_is_held_for():
    config = PolicyConfig(starvation_s=100)
    running = [RunningJob("r", (0,), 20000)]
    d = decide(
        [q("big", 1, marginal_vram_mb=16000, waited_s=500, name="Big job"), q("small", 2, marginal_vram_mb=1000)],
        running,
        ONE_GPU,
        {},
        config,
    )
    why = d.why["small"]
    assert (why.code, why.arg) == ("reserved_for", "big")
    assert why.holders == (Holder("run", "big", "Big job"),)
    assert d.waiting["small"] == "reserved_for:big: GPU 0 and 1 CPU slot held for an older job, run Big job (big)"


def test_waiting_dependency_names_the_dependencies():
    d = decide(
        [q("a", 1, depends_on=("d1", "d2", "d3"))],
        [],
        ONE_GPU,
        {"d1": "running", "d2": "succeeded", "d3": "queued"},
        dependency_names={"d1": "prepare", "d3": "tokenize"},
    )
    assert d.why["a"].holders == (Holder("run", "d1", "prepare"), Holder("run", "d3", "tokenize"))
    assert d.waiting["a"] == "waiting_dependency: run prepare (d1) is running; run tokenize (d3) is queued"


named_running_st = st.lists(
    st.tuples(
        st.sampled_from(["run", "lease"]),
        st.booleans(),
        st.sampled_from([0, 4000, 12000, 20000]),
        st.integers(0, 3),
        st.integers(0, 2),
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(raw=jobs_st, cap=capacity_st, run_raw=named_running_st)
def test_every_waiting_jobs_reason_is_its_why_and_its_holders_hold_what_it_needs(raw, cap, run_raw):
    """For every waiting job: the reason is the contract's string of its why, the why survives
    JSON and the record's model unchanged, and each run or lease it names holds what it names
    (the GPU is one of that job's, the MB its charge there)."""
    devices = [d.index for d in cap.devices]
    usable = {d.index: d.usable_mb for d in cap.devices}
    running = [
        RunningJob(
            f"{kind}{i}",
            (devices[dev % len(devices)],) if devices and (vram or excl) else (),
            vram,
            excl,
            0 if kind == "lease" else cpus,
            kind=kind,
            label=f"label {i}" if kind == "lease" else "",
            name=f"name {i}" if kind == "run" else "",
        )
        for i, (kind, excl, vram, dev, cpus) in enumerate(run_raw)
    ]
    queued = [replace(j, name=f"queued {j.id}") for j in _queued(raw) if never_fits(j, cap) is None]
    d = decide(queued, running, cap, {})
    holding = {r.id: (r.devices, r) for r in running}
    placed = {s.id: s.devices for s in d.starts}
    by_id = {j.id: j for j in queued}
    assert set(d.waiting) == set(d.why)
    for job_id, why in d.why.items():
        assert d.waiting[job_id] == contract.reason(why.code, why.detail, arg=why.arg, limit=10_000)
        data = json.loads(json.dumps(why.as_dict()))
        assert Why.from_dict(data) == why
        assert schemas.Why.model_validate(data).model_dump() == data
        for holder in why.holders:
            assert holder.kind in contract.HOLDER_KINDS
            if why.code == "reserved_for":
                assert holder.id == why.arg
                continue
            if holder.kind in ("kernel", "process"):
                continue
            if why.code == "waiting_cpu":  # a job that holds CPU slots
                cpus = holding[holder.id][1].cpus if holder.id in holding else by_id[holder.id].cpus
                assert cpus > 0 and holder.gpu is None, (holder, why)
                continue
            if holder.id in holding:
                devs, job = holding[holder.id]
                charge = usable[holder.gpu] if job.exclusive else job.marginal_vram_mb
                assert (holder.name, holder.kind) == (job.label or job.name, job.kind)
            else:
                devs, started = placed[holder.id], by_id[holder.id]
                charge = usable[holder.gpu] if started.exclusive else started.marginal_vram_mb
                assert holder.name == started.name
            assert holder.gpu in devs and holder.mb == charge, (holder, why)


def test_waiting_cpu_names_the_jobs_holding_the_slots():
    running = [RunningJob("r", (), 0, cpus=6, name="tokenize"), RunningJob("lease", (0,), 1000, kind="lease", cpus=0)]
    d = decide([q("a", 1, cpus=4)], running, ONE_GPU, {})
    assert d.waiting["a"] == "waiting_cpu: needs 4 CPU slots; 2 of 8 free"
    assert d.why["a"].holders == (Holder("run", "r", "tokenize"),)


def test_a_reservation_carried_to_a_decision_about_a_new_job_names_its_job():
    config = PolicyConfig(starvation_s=100)
    running = [RunningJob("r", (0,), 20000)]
    first = decide([q("big", 1, marginal_vram_mb=16000, waited_s=500, name="Big job")], running, ONE_GPU, {}, config)
    carried = first.reservation()
    assert carried is not None and (carried.job_id, carried.name) == ("big", "Big job")
    later = decide([q("small", 2, marginal_vram_mb=1000)], running, ONE_GPU, {}, config, reservation=carried)
    assert later.why["small"].holders == (Holder("run", "big", "Big job"),)
    assert decide([], [], ONE_GPU, {}).reservation() is None


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(["a", "é", " ", "\n", "\t", "\u00a0", "\u2028", "\x1f"]), max_size=30))
def test_one_line_collapses_every_kind_of_whitespace(text):
    # Its fast path (printable text without doubled or outer spaces) must give what a split gives.
    collapsed = " ".join(text.split())
    assert contract.one_line(text, 20) == (collapsed if len(collapsed) <= 20 else collapsed[:19] + "…")
