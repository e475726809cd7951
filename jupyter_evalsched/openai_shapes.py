"""OpenAI's request and response shapes for ``/evalsched/v1``: validation and formatting only.

Pure functions, no I/O: ``parse_completion``, ``parse_chat`` and ``parse_embeddings`` turn a JSON
body into the requests the model host's ``openai_batch`` takes (one per prompt), or raise
``OpenAIError`` (a 400 naming the field); ``completion_body``, ``chat_body`` and the ``*_chunks``
functions turn the host's answers back into OpenAI's JSON. The host's answer per prompt is
``{"prompt_text", "text", "pieces", "finish_reason", "prompt_tokens", "completion_tokens",
"logprobs": [{"token", "logprob", "top": [(token, logprob)] | None, "offset"}] | None}``.
"""

from __future__ import annotations

import base64
import re
import struct
import time
import uuid
from typing import Any

MAX_LOGPROBS = 5  # the legacy completions API's limit
MAX_TOP_LOGPROBS = 20  # chat's
MAX_STOP = 16  # OpenAI allows 4; lm-eval sends a task's `until` strings and the end-of-text one
# A stop string is a few words; each costs its length once per request on the batcher thread
# that every caller shares (its matcher, ``shared_models.stops``), and a little per token after.
MAX_STOP_CHARS = 1000
MAX_PROMPTS = 2048

# Fields OpenAI's clients send that change nothing here when they hold their default (or any
# value, for the bookkeeping ones); anything else is refused by name, as OpenAI does.
_IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls", "prompt_cache_key"}
_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "suffix": None,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "functions": [],
    "function_call": "none",
}
# The type of those of them that are numbers: their value is checked before it is compared with the
# default (JSON's true equals 1 in Python: `n: true` would read as `n: 1`).
_DEFAULT_INTEGERS = {"n", "best_of"}
_DEFAULT_NUMBERS = {"frequency_penalty", "presence_penalty"}
_COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "echo",
    "logprobs",
    "stream",
}
_CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "logprobs", "top_logprobs", "stream",
}  # fmt: skip
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions"}


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        final: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        # The same request gets the same answer (a model's output that cannot be sent): told to
        # OpenAI's clients, which otherwise retry any 5xx twice, computing it three times.
        self.final = final

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, type="invalid_request_error", code="invalid_request_error", param=param)


