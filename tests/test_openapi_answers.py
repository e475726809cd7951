"""Answers through their types: a real server is driven through every route of its OpenAPI
document with real data (runs queued, running, succeeded, failed and cancelled, leases granted and
queued, a sweep, comparisons, logs, episodes, a shared model, the errors a client can cause), and
every answer is checked against the document: its status is one the route declares, its content
type the declared one, and its body valid against that status's schema ($refs resolved, with
jsonschema). Objects are checked closed: a field the server sends but no model declares fails.
The event socket's messages are checked against the same schemas. Finally every route of the
document must have been exercised."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from openapi_spec_validator import validate as validate_openapi
from rest import CRASH, NOOP, SLEEPY, spec

from jupyter_evalsched.openapi import openapi_document
from jupyter_evalsched.shared_models.tiny import build_tiny_bert
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

METHODS = ("get", "post", "put", "patch", "delete")
TESTING = "jupyter_evalsched.shared_models.testing:"
LOADERS = "jupyter_evalsched.shared_models.loaders:"


@pytest.fixture
def evalsched_config(request):
    config = {"models": [{"name": "upper", "loader": TESTING + "upper"}], "warm_start": False, "max_leases": 2}
    if "tiny_lm_dir" in request.fixturenames:  # the /v1 routes' answers, from real models
        config["models"] += [
            {"name": "lm", "loader": LOADERS + "causal_lm", "model": request.getfixturevalue("tiny_lm_dir")},
            {
                "name": "embed",
                "loader": LOADERS + "sentence_embeddings",
                "model": request.getfixturevalue("tiny_bert_dir"),
            },
        ]
    return config


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    return build_tiny_bert(str(tmp_path_factory.getbasetemp() / "models" / "tiny-bert"))


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others
    (``additionalProperties: false``), so that an undeclared field in an answer is an error. The
    served document stays open: clients must accept fields added later."""
    if isinstance(schema, dict):
        out = {key: closed(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    return schema


class Contract:
    """The OpenAPI document as a checker of answers, and the record of what was exercised."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.components = closed(document["components"])
        self.routes: list[tuple[re.Pattern[str], str]] = []
        for template in document["paths"]:
            pattern = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template))
            self.routes.append((re.compile(pattern + "/?"), template))
        self.exercised: dict[tuple[str, str], set[int]] = {}

    def operations(self) -> set[tuple[str, str]]:
        return {(m, t) for t, item in self.document["paths"].items() for m in METHODS if m in item}

    def template_of(self, path: str) -> str:
        found = [t for pattern, t in self.routes if pattern.fullmatch(path)]
        assert len(found) == 1, f"{path} matches {found} in the OpenAPI document"
        return found[0]

    def validator(self, schema: dict[str, Any]) -> Draft202012Validator:
        return Draft202012Validator({**closed(schema), "components": self.components})

    def schema_errors(self, schema: dict[str, Any], body: Any) -> list[str]:
        return [
            f"{'/'.join(map(str, e.absolute_path)) or '(body)'}: {e.message}"
            for e in self.validator(schema).iter_errors(body)
        ]

    def component(self, name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}

    def check(self, method: str, path: str, status: int, content_type: str, text: str) -> Any:
        """The answer checked against the document; the parsed body (JSON, text or None)."""
        template = self.template_of(path)
        operation = self.document["paths"][template].get(method.lower())
        where = f"{method} /evalsched{path} -> {status}"
        assert operation is not None, f"{method} {template} is not in the OpenAPI document"
        self.exercised.setdefault((method.lower(), template), set()).add(status)
        responses = operation["responses"]
        assert str(status) in responses, f"{where}: the document declares only {sorted(responses)}: {text[:300]}"
        content = responses[str(status)].get("content")
        if not content:
            assert text == "", f"{where}: no body is declared, got {text[:200]!r}"
            return None
        media = content_type.split(";")[0].strip()
        assert media in content, f"{where}: Content-Type {content_type!r}, the document declares {sorted(content)}"
        body: Any = text
        if media == "application/json":
            body = json.loads(text)
        errors = self.schema_errors(content[media]["schema"], body)
        assert not errors, f"{where}: the answer does not match its schema:\n" + "\n".join(errors[:20])
        return body


@pytest.fixture
def contract_checker():
    document = copy.deepcopy(openapi_document())
    validate_openapi(document)  # a valid OpenAPI 3.1 document to begin with
    return Contract(document)


@pytest.fixture
def call(jp_fetch, evalsched, contract_checker):
    """``await call("POST", "runs", body, expect=201)``: the request through the real server, its
    answer checked against the document; returns the parsed body."""

    async def fetch(method: str, path: str, body: Any = None, params=None, headers=None, expect: int | None = None):
        # (request_timeout: the first request to a model waits for its load)
        kwargs: dict[str, Any] = {
            "method": method,
            "raise_error": False,
            "headers": headers or {},
            "request_timeout": 300,
        }
        if body is not None:
            kwargs["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        elif method in ("POST", "PUT", "PATCH"):
            kwargs["body"] = b""
        resp = await jp_fetch("evalsched", *path.split("/"), params=params, **kwargs)
        text = resp.body.decode() if resp.body else ""
        parsed = contract_checker.check(method, "/" + path, resp.code, resp.headers.get("Content-Type", ""), text)
        if expect is not None:
            assert resp.code == expect, f"{method} {path}: {resp.code} {text[:500]}"
        return parsed

    return fetch


async def settle(call, run_id: str, states: tuple[str, ...], reason: str = "", timeout: float = 60.0) -> dict:
    """The run's record (through the checked API) once its state is one of ``states`` and its
    reason starts with ``reason``."""
    deadline = time.monotonic() + timeout
    while True:
        record = await call("GET", f"runs/{run_id}", expect=200)
        if record["state"] in states and (record["reason"] or "").startswith(reason):
            return record
        assert time.monotonic() < deadline, f"run {run_id} still {record['state']} ({record['reason']})"
        await asyncio.sleep(0.1)


async def test_every_route_answers_as_its_openapi_document_says(call, contract_checker, jp_ws_fetch, runs_dir):
    checker = contract_checker
    socket = await jp_ws_fetch("evalsched", "events")
    snapshot = json.loads(await socket.read_message())
    assert snapshot["type"] == "snapshot"
    assert not checker.schema_errors(checker.component("QueueView"), snapshot["queue"])
    checker.exercised.setdefault(("get", "/events"), set()).add(101)

    # --- runs in every state: succeeded, failed, running, queued (then cancelled), resumed
    done = await call("POST", "runs", spec(NOOP, episodes=3, name="noop"), expect=201)
    crash = await call("POST", "runs", spec(CRASH, params={"how": "exception"}, name="crash"), expect=201)
    running = await call("POST", "runs", spec(SLEEPY, vram=20000, episodes=200, sleep_s=0.2, name="long"), expect=201)
    waiting = await call(
        "POST", "runs", spec(SLEEPY, vram=20000, scheduling={"gpus": 2}, depends_on=[done["id"]]), expect=201
    )
    # The same Idempotency-Key twice: 201, then 200 with the same run.
    key = {"Idempotency-Key": "answers-through-types-1"}
    first = await call("POST", "runs", spec(NOOP, name="keyed"), headers=key, expect=201)
    again = await call("POST", "runs", spec(NOOP, name="keyed"), headers=key, expect=200)
    assert again["id"] == first["id"]
    await call("POST", "runs", spec(NOOP, name="other"), headers=key, expect=409)

    assert (await settle(call, done["id"], ("succeeded",)))["progress"] == {"done": 3, "total": 3}
    failed = await settle(call, crash["id"], ("failed",))
    assert failed["reason"].startswith("exception")
    await settle(call, running["id"], ("running",))
    await settle(call, waiting["id"], ("queued",), reason="waiting_vram")
    await settle(call, first["id"], ("succeeded",))

    listing = await call("GET", "runs", expect=200)
    assert listing["total"] == 5 and listing["runs"][0]["id"] == first["id"]  # newest first
    assert {r["state"] for r in listing["runs"]} == {"succeeded", "failed", "running", "queued"}
    assert (await call("GET", "runs", params={"state": "queued,running", "limit": "1"}, expect=200))["total"] == 2
    detail = await call("GET", f"runs/{done['id']}", expect=200)
    assert detail["summary"]["status"] == "succeeded"
    await call("GET", f"runs/{running['id']}", expect=200)
    assert len((await call("GET", f"runs/{done['id']}/episodes", expect=200))["episodes"]) == 3
    await call("GET", f"runs/{crash['id']}/logs", params={"stream": "stderr", "tail": "5"}, expect=200)
    assert isinstance(await call("GET", f"runs/{done['id']}/logs", expect=200), str)

    queue = await call("GET", "queue", expect=200)
    assert [r["id"] for r in queue["queued"]] == [waiting["id"]]
    assert [r["id"] for r in queue["running"]] == [running["id"]]
    ledger = await call("GET", "ledger", expect=200)
    assert sum(d["allocated_mb"] for d in ledger["devices"]) == 20000

    # --- leases: one granted, one queued behind it (both GPUs for itself), released
    granted = await call("POST", "leases", {"vram_mb": 2000, "label": "notebook"}, expect=201)
    assert granted["state"] == "granted"
    held_back = await call("POST", "leases", {"exclusive_gpu": True, "gpus": 2, "label": "lock"}, expect=201)
    assert held_back["state"] == "queued" and held_back["reason"]
    leases = await call("GET", "leases", expect=200)
    assert [lease["id"] for lease in leases["leases"]] == [granted["id"], held_back["id"]]
    await call("POST", "leases", {"vram_mb": 100, "label": "a third"}, expect=409)  # max_leases
    await call("GET", f"leases/{granted['id']}", expect=200)
    assert (await call("GET", "ledger", expect=200))["devices"]
    await call("GET", "queue", expect=200)
    for lease in (held_back, granted):
        await call("DELETE", f"leases/{lease['id']}", expect=204)
    assert (await call("GET", f"leases/{granted['id']}", expect=200))["state"] == "ended"
    await call("DELETE", f"leases/{granted['id']}", expect=204)  # idempotent

    # --- cancel, resume, delete, and the state conflicts
    assert (await call("POST", f"runs/{waiting['id']}/cancel", expect=200))["state"] == "cancelled"
    await call("POST", f"runs/{running['id']}/cancel", expect=200)
    await settle(call, running["id"], ("cancelled",))
    await call("POST", f"runs/{done['id']}/cancel", expect=409)
    await call("POST", f"runs/{done['id']}/resume", expect=409)
    await call("DELETE", f"runs/{done['id']}", expect=204)
    resumed = await call("POST", f"runs/{crash['id']}/resume", expect=200)
    assert resumed["state"] == "queued" and resumed["attempt"] == 2
    await settle(call, crash["id"], ("failed",))
    assert (await call("GET", f"runs/{crash['id']}", expect=200))["history"]
    second = await call("POST", "runs", spec(SLEEPY, episodes=100, sleep_s=0.2, name="to-delete"), expect=201)
    await call("DELETE", f"runs/{second['id']}", expect=409)
    await call("POST", f"runs/{second['id']}/cancel", expect=200)

    # --- a sweep and comparisons
    body = spec(NOOP, episodes=2, name="grid")
    body["sweep"] = {"k": [1, 2]}
    sweep = await call("POST", "sweeps", body, expect=201)
    assert len(sweep["runs"]) == 2 and all(r["sweep_id"] == sweep["id"] for r in sweep["runs"])
    for run in sweep["runs"]:
        await settle(call, run["id"], ("succeeded",))
    view = await call("GET", f"sweeps/{sweep['id']}", expect=200)
    assert view["counts"] == {"succeeded": 2}
    assert (await call("GET", "sweeps", params={"limit": "5"}, expect=200))["sweeps"][0]["id"] == sweep["id"]
    compared = await call("GET", "compare", params={"sweep": sweep["id"]}, expect=200)
    assert compared["params"] == ["k"] and len(compared["rows"]) == 2
    ids = ",".join([sweep["runs"][1]["id"], first["id"]])
    await call("GET", "compare", params={"runs": ids, "baseline": first["id"]}, expect=200)
    await call("POST", f"sweeps/{sweep['id']}/cancel", expect=200)
    key = {"Idempotency-Key": "answers-through-types-2"}
    replay = await call("POST", "sweeps", body, headers=key, expect=201)
    assert (await call("POST", "sweeps", body, headers=key, expect=200))["id"] == replay["id"]

    # --- shared models
    models = await call("GET", "models", expect=200)
    assert [m["name"] for m in models["models"]] == ["upper"]
    connected = await call("POST", "models/upper/connect", expect=200)
    assert connected["name"] == "upper" and connected["url"]
    assert (await call("GET", "models", expect=200))["models"][0]["pid"]  # its host was started

    # --- the OpenAI-compatible routes, with a model that is not a language model (their 200s from
    # real ones: the test below)
    assert (await call("GET", "v1/models", expect=200))["data"][0]["id"] == "upper"
    assert (await call("GET", "v1/models/upper", expect=200))["id"] == "upper"
    await call("GET", "v1/models/nope", expect=404)
    await call("POST", "v1/completions", {"model": "upper", "prompt": "x"}, expect=400)
    await call("POST", "v1/completions", {"model": "nope", "prompt": "x"}, expect=404)
    await call("POST", "v1/completions", "{not json", expect=400)
    await call("POST", "v1/completions", b" " * (17 << 20), expect=413)
    await call("POST", "v1/chat/completions", {"model": "upper", "messages": [{"role": "user"}]}, expect=400)
    await call("POST", "v1/chat/completions", {"model": "upper", "messages": []}, expect=400)
    await call("POST", "v1/embeddings", {"model": "upper", "input": "x"}, expect=400)
    await call("POST", "v1/embeddings", {"model": "upper", "input": 3}, expect=400)

    # --- what this server says of itself
    assert (await call("GET", "status", expect=200))["role"] == "primary"
    assert (await call("GET", "doctor", expect=200))["checks"]
    assert (await call("GET", "openapi.json", expect=200))["paths"]

    # --- the errors a client can cause
    await call("POST", "runs", "{not json", expect=400)
    await call("POST", "runs", {"entrypoint": "x:y", "episodes": "3"}, expect=422)
    await call("POST", "runs", spec(NOOP, scheduling={"gpus": 3, "marginal_vram_mb": 1}), expect=422)
    await call("POST", "runs", spec(NOOP, models=["nope"]), expect=422)
    await call("POST", "runs", b"[" * 10 + b"]" * 10, expect=422)
    await call("POST", "runs", b" " * (5 * 1024 * 1024), expect=413)
    await call("GET", "runs", params={"state": "sleeping"}, expect=400)
    await call("GET", "runs", params={"limit": "0"}, expect=400)
    await call("GET", "runs/20261203T000000.000000-nope", expect=404)
    await call("GET", "runs/..%2Fetc", expect=404)
    await call("DELETE", "runs/20261203T000000.000000-nope", expect=404)
    await call("POST", "runs/20261203T000000.000000-nope/cancel", expect=404)
    await call("POST", "runs/20261203T000000.000000-nope/resume", expect=404)
    await call("GET", "runs/20261203T000000.000000-nope/logs", expect=404)
    await call("GET", f"runs/{first['id']}/logs", params={"stream": "stdin"}, expect=400)
    await call("GET", "runs/20261203T000000.000000-nope/episodes", expect=404)
    await call("POST", "sweeps", {**spec(NOOP), "sweep": {}}, expect=422)
    await call("POST", "sweeps", "]", expect=400)
    await call("GET", "sweeps", params={"limit": "x"}, expect=400)
    await call("GET", "sweeps/sweep-nope", expect=404)
    await call("POST", "sweeps/sweep-nope/cancel", expect=404)
    await call("GET", "compare", expect=422)
    await call("GET", "compare", params={"runs": "20261203T000000.000000-nope"}, expect=404)
    await call("GET", "compare", params={"runs": first["id"], "baseline": crash["id"]}, expect=422)
    # The comparison's limits (#30): too many at once, past its time, too many values.
    from jupyter_evalsched.scheduler import compare as compare_module

    for limit, value, status in (
        ("MAX_CONCURRENT_COMPARES", 0, 429),
        ("COMPARE_TIMEOUT_S", -1.0, 503),
        ("MAX_COMPARE_VALUES", -1, 413),
    ):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compare_module, limit, value)
            await call("GET", "compare", params={"runs": first["id"]}, expect=status)
    await call("POST", "leases", {"vram_mb": 0}, expect=422)
    await call("POST", "leases", {"vram_mb": 100000}, expect=422)
    await call("POST", "leases", {"vram_mb": 100, "pid": 1}, expect=422)
    await call("POST", "leases", "nope", expect=400)
    await call("GET", "leases/lease-nope", expect=404)
    await call("DELETE", "leases/lease-nope", expect=404)
    await call("POST", "models/nope/connect", expect=404)
    await call("GET", "events", expect=400)  # not a WebSocket upgrade
    for method, path in (("GET", "queue"), ("POST", "runs"), ("DELETE", f"runs/{first['id']}"), ("GET", "v1/models")):
        await call(method, path, headers={"Authorization": "token not-the-token"}, expect=403)

    # --- run files that cannot be served (user code wrote them): 409, never a 500
    (runs_dir / first["id"] / "episodes.jsonl").unlink()
    (runs_dir / first["id"] / "episodes.jsonl").symlink_to("/etc/hostname")
    (runs_dir / first["id"] / "stdout.log").unlink()
    (runs_dir / first["id"] / "stdout.log").symlink_to("/etc/hostname")
    await call("GET", f"runs/{first['id']}/episodes", expect=409)
    await call("GET", f"runs/{first['id']}/logs", expect=409)
    assert (await call("GET", "compare", params={"runs": first["id"]}, expect=200))["rows"][0]["error"]

    # --- the event socket said what happened, in the same types
    kinds = {"run": "RunRecord", "lease": "LeaseRecord", "ledger": "Ledger"}
    seen: set[str] = set()
    while True:
        try:
            text = await asyncio.wait_for(socket.read_message(), 0.5)
        except TimeoutError:
            break
        message = json.loads(text)
        kind = message["type"]
        seen.add(kind)
        if kind in kinds:
            errors = checker.schema_errors(checker.component(kinds[kind]), message[kind])
            assert not errors, f"a {kind} event does not match {kinds[kind]}: {errors[:10]}"
        else:
            assert kind == "warning" and {"run_id", "code", "message"} <= set(message), message
    socket.close()
    assert {"run", "lease"} <= seen

    # --- every operation of the document was exercised
    missing = sorted(checker.operations() - set(checker.exercised))
    assert not missing, f"operations of the OpenAPI document never exercised: {missing}"


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
async def test_the_v1_routes_answer_as_the_openapi_document_says(call, contract_checker, tiny_lm_dir, tiny_bert_dir):
    """The 200s of the OpenAI-compatible routes, from real models, in every shape they take."""
    lm = {"model": "lm", "temperature": 0}
    await call("POST", "v1/completions", {**lm, "prompt": "The cat", "max_tokens": 4}, expect=200)
    scored = await call(
        "POST", "v1/completions", {**lm, "prompt": ["The cat", "A"], "max_tokens": 0, "echo": True, "logprobs": 2},
        expect=200,
    )  # fmt: skip
    assert scored["choices"][0]["logprobs"]["token_logprobs"][0] is None
    await call("POST", "v1/completions", {**lm, "prompt": [[5, 6, 7]], "max_tokens": 3, "logprobs": 1}, expect=200)
    text = await call(
        "POST", "v1/completions", {**lm, "prompt": "The cat", "max_tokens": 3, "stream": True}, expect=200
    )
    assert text.startswith("data: ") and text.endswith("data: [DONE]\n\n")
    messages = [{"role": "user", "content": "Hi"}]
    chat = await call(
        "POST", "v1/chat/completions", {**lm, "messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
        expect=200,
    )  # fmt: skip
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    await call("POST", "v1/chat/completions", {**lm, "messages": messages, "max_tokens": 2}, expect=200)
    await call("POST", "v1/chat/completions", {**lm, "messages": messages, "max_tokens": 2, "stream": True}, expect=200)
    await call("POST", "v1/embeddings", {"model": "embed", "input": ["the cat", "a dog"]}, expect=200)
    await call("POST", "v1/embeddings", {"model": "embed", "input": "x", "encoding_format": "base64"}, expect=200)
    await call("POST", "v1/completions", {**lm, "prompt": "the cat " * 400}, expect=400)  # longer than its context
    await call("POST", "v1/embeddings", {"model": "lm", "input": "x"}, expect=400)
    assert [m["id"] for m in (await call("GET", "v1/models", expect=200))["data"]] == ["upper", "lm", "embed"]
    assert (await call("GET", "v1/models/lm", expect=200))["id"] == "lm"
    v1 = {(m, t) for m, t in contract_checker.operations() if t.startswith("/v1/")}
    assert len(v1) == 5 and v1 <= set(contract_checker.exercised)


def test_the_checker_refuses_an_answer_its_model_does_not_describe(contract_checker):
    """The test above can fail: a wrong type, a missing required field and an undeclared field
    are each refused."""
    checker = contract_checker
    record = {"id": "r", "name": "n", "state": "queued", "submitted_at": "2026-12-03T00:00:00.000000+00:00"}
    schema = checker.component("RunRecord")
    assert checker.schema_errors(schema, record) == []
    assert checker.schema_errors(schema, {**record, "exit_code": "3"})
    assert checker.schema_errors(schema, {**record, "state": "sleeping"})
    assert checker.schema_errors(schema, {k: v for k, v in record.items() if k != "submitted_at"})
    assert checker.schema_errors(schema, {**record, "undeclared": 1})
    assert checker.schema_errors(checker.component("QueueView"), {"queued": [{**record, "pid": "x"}], "running": []})
    with pytest.raises(AssertionError, match="declares only"):
        checker.check("GET", "/runs", 418, "application/json", "{}")
    with pytest.raises(AssertionError, match="does not match its schema"):
        checker.check("GET", "/runs", 200, "application/json", '{"runs": [], "total": "0"}')
    with pytest.raises(AssertionError, match="Content-Type"):
        checker.check("GET", "/runs", 200, "text/plain", '{"runs": [], "total": 0}')
    with pytest.raises(ValidationError):
        checker.validator(schema).validate({**record, "priority": "urgent"})


@pytest.mark.parametrize("template", ["/runs/{run_id}/logs", "/events"])
async def test_content_types_that_apihandler_would_override(template, jp_fetch, evalsched):
    """Two answers that jupyter_server or tornado would give another content type: logs are
    text/plain (APIHandler.finish defaults to JSON) and a plain GET of the event socket is a JSON
    400 (tornado answers HTML)."""
    if template == "/runs/{run_id}/logs":
        resp = await jp_fetch("evalsched", "runs", method="POST", body=json.dumps(spec(NOOP)))
        resp = await jp_fetch("evalsched", "runs", json.loads(resp.body)["id"], "logs")
        assert resp.headers["Content-Type"].startswith("text/plain")
    else:
        assert template == "/events", template
        resp = await jp_fetch("evalsched", "events", raise_error=False)
        assert resp.code == 400 and resp.headers["Content-Type"].startswith("application/json")
