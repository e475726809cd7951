"""The ledger owns the shared models' memory (#31): a model's ``vram_mb`` is admitted like a run's
when it loads, held while it is loaded, and an idle model is unloaded for a job waiting for its
room. First the pure decision (``policy.decide``), then a real server with virtual GPUs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import openai
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from waiting import async_wait_until

from jupyter_evalsched import contract
from jupyter_evalsched.scheduler.policy import (
    Capacity,
    Device,
    ModelNeed,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    decide,
    never_fits,
)
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

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


def test_a_run_that_can_never_fit_beside_its_models_never_fits():
    llm = ModelNeed("llm", 0, 14000)
    assert never_fits(QueuedJob("r", 1, marginal_vram_mb=10000, models=(llm,)), ONE_GPU) is None
    assert never_fits(QueuedJob("r", 1, marginal_vram_mb=16000, models=(llm,)), ONE_GPU) == (
        "marginal_vram_mb",
        "needs 16000 MB on 1 GPU beside its shared models (llm: 14000 MB on GPU 0)",
    )
    huge = ModelNeed("huge", 0, 30000)
    assert never_fits(QueuedJob("r", 1, models=(huge,)), ONE_GPU) == (
        "models",
        "shared model huge needs 30000 MB on GPU 0; its usable VRAM is 24000 MB",
    )


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


def test_a_model_being_unloaded_makes_its_room_and_no_other_is_unloaded_for_it():
    unloading = replace(loaded("a", 14000, idle_s=61), stopping=True)
    # 2000 MB free; a's 14000 are on their way: b (8000, idle longer) would be enough, and stays.
    d = decide([QueuedJob("r", 1, marginal_vram_mb=10000)], [unloading, loaded("b", 8000, idle_s=500)], ONE_GPU, {})
    assert d.unload == {} and d.preempt == {} and d.starts == []


def test_one_unload_serves_one_job_the_next_waits():
    d = decide(
        [QueuedJob("r", 1, marginal_vram_mb=20000), QueuedJob("s", 2, marginal_vram_mb=20000)],
        [loaded("llm", 14000, idle_s=61)],
        ONE_GPU,
        {},
    )
    assert d.unload == {"llm": "r"}


# --------------------------------------------------------------------------- a real server

# One virtual GPU; a real (tiny, offline) causal LM declared on it with 14000 MB, loaded on the
# CPU (the GPU is the probe's fiction), unloaded once idle 1 s when something waits for its room.
IDLE_UNLOAD_S = 1.0


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2")


@pytest.fixture
def evalsched_config(tiny_lm_dir):
    return {
        "virtual_gpus": [24000],
        "models": [
            {
                "name": "llm",
                "loader": "jupyter_evalsched.shared_models.testing:causal_lm_on_cpu",
                "model": tiny_lm_dir,
                "device": 0,
                "vram_mb": 14000,
                "idle_unload_s": IDLE_UNLOAD_S,
                "cpu_threads": 1,
            }
        ],
    }


@pytest.fixture
def client(jp_serverapp, jp_http_port, jp_base_url, jp_fetch, evalsched):  # jp_fetch: the server listens
    """OpenAI's client, called in a thread (the server runs on this test's event loop)."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1",
        api_key=jp_serverapp.identity_provider.token,
        max_retries=0,
        timeout=120,
    )


def complete(client) -> str:
    answer = client.completions.create(model="llm", prompt="The cat", max_tokens=2, temperature=0)
    return answer.choices[0].text


async def model_entry(api) -> dict | None:
    """The model's entry in the ledger's GPU 0 (``None`` when it holds nothing and waits for nothing)."""
    code, ledger = await api("GET", "ledger")
    assert code == 200, ledger
    return next((m for m in ledger["devices"][0]["models"] if m["name"] == "llm"), None)


async def described(api) -> dict:
    code, body = await api("GET", "models")
    return next(m for m in body["models"] if m["name"] == "llm")


async def lease(api, holder, vram_mb: int, label: str) -> dict:
    code, rec = await api("POST", "leases", {"vram_mb": vram_mb, "pid": holder().pid, "label": label})
    assert code == 201, rec
    return rec