def model_not_found(name: str, known: list[str]) -> OpenAIError:
    listed = ", ".join(known) or "none are configured"
    return OpenAIError(
        404,
        f"the model {name!r} does not exist on this server (shared models: {listed})",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


# -- field checks ------------------------------------------------------------------------------


def _check_text(body: dict) -> None:
    """Every string of the body (keys too) must be Unicode text: JSON's escapes can spell a lone
    surrogate (``"\\ud800"``), which no tokenizer takes. Iterative: a body nested as deep as the
    JSON parser allows must not exhaust the stack here."""
    for key, value in body.items():
        pending = [key, value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise invalid(f"{key} holds a string that is not valid Unicode (a lone surrogate)", key) from None
            elif isinstance(item, list):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())


def _check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _check_text(body)
    for key, value in body.items():
        if key in allowed or key in _IGNORED:
            continue
        if key in _DEFAULTS:
            if value is None:
                continue
            if key in _DEFAULT_INTEGERS and not _is_int(value):
                raise invalid(f"{key} must be an integer", key)
            if key in _DEFAULT_NUMBERS and not _is_number(value):
                raise invalid(f"{key} must be a number", key)
            if value == _DEFAULTS[key]:
                continue
            if key == "n":
                raise invalid("n must be 1: this server returns one choice per prompt", "n")
            raise invalid(f"{key}={value!r} is not supported by this server", key)
        raise invalid(f"unrecognized request argument supplied: {key}", key)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("'model' is required: the name of a shared model (GET /evalsched/v1/models)", "model")
    return body


def _is_int(value: Any) -> bool:
    """An integer of JSON's: not a boolean (a bool is an int in Python), not a float (``1.0``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A number of JSON's, not a boolean, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _int(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(f"{key} must be an integer", key)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise invalid(f"{key} must be {bound}, got {value}", key)
    return value


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise invalid(f"{key} must be a number", key)
    if value > hi or value < lo or (open_lo and value == lo):
        raise invalid(f"{key} must be {'above' if open_lo else 'at least'} {lo:g} and at most {hi:g}, got {value}", key)
    return float(value)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{key} must be true or false", key)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} sequences", "stop")
    longest = max(stops, key=len, default="")  # (an empty list: no stop sequences)
    if len(longest) > MAX_STOP_CHARS:
        raise invalid(f"a stop sequence is at most {MAX_STOP_CHARS} characters long (one is {len(longest)})", "stop")
    return stops


def _sampling(body: dict) -> dict:
    return {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        "seed": _int(body, "seed", None, -(2**63), 2**63 - 1),
        "stop": _stop(body),
    }


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


# -- requests ----------------------------------------------------------------------------------


def parse_completion(body: Any) -> tuple[str, bool, list[dict]]:
    """``(model, stream, requests)`` of a ``/completions`` body: one engine request per prompt."""
    body = _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_tokens(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_tokens(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid("prompt must be a string, a list of strings, or token ids (a list, or a list of lists)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    common = {
        "max_tokens": _int(body, "max_tokens", 16, 0),
        "echo": _bool(body, "echo"),
        "logprobs": _int(body, "logprobs", None, 0, MAX_LOGPROBS),
        **_sampling(body),
    }
    return body["model"], _bool(body, "stream"), [{"prompt": p, **common} for p in prompts]


def _message(index: int, message: Any) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(f"{where} must be an object with a 'role'", where)
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": message["role"], "content": content}


def parse_chat(body: Any) -> tuple[str, bool, dict]:
    """``(model, stream, request)`` of a ``/chat/completions`` body."""
    body = _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    # Both checked (the one not used included): no limit given, as much as the context leaves
    # (the engine caps every request there).
    max_tokens = _int(body, "max_tokens", 1 << 30, 0)
    max_completion_tokens = _int(body, "max_completion_tokens", None, 0)
    request = {
        "messages": [_message(i, m) for i, m in enumerate(messages)],
        "max_tokens": max_completion_tokens if max_completion_tokens is not None else max_tokens,
        "echo": False,
        "logprobs": (top or 0) if logprobs else None,
        **_sampling(body),
    }
    return body["model"], _bool(body, "stream"), request


def parse_embeddings(body: Any) -> tuple[str, list[str], str]:
    """``(model, inputs, encoding_format)`` of an ``/embeddings`` body."""
    body = _check_fields(body, _EMBEDDING_FIELDS)
    value = body.get("input")
    inputs = [value] if isinstance(value, str) else value
    if not isinstance(inputs, list) or not inputs or not all(isinstance(text, str) for text in inputs):
        raise invalid("input must be a string or a non-empty list of strings", "input")
    if len(inputs) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} inputs per request", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid("encoding_format must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: the model's own size is returned", "dimensions")
    return body["model"], inputs, encoding


# -- responses ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(answers: list[dict]) -> dict:
    prompt = sum(a["prompt_tokens"] for a in answers)
    completion = sum(a["completion_tokens"] for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def legacy_logprobs(entries: list[dict] | None) -> dict | None:
    """The completions API's ``logprobs``: four parallel lists (the first prompt token's
    log-probability and alternatives are null: nothing comes before it)."""
    if entries is None:
        return None
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["top"] is None else dict(e["top"]) for e in entries],
        "text_offset": [e["offset"] for e in entries],
    }


def _completion_text(request: dict, answer: dict) -> str:
    return (answer["prompt_text"] + answer["text"]) if request.get("echo") else answer["text"]


def completion_body(model: str, requests: list[dict], answers: list[dict]) -> dict:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "text": _completion_text(request, answer),
                "logprobs": legacy_logprobs(answer["logprobs"]),
                "finish_reason": answer["finish_reason"],
            }
            for index, (request, answer) in enumerate(zip(requests, answers, strict=True))
        ],
        "usage": usage(answers),
    }


_PARTIAL_TOKEN = re.compile(r"bytes:((?:\\x[0-9a-f]{2})+)")


def _utf8(text: str) -> list[int]:
    """A token's bytes. A token that is part of a character is named ``bytes:\\xf8`` (as OpenAI
    names one): its bytes are those it stands for, which a client joins with the next token's to
    rebuild the character, not the name's."""
    partial = _PARTIAL_TOKEN.fullmatch(text)
    if partial is not None:
        return list(bytes.fromhex(partial.group(1).replace("\\x", "")))
    return list(text.encode("utf-8", "surrogatepass"))


