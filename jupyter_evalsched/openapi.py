"""The OpenAPI 3 document of the REST API, built from the pydantic models so it cannot drift."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic.json_schema import models_json_schema

from ._version import __version__
from .contract import CANCELLED_BY, LOG_OFFSET_HEADER, LOG_SIZE_HEADER, MAX_JSON_SAFE_INT
from .schemas import (
    STATES,
    Comparison,
    DoctorReport,
    EpisodeList,
    ErrorBody,
    EvalSpec,
    LeaseList,
    LeaseRecord,
    LeaseRequest,
    Ledger,
    ModelConnection,
    ModelList,
    QueueView,
    RunCancelAnswer,
    RunDetail,
    RunList,
    RunRecord,
    ServerStatus,
    SweepCancelAnswer,
    SweepCreated,
    SweepList,
    SweepRequest,
    SweepView,
)

_MODELS = (
    EvalSpec,
    RunRecord,
    RunDetail,
    RunCancelAnswer,
    RunList,
    QueueView,
    Ledger,
    EpisodeList,
    ModelList,
    ErrorBody,
    LeaseRequest,
    LeaseRecord,
    LeaseList,
    SweepRequest,
    SweepCreated,
    SweepView,
    SweepCancelAnswer,
    SweepList,
    Comparison,
    ModelConnection,
    DoctorReport,
    ServerStatus,
)
_REQUESTS = (EvalSpec, LeaseRequest, SweepRequest)  # schemas of what clients send, the rest of what they get


@lru_cache(maxsize=1)
def _components() -> dict[str, Any]:
    _, schema = models_json_schema(
        [(m, "validation" if m in _REQUESTS else "serialization") for m in _MODELS],
        ref_template="#/components/schemas/{model}",
    )
    return schema.get("$defs", {})


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*codes: int, delegated: bool = True) -> dict:
    """The error answers of a route: 401, 403 and ``codes``, and 503 for every route a server
    forwards to the host's primary (``delegated``: all but /status and the event socket), which
    answers 503 while the scheduler starts or when the primary cannot be reached."""
    text = {
        400: "the request is malformed (not JSON, a bad query parameter)",
        401: "not authenticated",
        403: "not authorized",
        404: "unknown run, lease or model",
        409: "the operation does not fit the run's state, the run's files cannot be served, or the server holds "
        "max_leases live leases already",
        413: "the body is too large, or a comparison would read more episode values than it may",
        422: "the spec or request is invalid, can never fit, names an unknown model, dependency or process",
        429: "too many sweep submissions or comparisons are under way at once: retry after Retry-After seconds",
        500: "a bug of the server's own (the message says no more; the server's log has the traceback): not "
        "worth retrying",
        503: "the scheduler is starting, the host's primary server cannot be reached, the runs directory cannot "
        "be written, a model host cannot start, or a comparison ran past its time limit",
    }
    wanted = {401, 403, *codes} | ({503} if delegated else set())
    return {str(c): _json("ErrorBody", text[c]) for c in sorted(wanted)}


# -- the OpenAI-compatible routes (/v1): OpenAI's shapes, written out (no pydantic model: they are
# OpenAI's, as its clients read them) --------------------------------------------------------

_NULLABLE_STR = {"type": ["string", "null"]}
_V1_SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code", "param"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": _NULLABLE_STR,
                    "param": _NULLABLE_STR,
                },
            }
        },
    },
    "OpenAIUsage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
        },
    },
    "OpenAIModel": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "OpenAIModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("OpenAIModel")},
        },
    },
    "LegacyLogprobs": {
        "type": "object",
        "description": "one entry per token: the echoed prompt's, then the generated ones",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": {
                "type": "array",
                "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
            },
            "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "text": {"type": "string"},
                        "logprobs": {"anyOf": [{"$ref": "#/components/schemas/LegacyLogprobs"}, {"type": "null"}]},
                        "finish_reason": {"enum": ["stop", "length"]},
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/OpenAIUsage"},
        },
    },
    "ChatTokenLogprob": {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
            "top_logprobs": {"type": "array", "items": {"$ref": "#/components/schemas/ChatTokenLogprob"}},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                        },
                        "logprobs": {
                            "anyOf": [
                                {
                                    "type": "object",
                                    "required": ["content"],
                                    "properties": {
                                        "content": {
                                            "type": "array",
                                            "items": {"$ref": "#/components/schemas/ChatTokenLogprob"},
                                        }
                                    },
                                },
                                {"type": "null"},
                            ]
                        },
                        "finish_reason": {"enum": ["stop", "length"]},
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/OpenAIUsage"},
        },
    },
    "EmbeddingList": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "embedding", "index"],
                    "properties": {
                        "object": {"const": "embedding"},
                        "embedding": {
                            "description": "floats, or base64 of little-endian float32 (encoding_format base64)",
                            "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
                        },
                        "index": {"type": "integer", "minimum": 0},
                    },
                },
            },
            "model": {"type": "string"},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0},
                },
            },
        },
    },
}
# What clients send (documentation: the server checks bodies itself, answering a 400 that names
# the field; see docs/reference.md, "OpenAI-compatible API").
_V1_REQUESTS: dict[str, Any] = {
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {
                "description": "a string, a list of strings, token ids, or a list of token id lists",
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    {"type": "array", "items": {"type": "integer"}},
                    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                ],
            },
            "max_tokens": {"type": "integer", "minimum": 0, "default": 16},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
            "seed": {"type": "integer"},
            "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
            "echo": {"type": "boolean", "default": False},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
            "stream": {"type": "boolean", "default": False},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role"],
                    "properties": {"role": {"type": "string"}, "content": {}},
                },
            },
            "max_tokens": {"type": "integer", "minimum": 0},
            "max_completion_tokens": {"type": "integer", "minimum": 0},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
            "seed": {"type": "integer"},
            "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
            "logprobs": {"type": "boolean", "default": False},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "stream": {"type": "boolean", "default": False},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string"},
            "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
            "encoding_format": {"enum": ["float", "base64"], "default": "float"},
        },
    },
}


def _v1_errors(*codes: int) -> dict:
    """The error answers of a /v1 route, in OpenAI's shape."""
    text = {
        400: "the body is not JSON or not an object, a field is unknown, missing, of the wrong type or out of range, "
        "or the model cannot serve the request (param names the field)",
        403: "not authenticated or not authorized",
        404: "the model is not a configured shared model, or not one a run's key may use: its spec's models "
        "(code model_not_found)",
        413: "the body is over 16 MiB",
        502: "the model raised while computing the request (code model_error)",
        503: "the model's host cannot start, failed to load the model or died (code model_unavailable), "
        "or the scheduler is starting",
    }
    return {
        str(c): {"description": text[c], "content": {"application/json": {"schema": _ref("OpenAIError")}}}
        for c in sorted({403, 503, *codes})
    }