async def lease_state(api, lease_id: str, state: str) -> dict:
    async def reached():
        code, rec = await api("GET", f"leases/{lease_id}")
        return rec if rec["state"] == state else None

    return await async_wait_until(reached, timeout=30, message=f"lease {lease_id} never {state}")


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
async def test_a_load_waits_for_room_and_an_idle_model_makes_room_for_a_lease(api, client, holder):
    # Nothing loaded: the model holds nothing.
    assert await model_entry(api) is None
    first = await lease(api, holder, 16000, "first")
    assert first["state"] == "granted"

    # A request for the model: its load waits (14000 MB do not fit beside the lease's 16000).
    request = asyncio.ensure_future(asyncio.to_thread(complete, client))

    async def load_waits():
        entry = await model_entry(api)
        return entry if entry is not None and entry["state"] == "waiting" else None

    entry = await async_wait_until(load_waits, timeout=30, message="the model's load never waited in the ledger")
    assert entry["why"]["code"] == contract.WAITING_MODEL_VRAM
    assert entry["why"]["detail"] == "shared model llm needs 14000 MB on GPU 0; 8000 MB free"
    assert [(h["kind"], h["id"]) for h in entry["why"]["holders"]] == [("lease", first["id"])]
    assert not request.done() and (await described(api))["load_count"] == 0

    # The lease ends: the model is admitted, loads, answers.
    assert (await api("DELETE", f"leases/{first['id']}"))[0] == 204
    assert isinstance(await asyncio.wait_for(request, 120), str)
    entry = await model_entry(api)
    assert (entry["state"], entry["vram_mb"], entry["idle_unload_s"]) == ("held", 14000, IDLE_UNLOAD_S)
    code, ledger = await api("GET", "ledger")
    assert (ledger["devices"][0]["baseline_mb"], ledger["devices"][0]["free_mb"]) == (14000, 10000)
    assert (await described(api))["load_count"] == 1

    # Idle, but nothing waits for its room: it stays loaded.
    await asyncio.sleep(3 * IDLE_UNLOAD_S)
    assert (await model_entry(api))["state"] == "held" and (await described(api))["state"] == "loaded"

    # A lease that needs its room waits (the model named as what holds it), then gets it: the
    # idle model is unloaded, its host stopped.
    second = await lease(api, holder, 16000, "second")
    assert second["state"] == "queued" and second["why"]["code"] == contract.WAITING_VRAM
    assert ("model", "llm") in [(h["kind"], h["id"]) for h in second["why"]["holders"]]
    await lease_state(api, second["id"], "granted")
    assert await model_entry(api) is None
    model = await described(api)
    assert model["state"] == "not_loaded" and model["pid"] is None

    # The next caller loads it again, once there is room.
    assert (await api("DELETE", f"leases/{second['id']}"))[0] == 204
    assert isinstance(await asyncio.to_thread(complete, client), str)
    assert (await described(api))["load_count"] == 2
    assert (await model_entry(api))["state"] == "held"


RUN_USING_THE_MODEL = """
import os, time

def episode(ctx, index):
    # Declared: the model is in use while this run lives, whatever it does.
    while not os.path.exists(os.environ["RELEASE_FILE"]):
        time.sleep(0.05)
    return {"ok": 1}
"""


async def test_a_model_a_live_run_declared_is_never_unloaded(api, holder, wait_for, tmp_path):
    release = tmp_path / "release"
    spec = {"source": RUN_USING_THE_MODEL, "episodes": 1, "models": ["llm"], "env": {"RELEASE_FILE": str(release)}}
    code, run = await api("POST", "runs", spec)
    assert code == 201, run
    await wait_for(run["id"], states=("running",), timeout=60)
    entry = await model_entry(api)
    assert entry["state"] == "held" and entry["idle_s"] == 0  # admitted with the run, in use

    waiting = await lease(api, holder, 16000, "waits")
    assert waiting["state"] == "queued" and waiting["why"]["code"] == contract.WAITING_VRAM
    assert ("model", "llm") in [(h["kind"], h["id"]) for h in waiting["why"]["holders"]]
    # Well past its idle_unload_s, with a lease waiting: the run's model stays.
    await asyncio.sleep(3 * IDLE_UNLOAD_S)
    entry = await model_entry(api)
    assert entry is not None and entry["state"] == "held", "the live run's model was unloaded"
    code, rec = await api("GET", f"leases/{waiting['id']}")
    assert rec["state"] == "queued"

    # The run ends: the model is idle, unloaded for the lease.
    release.write_text("")
    assert (await wait_for(run["id"], timeout=60))["state"] == "succeeded"
    await lease_state(api, waiting["id"], "granted")
    assert await model_entry(api) is None


async def test_a_run_that_can_never_fit_beside_its_model_is_refused(api):
    code, err = await api(
        "POST", "runs", {"entrypoint": "a:b", "models": ["llm"], "scheduling": {"marginal_vram_mb": 16000}}
    )
    assert code == 422, err
    assert "needs 16000 MB on 1 GPU beside its shared models (llm: 14000 MB on GPU 0)" in err["message"]