def _is_number_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _well_formed_entry(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return False
    if not _is_number_or_none(entry.get("logprob")) or type(entry.get("offset")) is not int:
        return False
    top = entry.get("top")
    return top is None or (
        isinstance(top, list)
        and all(
            isinstance(t, list | tuple) and len(t) == 2 and isinstance(t[0], str) and _is_number_or_none(t[1])
            for t in top
        )
    )


def well_formed_answer(answer: object) -> bool:
    """Whether ``answer`` has the shape of the model host's answer to one completions or chat
    request, as every body and stream here reads it: a cached entry that does not (damaged, or
    written by something else) is a miss, never a 500."""
    if not isinstance(answer, dict):
        return False
    if not all(isinstance(answer.get(k), str) for k in ("text", "prompt_text")):
        return False
    if not all(type(answer.get(k)) is int and answer[k] >= 0 for k in ("prompt_tokens", "completion_tokens")):
        return False
    if not (answer.get("finish_reason") is None or isinstance(answer.get("finish_reason"), str)):
        return False
    pieces = answer.get("pieces")
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        return False
    entries = answer.get("logprobs")
    return entries is None or (isinstance(entries, list) and all(_well_formed_entry(e) for e in entries))


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """The chat API's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": _utf8(e["token"]),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": _utf8(t)} for t, v in (e["top"] or [])],
            }
            for e in entries
        ]
    }


def chat_body(model: str, answer: dict) -> dict:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer["text"]},
                "logprobs": chat_logprobs(answer["logprobs"]),
                "finish_reason": answer["finish_reason"],
            }
        ],
        "usage": usage([answer]),
    }


class ChunkWriter:
    """A stream's chunks, made as the parts of its answers arrive (formatting only, no I/O).

    ``start(index, head)`` when the host has the prompt (``{"prompt_text", "prompt_tokens",
    "logprobs"}``): a completion's echoed prompt, a chat's role delta; ``tokens(index, pieces,
    entries)`` for tokens whose text is final; ``finish(answers)`` once every answer is in: what
    was not sent yet (all of it for an answer that was not streamed, or came from the cache),
    one chunk with each choice's ``finish_reason``, and ``usage`` in a chunk of its own with no
    choices when the client asked for it (``stream_options.include_usage``), as OpenAI sends it."""

    def __init__(self, kind: str, model: str, requests: list[dict], include_usage: bool = False):
        self.chat = kind == "chat"
        self.model = model
        self.requests = requests
        self.include_usage = include_usage
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.started: set[int] = set()
        self.sent = [0] * len(requests)  # generated tokens sent, per choice

    def _chunk(self, index: int, content: str | dict, finish: str | None, entries: list[dict] | None) -> dict:
        if self.chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(entries), "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": content, "logprobs": legacy_logprobs(entries), "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def start(self, index: int, head: dict) -> list[dict]:
        if index in self.started:
            return []
        self.started.add(index)
        if self.chat:
            return [self._chunk(index, {"role": "assistant", "content": ""}, None, None)]
        if not self.requests[index].get("echo"):
            return []
        entries = head.get("logprobs")
        return [self._chunk(index, head["prompt_text"], None, entries[: head["prompt_tokens"]] if entries else entries)]

    def tokens(self, index: int, pieces: list[str], entries: list[dict] | None) -> list[dict]:
        chunks = []
        for position, piece in enumerate(pieces):
            chunks.append(self._chunk(index, piece, None, entries[position : position + 1] if entries else None))
        self.sent[index] += len(pieces)
        return chunks

    def finish(self, answers: list[dict]) -> list[dict]:
        chunks: list[dict] = []
        for index, answer in enumerate(answers):
            chunks += self.start(index, answer)
            entries = answer["logprobs"]
            prompt_count = answer["prompt_tokens"] if (entries is not None and self.requests[index].get("echo")) else 0
            done = self.sent[index]
            rest = entries[prompt_count + done :] if entries is not None else None
            chunks += self.tokens(index, answer["pieces"][done:], rest)
        for index, answer in enumerate(answers):
            chunks.append(self._chunk(index, {} if self.chat else "", answer["finish_reason"], None))
        if self.include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            chunks.append(
                {
                    "id": self.id,
                    "object": kind,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage(answers),
                }
            )
        return chunks


def stream_usage(body: dict) -> bool:
    """Whether a stream ends with a ``usage`` chunk (``stream_options: {"include_usage": true}``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options must be an object with include_usage true or false", "stream_options")
    return bool(options.get("include_usage"))


def deterministic(requests: list[dict]) -> bool:
    """Whether the answers to ``requests`` are a function of the model and the requests alone:
    greedy (temperature 0), seeded, or scoring only (nothing sampled). Only those are cached."""
    return all(
        r.get("max_tokens") == 0 or float(r.get("temperature", 1.0)) == 0.0 or r.get("seed") is not None
        for r in requests
    )


def embedding_vector(output: Any) -> list[float] | None:
    """One embedding from a model's output: a vector as it is, token vectors (``[tokens][dims]``
    or ``[1][tokens][dims]``) mean-pooled; None when the output is not numbers of that shape."""

    def is_vector(value: Any) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        )

    if is_vector(output):
        return [float(x) for x in output]
    if (
        isinstance(output, list)
        and len(output) == 1
        and isinstance(output[0], list)
        and output[0]
        and is_vector(output[0][0])
    ):
        output = output[0]
    if isinstance(output, list) and output and all(is_vector(row) for row in output):
        width = len(output[0])
        if all(len(row) == width for row in output):
            return [sum(row[i] for row in output) / len(output) for i in range(width)]
    return None


def embeddings_body(model: str, vectors: list[list[float]], encoding: str, prompt_tokens: int = 0) -> dict:
    """The answer of the embeddings route, of finite vectors (the handler refuses others). A value
    that float32 cannot hold (beyond ±3.4e38) in a ``base64`` answer is the model's failure, as a
    value that is no finite number is: float32's infinity in its place would be a vector the
    route never answers with ``float``, and a client computes NaN from it without knowing."""

    def encode(index: int, vector: list[float]) -> list[float] | str:
        if encoding != "base64":
            return vector
        try:  # little-endian float32, as OpenAI's clients decode it
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        except OverflowError:  # (struct's, where numpy's cast gives infinity)
            raise OpenAIError(
                502,
                f"the model {model!r} failed: its embedding of input {index} holds a value beyond float32's "
                "range (±3.4e38), which encoding_format 'base64' (float32) cannot carry; 'float' gives it as it is",
                type="server_error",
                code="model_error",
                final=True,
            ) from None

    return {
        "object": "list",
        "data": [{"object": "embedding", "embedding": encode(i, v), "index": i} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def models_body(names: list[str], created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "evalsched"} for name in names],
    }