def _v1_post(summary: str, operation: str, request: str, answer: str, description: str, stream: bool) -> dict:
    content: dict[str, Any] = {"application/json": {"schema": _ref(answer)}}
    if stream:
        # Server-sent events: `data: <chunk JSON>` per chunk, then `data: [DONE]`.
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "operationId": operation,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": description, "content": content}, **_v1_errors(400, 404, 413, 502)},
        }
    }


_V1_PATHS: dict[str, Any] = {
    "/v1/models": {
        "get": {
            "summary": "OpenAI-compatible: the shared models",
            "operationId": "openaiListModels",
            "responses": {
                "200": _json("OpenAIModelList", "every configured shared model (for a run's key: its spec's models)"),
                **_v1_errors(),
            },
        }
    },
    "/v1/models/{model}": {
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "get": {
            "summary": "OpenAI-compatible: one shared model",
            "operationId": "openaiRetrieveModel",
            "responses": {"200": _json("OpenAIModel", "the model"), **_v1_errors(404)},
        },
    },
    "/v1/completions": _v1_post(
        "OpenAI-compatible: complete or score prompts",
        "openaiCompletions",
        "CompletionRequest",
        "Completion",
        "one choice per prompt; with stream, text_completion chunks as server-sent events",
        True,
    ),
    "/v1/chat/completions": _v1_post(
        "OpenAI-compatible: chat through the model's chat template",
        "openaiChatCompletions",
        "ChatCompletionRequest",
        "ChatCompletion",
        "the assistant's message; with stream, chat.completion.chunk objects as server-sent events",
        True,
    ),
    "/v1/embeddings": _v1_post(
        "OpenAI-compatible: embeddings",
        "openaiEmbeddings",
        "EmbeddingRequest",
        "EmbeddingList",
        "one vector per input",
        False,
    ),
}