async def test_a_run_whose_model_has_no_room_waits_queued_with_the_reason(api, holder, wait_for):
    first = await lease(api, holder, 16000, "big")
    code, run = await api("POST", "runs", {"source": RUN_USING_THE_MODEL, "episodes": 1, "models": ["llm"]})
    assert code == 201, run

    async def reason():
        code, rec = await api("GET", f"runs/{run['id']}")
        return rec if (rec.get("why") or {}).get("code") == contract.WAITING_MODEL_VRAM else None

    rec = await async_wait_until(reason, timeout=30, message="the run never said it waits for its model's room")
    assert rec["state"] == "queued"
    assert rec["reason"] == "waiting_model_vram: shared model llm needs 14000 MB on GPU 0; 8000 MB free"
    assert [(h["kind"], h["id"]) for h in rec["why"]["holders"]] == [("lease", first["id"])]
    assert (await described(api))["load_count"] == 0
    code, _ = await api("POST", f"runs/{run['id']}/cancel")
    assert (await wait_for(run["id"]))["state"] == "cancelled"


def test_the_widget_draws_each_loaded_model_as_its_share_of_the_bar():
    from jupyter_evalsched.widget import ledger_html

    dev = {
        "index": 0,
        "name": "virtual",
        "total_mb": 24000,
        "baseline_mb": 14000,
        "usable_mb": 24000,
        "allocated_mb": 18000,
        "free_mb": 6000,
        "runs": [{"id": "r1", "marginal_vram_mb": 4000}],
        "leases": [],
        "models": [
            {"name": "llm", "vram_mb": 14000, "state": "held", "idle_s": 3.0, "idle_unload_s": 300.0, "why": None},
            {"name": "other", "vram_mb": 9000, "state": "waiting", "idle_s": None, "idle_unload_s": None, "why": None},
        ],
    }
    html = ledger_html({"devices": [dev], "cpu_slots": {"total": 8, "allocated": 1}})
    assert html.count("data-seg-kind='model'") == 1 and "data-model='llm'" in html  # a waiting one holds nothing
    assert "data-seg-kind='baseline'" not in html  # drawn once, as the model
    # The bar is the GPU: the model's 14000 of 24000 MB.
    assert "width:58.33%" in html and "model llm 14000 MB" in html


# --------------------------------------------------------------------------- properties

TWO_GPUS = Capacity(devices=(Device(0, 24000), Device(1, 16000)), cpu_slots=8)
_sizes = st.sampled_from([0, 2000, 6000, 10000, 14000])


@st.composite
def model_mixes(draw):
    names = ["m0", "m1", "m2", "m3"]
    gpu_of = {name: draw(st.sampled_from([0, 1])) for name in names}
    mb_of = {name: draw(st.sampled_from([2000, 6000, 10000])) for name in names}
    resident = draw(st.lists(st.sampled_from(names), unique=True, max_size=3))
    running = [
        loaded(n, mb_of[n], gpu=gpu_of[n], idle_s=draw(st.sampled_from([0.0, 30.0, 100.0])), idle_unload_s=60.0)
        for n in resident
    ]
    for index, usable in ((0, 24000), (1, 16000)):
        assume(sum(m.marginal_vram_mb for m in running if m.devices == (index,)) <= usable)  # a state the ledger allows
    queued = []
    for i in range(draw(st.integers(0, 5))):
        needs = draw(st.lists(st.sampled_from(names), unique=True, max_size=2))
        models = tuple(ModelNeed(n, gpu_of[n], mb_of[n]) for n in needs if n not in resident)
        queued.append(QueuedJob(f"r{i}", i + 1, marginal_vram_mb=draw(_sizes), models=models, cpus=0))
    for n in draw(st.lists(st.sampled_from(names), unique=True, max_size=2)):
        if n not in resident:
            queued.append(load(n, mb_of[n], gpu=gpu_of[n], seq=-10 - len(queued)))
    return queued, running, mb_of, gpu_of


@settings(max_examples=300, deadline=None)
@given(model_mixes())
def test_models_and_runs_never_overcommit_a_gpu_and_only_idle_models_unload(mix):
    queued, running, mb_of, gpu_of = mix
    d = decide(queued, running, TWO_GPUS, {})
    used = {0: 0, 1: 0}
    for model in running:
        used[model.devices[0]] += model.marginal_vram_mb
    for name in d.loads:
        used[gpu_of[name]] += mb_of[name]
    by_id = {job.id: job for job in queued}
    for start in d.starts:
        for index in start.devices:
            used[index] += by_id[start.id].marginal_vram_mb
    assert used[0] <= 24000 and used[1] <= 16000  # models held, admitted and runs started together
    assert len(d.loads) == len(set(d.loads))  # a model is loaded once
    for name, job_id in d.unload.items():
        model = next(m for m in running if m.id == name)
        assert model.unloadable and job_id in d.why  # only idle models, only for a waiting job
    if not d.why:
        assert d.unload == {}
