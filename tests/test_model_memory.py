"""The ledger owns the shared models' memory (#31): a model's ``vram_mb`` is admitted like a run's
when it loads, held while it is loaded, and an idle model is unloaded for a job waiting for its
room. First the pure decision (``policy.decide``), then a real server with virtual GPUs."""

from __future__ import annotations

from jupyter_evalsched import contract
from jupyter_evalsched.scheduler.policy import (
    Capacity,
    Device,
    ModelNeed,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    decide,
)

ONE_GPU = Capacity(devices=(Device(0, 24000),), cpu_slots=8)


def loaded(name: str, mb: int, *, idle_s: float = 0.0, idle_unload_s: float | None = 60.0, gpu: int = 0) -> RunningJob:
    """A shared model the ledger holds (as Admission.running_jobs gives it)."""
    return RunningJob(
        id=name,
        devices=(gpu,),
        marginal_vram_mb=mb,
        cpus=0,
        kind="model",
        name=name,
        idle_s=idle_s,
        idle_unload_s=idle_unload_s,
    )


def load(name: str, mb: int, gpu: int = 0, seq: int = -100) -> QueuedJob:
    """A model's load waiting for room (as Admission._load_as_queued gives it)."""
    return QueuedJob(
        id=name, seq=seq, name=name, priority="high", cpus=0, kind="model", models=(ModelNeed(name, gpu, mb),)
    )


# --------------------------------------------------------------------------- admitted like a run


def test_a_loaded_model_holds_its_vram_and_is_named_among_the_holders():
    d = decide([QueuedJob("r", 1, marginal_vram_mb=20000, name="big")], [loaded("llm", 14000)], ONE_GPU, {})
    assert d.starts == [] and d.unload == {}  # in use (idle_s 0): never unloaded
    why = d.why["r"]
    assert why.code == contract.WAITING_VRAM
    assert "most free is 10000 MB (GPU 0)" in why.detail
    assert [(h.kind, h.id, h.mb) for h in why.holders] == [("model", "llm", 14000)]


def test_an_unloaded_model_holds_nothing():
    d = decide([QueuedJob("r", 1, marginal_vram_mb=20000)], [], ONE_GPU, {})
    assert [s.id for s in d.starts] == ["r"] and d.loads == []


def test_a_run_is_admitted_with_the_models_it_needs():
    run = QueuedJob("r", 1, marginal_vram_mb=8000, models=(ModelNeed("llm", 0, 14000),))
    d = decide([run], [], ONE_GPU, {})
    assert [s.id for s in d.starts] == ["r"] and d.loads == ["llm"]
    # What they take together is gone for the next job in the same decision.
    later = QueuedJob("s", 2, marginal_vram_mb=4000)
    d = decide([run, later], [], ONE_GPU, {})
    assert [s.id for s in d.starts] == ["r"] and d.why["s"].code == contract.WAITING_VRAM


def test_a_run_whose_model_has_no_room_waits_with_the_model_reason_and_its_holders():
    lease = RunningJob("lease-1", devices=(0,), marginal_vram_mb=16000, cpus=0, kind="lease", label="nb.ipynb")
    run = QueuedJob("r", 1, marginal_vram_mb=100, models=(ModelNeed("llm", 0, 14000),))
    d = decide([run], [lease], ONE_GPU, {})
    assert d.starts == [] and d.loads == []
    why = d.why["r"]
    assert why.code == contract.WAITING_MODEL_VRAM
    assert why.detail == "shared model llm needs 14000 MB on GPU 0; 8000 MB free"
    assert [(h.kind, h.id) for h in why.holders] == [("lease", "lease-1")]


def test_a_model_load_waits_for_another_model_in_use_and_names_it():
    d = decide([load("b", 14000)], [loaded("a", 14000)], ONE_GPU, {})
    assert d.loads == [] and d.unload == {}
    why = d.why["b"]
    assert why.code == contract.WAITING_MODEL_VRAM
    assert [(h.kind, h.id, h.mb) for h in why.holders] == [("model", "a", 14000)]