RUN_ID_PARAM = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
}


SWEEP_ID_PARAM = {
    "name": "sweep_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^sweep-[A-Za-z0-9._-]{1,58}$"},
}
IDEMPOTENCY_KEY_PARAM = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "the same key again answers 200 with what the first submission made (also after a restart); "
    "the same key with another body is a 409",
    "schema": {"type": "string", "pattern": "^[!-~]{1,200}$"},
}
CANCELLED_BY_PARAM = {
    "name": "by",
    "in": "query",
    "required": False,
    "description": "who cancels, for the run's reason ('cancelled from the Lab panel'); without it, "
    "'cancelled through the API'",
    "schema": {"type": "string", "enum": list(CANCELLED_BY)},
}
QUEUE_LIMIT_PARAM = {
    "name": "limit",
    "in": "query",
    "required": False,
    "description": "list the first `limit` queued runs only (`queued_total` counts them all); without it, all",
    "schema": {"type": "integer", "minimum": 0, "maximum": 100000},
}
LEASE_ID_PARAM = {
    "name": "lease_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
}


@lru_cache(maxsize=4)
def openapi_document(base_url: str = "/") -> dict[str, Any]:
    prefix = base_url.rstrip("/") + "/evalsched"
    paths = {
        "/runs": {
            "get": {
                "summary": "List runs, newest first",
                "operationId": "listRuns",
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "required": False,
                        "description": "comma-separated states: " + ", ".join(STATES),
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100000, "default": 100},
                    },
                ],
                "responses": {"200": _json("RunList", "the runs"), **_errors(400)},
            },
            "post": {
                "summary": "Submit a run",
                "operationId": "submitRun",
                "parameters": [IDEMPOTENCY_KEY_PARAM],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("EvalSpec")}}},
                "responses": {
                    "201": _json("RunRecord", "the queued run"),
                    "200": _json("RunRecord", "the run an earlier submission with the same Idempotency-Key made"),
                    **_errors(400, 409, 413, 422, 500, 503),
                },
            },
        },
        "/runs/{run_id}": {
            "parameters": [RUN_ID_PARAM],
            "get": {
                "summary": "One run with its summary",
                "operationId": "getRun",
                "responses": {"200": _json("RunDetail", "the run"), **_errors(404, 409)},
            },
            "delete": {
                "summary": "Delete a finished run's directory",
                "operationId": "deleteRun",
                "responses": {"204": {"description": "deleted"}, **_errors(404, 409, 503)},
            },
        },
        "/runs/{run_id}/cancel": {
            "parameters": [RUN_ID_PARAM],
            "post": {
                "summary": "Cancel a queued or running run",
                "operationId": "cancelRun",
                "parameters": [CANCELLED_BY_PARAM],
                "responses": {
                    "200": _json("RunCancelAnswer", "the run, and whether its cancel is still under way"),
                    **_errors(400, 404, 409),
                },
            },
        },
        "/runs/{run_id}/resume": {
            "parameters": [RUN_ID_PARAM],
            "post": {
                "summary": "Queue a failed, aborted or cancelled run again (same id, attempt + 1); it skips the "
                "episodes already in episodes.jsonl",
                "operationId": "resumeRun",
                "responses": {"200": _json("RunRecord", "the run, queued"), **_errors(404, 409, 503)},
            },
        },
        "/sweeps": {
            "get": {
                "summary": "List sweeps, newest first",
                "operationId": "listSweeps",
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100000, "default": 100},
                    }
                ],
                "responses": {"200": _json("SweepList", "the sweeps"), **_errors(400)},
            },
            "post": {
                "summary": "Submit a sweep: one run per point of a grid or a list",
                "operationId": "submitSweep",
                "parameters": [IDEMPOTENCY_KEY_PARAM],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("SweepRequest")}}},
                "responses": {
                    "201": _json("SweepCreated", "the queued runs"),
                    "200": _json("SweepCreated", "the runs an earlier submission with the same Idempotency-Key made"),
                    **_errors(400, 409, 413, 422, 429, 500, 503),
                },
            },
        },
        "/sweeps/{sweep_id}": {
            "parameters": [SWEEP_ID_PARAM],
            "get": {
                "summary": "A sweep's runs and their states",
                "operationId": "getSweep",
                "responses": {"200": _json("SweepView", "the sweep"), **_errors(404)},
            },
        },
        "/sweeps/{sweep_id}/cancel": {
            "parameters": [SWEEP_ID_PARAM],
            "post": {
                "summary": "Cancel a sweep's unfinished runs (finished ones stay)",
                "operationId": "cancelSweep",
                "parameters": [CANCELLED_BY_PARAM],
                "responses": {
                    "200": _json("SweepCancelAnswer", "the sweep, and which of its runs are still ending"),
                    **_errors(400, 404),
                },
            },
        },
        "/compare": {
            "get": {
                "summary": "Runs side by side: metrics with standard errors, paired deltas against a baseline",
                "operationId": "compareRuns",
                "parameters": [
                    {
                        "name": "runs",
                        "in": "query",
                        "required": False,
                        "description": "comma-separated run ids (or sweep)",
                        "schema": {"type": "string"},
                    },
                    {"name": "sweep", "in": "query", "required": False, "schema": {"type": "string"}},
                    {
                        "name": "baseline",
                        "in": "query",
                        "required": False,
                        "description": "the run the deltas are against (default: the first)",
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {"200": _json("Comparison", "the comparison"), **_errors(404, 409, 413, 422, 429, 503)},
            },
        },
        "/runs/{run_id}/logs": {
            "parameters": [RUN_ID_PARAM],
            "get": {
                "summary": "The run's stdout or stderr",
                "operationId": "getLogs",
                "parameters": [
                    {
                        "name": "stream",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["stdout", "stderr"]},
                    },
                    {
                        "name": "tail",
                        "in": "query",
                        "required": False,
                        "description": "the last N lines (not with offset)",
                        "schema": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    },
                    {
                        "name": "offset",
                        "in": "query",
                        "required": False,
                        "description": "the bytes from this byte offset on, at most 8 MiB (not with tail); "
                        "none when the log is shorter",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_JSON_SAFE_INT},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "the log's bytes as written (a part may start or end within a UTF-8 "
                        "character); X-Evalsched-Log-Offset: where the next read starts, X-Evalsched-Log-Size: "
                        "the log's size",
                        "headers": {
                            LOG_OFFSET_HEADER: {
                                "description": "the byte offset just past the body: where the next read starts",
                                "schema": {"type": "integer", "minimum": 0},
                            },
                            LOG_SIZE_HEADER: {
                                "description": "the log's size in bytes when read; under the offset asked for, "
                                "the log was rewritten: read it again from 0",
                                "schema": {"type": "integer", "minimum": 0},
                            },
                        },
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(400, 404, 409),
                },
            },
        },
        "/runs/{run_id}/episodes": {
            "parameters": [RUN_ID_PARAM],
            "get": {
                "summary": "A page of the run's finished episodes (the lines of episodes.jsonl)",
                "description": "With offset or limit, a page; with neither, every episode (a 413 when "
                "they are over one page's 16 MiB of lines or 32 MiB of JSON: then ask page by page)",
                "operationId": "getEpisodes",
                "parameters": [
                    {
                        "name": "offset",
                        "in": "query",
                        "required": False,
                        "description": "the complete lines of episodes.jsonl to pass over (default 0): "
                        "a page's next_offset",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_JSON_SAFE_INT},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "description": "the lines this page reads at most (default 1000); a page also ends "
                        "before 16 MiB of the file's lines (bytes as on disk) or 32 MiB of its episodes' JSON",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100000},
                    },
                ],
                "responses": {
                    "200": _json("EpisodeList", "a page of the episodes (all of them, without offset and limit)"),
                    **_errors(400, 404, 409),
                    "413": _json(
                        "ErrorBody",
                        "without offset and limit: the episodes are over 16 MiB of lines or 32 MiB of JSON; the "
                        "message says how "
                        "to ask for them page by page",
                    ),
                },
            },
        },
        "/leases": {
            "get": {
                "summary": "Live leases (granted, then queued in admission order)",
                "operationId": "listLeases",
                "responses": {"200": _json("LeaseList", "the leases"), **_errors()},
            },
            "post": {
                "summary": "Ask for VRAM for interactive work (admitted like a run; default lane high)",
                "operationId": "requestLease",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("LeaseRequest")}},
                },
                "responses": {
                    "201": _json("LeaseRecord", "the lease, granted or queued"),
                    **_errors(400, 409, 413, 422, 503),
                },
            },
        },
        "/leases/{lease_id}": {
            "parameters": [LEASE_ID_PARAM],
            "get": {
                "summary": "One lease (also after it ended)",
                "operationId": "getLease",
                "responses": {"200": _json("LeaseRecord", "the lease"), **_errors(404)},
            },
            "delete": {
                "summary": "Release a lease (it ends with reason released; idempotent)",
                "operationId": "releaseLease",
                "responses": {"204": {"description": "released"}, **_errors(404)},
            },
        },
        "/queue": {
            "get": {
                "summary": "Queued runs in admission order, running runs, the ledger",
                "operationId": "getQueue",
                "parameters": [QUEUE_LIMIT_PARAM],
                "responses": {"200": _json("QueueView", "the queue"), **_errors(400)},
            }
        },
        "/ledger": {
            "get": {
                "summary": "The per-GPU VRAM ledger and CPU slots",
                "operationId": "getLedger",
                "responses": {"200": _json("Ledger", "the ledger"), **_errors()},
            }
        },
        "/models": {
            "get": {
                "summary": "Shared models",
                "operationId": "getModels",
                "responses": {"200": _json("ModelList", "the models"), **_errors()},
            }
        },
        "/models/{name}/connect": {
            "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
            ],
            "post": {
                "summary": "Where a kernel reaches a shared model (its host started if needed)",
                "operationId": "connectModel",
                "responses": {
                    "200": _json("ModelConnection", "the model's URL, as runs get it in shared_urls.json"),
                    **_errors(404, 503),
                },
            },
        },
        "/doctor": {
            "get": {
                "summary": "What this host offers and what is in force, each check ok, degraded or error",
                "operationId": "doctor",
                "responses": {"200": _json("DoctorReport", "the checks"), **_errors()},
            }
        },
        "/status": {
            "get": {
                "summary": "Version, runs directory and counts",
                "operationId": "getStatus",
                "responses": {
                    "200": _json("ServerStatus", "this server's role and state"),
                    **_errors(delegated=False),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "getOpenAPI",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_errors(),
                },
            }
        },
        "/events": {
            "get": {
                "summary": "WebSocket: a snapshot, then one message per change ({type: run|lease|warning|ledger})",
                "operationId": "events",
                "parameters": [QUEUE_LIMIT_PARAM],
                "description": 'JSON text messages, server to client: first `{"type": "snapshot", "queue": '
                'QueueView}`, then `{"type": "run", "run": RunRecord}` at every change of a run (and at '
                'progress), `{"type": "lease", "lease": LeaseRecord}` at every change of a lease, '
                '`{"type": "warning", "run_id", "code", "message"}` for a new warning on a run, and '
                '`{"type": "ledger", "ledger": Ledger}` when VRAM outside the scheduler changed.',
                "responses": {
                    "101": {"description": "switching to the WebSocket protocol"},
                    **_errors(400, delegated=False),
                },
            }
        },
        **_V1_PATHS,
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "jupyter_evalsched",
            "version": __version__,
            "description": "The per-host evaluation scheduler of this Jupyter server. Authenticate as for any Jupyter API (Authorization: token ...). The /v1 routes are OpenAI's API for the shared models (Authorization: Bearer <token> works too).",
        },
        "servers": [{"url": prefix}],
        "components": {
            "schemas": {**_components(), **_V1_SCHEMAS, **_V1_REQUESTS},
            "securitySchemes": {"token": {"type": "apiKey", "in": "header", "name": "Authorization"}},
        },
        "security": [{"token": []}],
        "paths": paths,
    }