def test_two_jobs_needing_one_model_load_it_once():
    run = QueuedJob("r", 1, marginal_vram_mb=4000, models=(ModelNeed("llm", 0, 14000),))
    d = decide([load("llm", 14000), run], [], ONE_GPU, {})
    assert d.loads == ["llm"] and [s.id for s in d.starts] == ["r"]  # 14000 + 4000, not 28000 + 4000


def test_a_model_on_a_gpu_the_host_does_not_have_accounts_nothing():
    d = decide([load("far", 14000, gpu=5)], [], ONE_GPU, {})
    assert d.loads == ["far"] and d.starts == []  # a load is no run: it starts nothing


# --------------------------------------------------------------------------- idle unload


def test_an_idle_model_is_unloaded_for_a_run_waiting_for_its_room():
    d = decide([QueuedJob("r", 1, marginal_vram_mb=20000)], [loaded("llm", 14000, idle_s=61)], ONE_GPU, {})
    assert d.unload == {"llm": "r"}
    assert d.starts == []  # it starts at the next decision, once the model's host is gone
    assert d.why["r"].code == contract.WAITING_VRAM


def test_nothing_is_unloaded_when_no_job_waits_for_the_room():
    idle = [loaded("llm", 14000, idle_s=10_000)]
    assert decide([], idle, ONE_GPU, {}).unload == {}
    assert decide([QueuedJob("r", 1, marginal_vram_mb=8000)], idle, ONE_GPU, {}).unload == {}  # it fits


def test_a_model_not_idle_long_enough_or_never_unloadable_stays():
    job = [QueuedJob("r", 1, marginal_vram_mb=20000)]
    assert decide(job, [loaded("llm", 14000, idle_s=59)], ONE_GPU, {}).unload == {}
    assert decide(job, [loaded("llm", 14000, idle_s=10_000, idle_unload_s=None)], ONE_GPU, {}).unload == {}


def test_the_fewest_models_are_unloaded_the_longest_idle_first():
    models = [loaded("a", 6000, idle_s=100), loaded("b", 6000, idle_s=500), loaded("c", 6000, idle_s=300)]
    d = decide([QueuedJob("r", 1, marginal_vram_mb=10000)], models, ONE_GPU, {})
    assert d.unload == {"b": "r"}  # 6000 free + b's 6000 is enough
    d = decide([QueuedJob("r", 1, marginal_vram_mb=16000)], models, ONE_GPU, {})
    assert d.unload == {"b": "r", "c": "r"}


def test_no_model_is_unloaded_when_that_would_not_make_enough_room():
    other = RunningJob("busy-run", devices=(0,), marginal_vram_mb=9000)
    d = decide([QueuedJob("r", 1, marginal_vram_mb=20000)], [other, loaded("llm", 14000, idle_s=1000)], ONE_GPU, {})
    assert d.unload == {}


def test_an_idle_model_is_unloaded_for_a_lease_and_for_another_models_load():
    lease = QueuedJob("lease-1", 1, marginal_vram_mb=20000, cpus=0, kind="lease", priority="high")
    assert decide([lease], [loaded("llm", 14000, idle_s=61)], ONE_GPU, {}).unload == {"llm": "lease-1"}
    assert decide([load("b", 14000)], [loaded("a", 14000, idle_s=61)], ONE_GPU, {}).unload == {"a": "b"}


def test_an_idle_unload_comes_before_any_preemption():
    victim = RunningJob("low", devices=(0,), marginal_vram_mb=6000, priority="low", preemptible=True, runtime_s=1e4)
    job = QueuedJob("r", 1, marginal_vram_mb=16000, priority="high")
    d = decide([job], [victim, loaded("llm", 14000, idle_s=61)], ONE_GPU, {}, PolicyConfig())
    assert d.unload == {"llm": "r"} and d.preempt == {}


def test_one_unload_serves_one_job_the_next_waits():
    d = decide(
        [QueuedJob("r", 1, marginal_vram_mb=20000), QueuedJob("s", 2, marginal_vram_mb=20000)],
        [loaded("llm", 14000, idle_s=61)],
        ONE_GPU,
        {},
    )
    assert d.unload == {"llm": "r"}
