"""The OpenAI-compatible routes, ``/evalsched/v1/...``: the host's shared models for any tool
that speaks OpenAI's API (``openai.OpenAI(base_url=<server>/evalsched/v1, api_key=<token>)``).

The server only routes: each request is validated here (``openai_shapes``), sent to the model's
host process on a connection of its own (``ModelHostManager.ask``), batched there with every
other caller's requests, and the answer is formatted back. Authentication is Jupyter's: the
token in ``Authorization: token ...`` or ``Bearer ...`` (what OpenAI's clients send). Every error
is OpenAI's shape, ``{"error": {"message", "type", "code", "param"}}``, and a client's mistake
is a 4xx, never a 500. A stream is written as the host generates: each delta the host sends is
relayed at once as OpenAI chunks; a client that goes away (mid-stream or before its answer) closes
its connection to the host, which cancels its request only. Deterministic requests are answered
from the response cache when it is on (``openai_cache``), with ``X-Evalsched-Cache: hit`` or
``miss``. On a secondary server every request is relayed to the primary on a connection of its
own, which a client that goes away closes at once (``EvalSchedHandler.relay_to_primary``).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jupyter_server.auth import User
from jupyter_server.auth.decorator import authorized
from tornado import web
from tornado.iostream import StreamClosedError

from .contract import RUNNING
from .handlers import EvalSchedHandler
from .openai_cache import ResponseCache, cache_key, model_digest
from .openai_keys import PREFIX, run_of_key
from .openai_shapes import (
    ChunkWriter,
    OpenAIError,
    chat_body,
    completion_body,
    deterministic,
    embedding_vector,
    embeddings_body,
    invalid,
    model_not_found,
    models_body,
    parse_chat,
    parse_completion,
    parse_embeddings,
    stream_usage,
    well_formed_answer,
)
from .scheduler.errors import SchedulerError
from .scheduler.shared import ModelUnavailable

MAX_BODY_BYTES = 16 << 20  # a batch of long prompts fits; more is a mistake
# A body this large or larger is parsed and checked in a thread, not on the event loop, which
# every client of the server shares (16 MiB takes seconds); a smaller one costs less than the hop.
PARSE_ON_LOOP_BELOW = 64 << 10
_STARTED = int(time.time())
_T = TypeVar("_T")


class ClientGone(Exception):
    """The HTTP client went away (not an OSError: it must cross ``ModelHostManager.ask``, which
    reads OSErrors as the host's)."""


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="model_unavailable")


class _RunKeys:
    """Jupyter's identity provider, which also accepts a live run's own API key
    (``Authorization: Bearer esk-...``, see ``openai_keys``) on these routes only."""

    def __init__(self, inner: Any, handler: OpenAIHandler):
        self._inner = inner
        self._handler = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_user(self, handler: Any) -> Any:
        user = self._handler.run_key_user()
        return user if user is not None else self._inner.get_user(handler)


class _RunKeyAuthorizer:
    """What a live run's key may do: these routes, which the key was made for and is accepted on
    only. The server's configured authorizer is not asked: it knows the users of its identity
    provider (a JupyterHub authorizer reads their hub scopes), not a run's, and would refuse or
    fail on one."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return True


class OpenAIHandler(EvalSchedHandler):
    """Base of the v1 routes: OpenAI-shaped errors for everything, its own 403s included."""

    _run_key_user: User | None = None
    # A run key's models: those its spec declares, whose memory the scheduler admitted with the
    # run; None for any other caller (the server's own users: every model).
    _run_models: tuple[str, ...] | None = None

    @property
    def identity_provider(self) -> Any:
        return _RunKeys(super().identity_provider, self)

    @property
    def authorizer(self) -> Any:
        if self._run_key_user is not None and self.current_user is self._run_key_user:
            return _RunKeyAuthorizer()
        return super().authorizer

    def run_key_user(self) -> User | None:
        """The user of a request that carries a live run's key; None for any other request."""
        scheme, _, key = self.request.headers.get("Authorization", "").partition(" ")
        host = self.app.model_host
        if scheme.lower() != "bearer" or not key.startswith(PREFIX) or host is None:
            return None
        run_id = run_of_key(host.api_secret, key.strip())
        if run_id is None:
            return None
        try:
            record = self.scheduler.get(run_id).record
        except SchedulerError:
            return None
        if record["state"] != RUNNING:  # the key lives as long as its run
            return None
        self._run_models = tuple(record.get("models") or ())
        self._token_authenticated = True  # like Jupyter's token: no XSRF cookie, no origin check
        self._run_key_user = User(username=f"evalsched-run-{run_id}", name=f"run {run_id}")
        return self._run_key_user

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, (ClientGone, StreamClosedError)):  # nobody to answer: end quietly
            if not self._finished:
                self.finish()
            return
        if isinstance(e, OpenAIError):  # the client's mistake or an unavailable model: its own status
            if not self._finished:
                self.send_error(e.status, exc_info=sys.exc_info())
            return
        super()._handle_request_exception(e)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "application/json")
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, OpenAIError):
            body = exc.body()
            if exc.final:
                self.set_header("x-should-retry", "false")  # (what OpenAI's own clients obey)
        elif isinstance(exc, web.HTTPError):
            message = (exc.log_message % exc.args) if exc.log_message else (self._reason or "error")
            kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(status_code)
            body = {
                "error": {
                    "message": getattr(exc, "message", None) or message,
                    "type": kind or ("invalid_request_error" if status_code < 500 else "server_error"),
                    "code": None,
                    "param": None,
                }
            }
        else:
            if exc is not None:
                self.log.error("evalsched v1: unexpected error", exc_info=kwargs["exc_info"])
            body = {
                "error": {
                    "message": f"internal error: {type(exc).__name__}",
                    "type": "server_error",
                    "code": None,
                    "param": None,
                }
            }
        self.finish(json.dumps(body))

    def body_json(self) -> Any:
        raw = self.request.body or b""
        if len(raw) > MAX_BODY_BYTES:
            raise OpenAIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", type="invalid_request_error")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise invalid(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise invalid("the request body is nested too deeply") from None

    async def parsed(self, parse: Callable[[Any], _T]) -> _T:
        """``parse`` of the request's JSON body (which raises OpenAI errors): off the event loop
        when the body is large."""
        if len(self.request.body or b"") < PARSE_ON_LOOP_BELOW:
            return parse(self.body_json())
        return await asyncio.to_thread(lambda: parse(self.body_json()))

    async def finish_off_loop(self, make_body: Callable[[], dict]) -> None:
        """The answer made and serialized in a thread: with every token's log-probabilities, or
        many prompts echoed, it runs to hundreds of megabytes, seconds of work the event loop
        (every client's) would wait through."""
        data = await asyncio.to_thread(lambda: json.dumps(make_body()).encode())
        self.set_header("Content-Type", "application/json")
        self.finish(data)

    def callable_models(self) -> list[str]:
        """The shared models this caller may use: a run key's, the ones its spec declares (a
        model the scheduler did not admit with the run would load without its VRAM counted for
        it); everyone else's, every configured one."""
        host = self.app.model_host
        known = host.names() if host is not None else []
        if self._run_models is None:
            return known
        return [name for name in known if name in self._run_models]

    def known_model(self, name: str) -> None:
        """OpenAI's 404 for a model this caller may not use (what OpenAI answers for a model a
        key has no access to), before anything is loaded."""
        allowed = self.callable_models()
        if name in allowed:
            return
        host = self.app.model_host
        if self._run_models is not None and host is not None and name in host.names():
            raise OpenAIError(
                404,
                f"the model {name!r} is not one this run declared: a run's key is answered only for the "
                f"models its spec names in 'models' ({', '.join(allowed) or 'none'})",
                type="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        raise model_not_found(name, allowed)

    _task: asyncio.Task | None = None
    forward_as_it_comes = True  # (on a secondary: a stream relayed as it comes, a long generation awaited)

    def on_connection_close(self) -> None:
        # A client gone before its answer: stop waiting, which closes the connection to the
        # model host, which cancels the request there (its slot in the batch is freed). Gone
        # before the request reached the host (its body still parsed, the cache looked up): it
        # never goes there. (On a secondary, the base class closes the relay's connection to the
        # primary, whose handler does the same there.)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        super().on_connection_close()

    async def ask(self, name: str, message: dict, on_delta: Any = None) -> Any:
        """The host's ``outputs`` for ``message``; its failures as OpenAI errors."""
        host = self.app.model_host
        assert host is not None  # known_model() came first
        if self.client_gone:
            raise ClientGone()
        self._task = asyncio.ensure_future(host.ask(name, message, on_delta))
        try:
            reply = await self._task
        except asyncio.CancelledError:
            raise ClientGone() from None  # on_connection_close: nothing to answer
        except ModelUnavailable as exc:
            raise unavailable(str(exc)) from None
        except ConnectionError as exc:
            raise unavailable(f"{exc}; retry: a new host starts and loads the model again") from None
        finally:
            self._task = None
        if reply.get("ok"):
            self._answered_from = reply.get("files")
            return reply["outputs"]
        error = reply.get("error") or {}
        message_text = f"{error.get('type')}: {error.get('message')}"
        if error.get("type") in ("NotSupported", "BadRequest"):
            raise invalid(str(error.get("message")), "model")
        if error.get("phase") == "load":
            raise unavailable(f"the model {name!r} failed to load: {message_text}")
        raise OpenAIError(502, f"the model {name!r} failed: {message_text}", type="server_error", code="model_error")

    async def ask_openai(self, name: str, requests: list[dict], on_delta: Any = None) -> list[dict]:
        stream = on_delta is not None
        # The client is this HTTP connection (keep-alive: one per concurrent caller): the host
        # waits a little for the next request of a client it answered recently.
        client = f"{id(self.request.connection):x}"
        message = {
            "op": "openai",
            "requests": [{**r, "stream": stream} for r in requests],
            "stream": stream,
            "client": client,
        }
        answers = await self.ask(name, message, on_delta)
        for answer in answers:
            if "error" in answer:  # a request the model cannot serve as given (too long a prompt)
                raise invalid(answer["error"]["message"], answer["error"].get("param"))
        return answers

    # -- the response cache --

    _answered_from: str | None = None  # the model files of the load that answered (the host says)

    async def cache_for(
        self, name: str, kind: str, requests: list[dict]
    ) -> tuple[ResponseCache, list[str], str] | None:
        """The cache, the keys (one per prompt) of a request that may be answered from the cache
        and the digest of the model's files they are keyed on; None when the cache is off, the
        request is not deterministic or the model names no files to key on."""
        cache: ResponseCache | None = getattr(self.app, "openai_cache", None)
        host = self.app.model_host
        if cache is None or host is None or not deterministic(requests):
            return None
        (config,) = [c for c in host.configs if c.name == name]
        files = await asyncio.to_thread(model_digest, config.model)  # (a walk of the model's directory)
        if files is None:
            return None
        declaration = config.as_dict()
        return cache, [cache_key(declaration, files, kind, request) for request in requests], files

    async def answers(self, name: str, kind: str, requests: list[dict], writer: ChunkWriter | None) -> list[dict]:
        """The answers to ``requests``: the cache's, the host's for the prompts it has none of
        (all of them for a stream that is not all cached, streamed through ``writer``)."""
        cached = await self.cache_for(name, kind, requests)
        found: list[dict | None] = [None] * len(requests)
        if cached is not None:
            cache, keys, _ = cached
            # A damaged or planted entry (its key right, its answer not one the host makes) is a
            # miss: the bodies and streams made from it would fail.
            found = await asyncio.to_thread(
                lambda: [answer if well_formed_answer(answer := cache.get(key)) else None for key in keys]
            )
            hit = all(answer is not None for answer in found)
            self.set_header("X-Evalsched-Cache", "hit" if hit else "miss")
            if hit:
                return [answer for answer in found if answer is not None]
        on_delta = None
        if writer is not None:
            found = [None] * len(requests)  # (the host's deltas are numbered by the requests it gets)

            async def on_delta(delta: dict) -> None:
                await self.relay(writer, delta)

        missing = [index for index, answer in enumerate(found) if answer is None]
        fresh = await self.ask_openai(name, [requests[index] for index in missing], on_delta)
        for index, answer in zip(missing, fresh, strict=True):
            found[index] = answer
        # Stored only when the host's load read the files the keys name: one that loaded before
        # the files changed answers with the weights it holds, which the new key must not get.
        if cached is not None and cached[2] == self._answered_from:
            cache, keys, _ = cached
            await asyncio.to_thread(
                lambda: [cache.put(keys[i], answer) for i, answer in zip(missing, fresh, strict=True)]
            )
        return [answer for answer in found if answer is not None]

    # -- streams --

    _streaming = False

    async def relay(self, writer: ChunkWriter, delta: dict) -> None:
        """One delta of the host as chunks, sent at once. An error before anything was sent is the
        client's 400; a client gone raises ClientGone, which ends the request with the host."""
        index = delta["index"]
        if "error" in delta:
            error = invalid(delta["error"]["message"], delta["error"].get("param"))
            if not self._streaming:
                raise error
            await self.send_events([error.body()])
            raise ClientGone()  # the rest of the stream cannot be made: end it
        if "prompt_text" in delta:
            chunks = writer.start(index, delta)
        else:
            chunks = writer.start(index, {}) if writer.chat else []
            chunks += writer.tokens(index, delta["pieces"], delta.get("logprobs"))
        await self.send_events(chunks)

    async def send_events(self, chunks: list[dict]) -> None:
        if not chunks:
            return
        if not self._streaming:
            self._streaming = True
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-cache")
        self.write("".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks))
        try:
            await self.flush()
        except StreamClosedError:
            raise ClientGone() from None

    async def stream(self, name: str, kind: str, requests: list[dict], include_usage: bool) -> None:
        """Server-sent events, written as the host makes them, then ``data: [DONE]``. A client
        that has gone away ends the stream here, and its request in the model host."""
        writer = ChunkWriter(kind, name, requests, include_usage)
        try:
            answers = await self.answers(name, kind, requests, writer)
            await self.send_events(writer.finish(answers))
            self.write("data: [DONE]\n\n")
            await self.flush()
        except (StreamClosedError, ClientGone):
            return
        except Exception as exc:
            if not self._streaming:
                raise  # nothing sent yet: its own status
            # The status is sent: a failure can only be told as an event (which OpenAI's clients
            # raise). Ended without one, the stream would read as a whole, shorter answer.
            if not isinstance(exc, OpenAIError):
                self.log.error("evalsched v1: unexpected error mid-stream", exc_info=True)
                exc = OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error")
            try:
                await self.send_events([exc.body()])
            except ClientGone:
                return
        self.finish()


class ModelsHandler(OpenAIHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(models_body(self.callable_models(), _STARTED))


class ModelHandler(OpenAIHandler):
    """One model, as the ``openai`` client's ``models.retrieve`` asks for it (an unknown one is
    OpenAI's 404, not the server's HTML page)."""

    @web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        self.known_model(name)
        self.finish(models_body([name], _STARTED)["data"][0])


class CompletionsHandler(OpenAIHandler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        (model, stream, requests), include_usage = await self.parsed(lambda b: (parse_completion(b), stream_usage(b)))
        self.known_model(model)
        if stream:
            await self.stream(model, "completions", requests, include_usage)
        else:
            answers = await self.answers(model, "completions", requests, None)
            await self.finish_off_loop(lambda: completion_body(model, requests, answers))


class ChatCompletionsHandler(OpenAIHandler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        (model, stream, request), include_usage = await self.parsed(lambda b: (parse_chat(b), stream_usage(b)))
        self.known_model(model)
        if stream:
            await self.stream(model, "chat", [request], include_usage)
        else:
            (answer,) = await self.answers(model, "chat", [request], None)
            await self.finish_off_loop(lambda: chat_body(model, answer))


class EmbeddingsHandler(OpenAIHandler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        model, inputs, encoding = await self.parsed(parse_embeddings)
        self.known_model(model)
        # (embeddings: a model that generates text refuses it before it runs; a client gone
        # cancels it in the model host, as a completion)
        outputs = await self.ask(model, {"op": "call", "inputs": inputs, "kwargs": {}, "embeddings": True})

        def body() -> dict:  # (token vectors mean-pooled: a thousand inputs take seconds)
            vectors = [embedding_vector(output) for output in outputs]
            if any(vector is None for vector in vectors):
                raise invalid(f"the model {model!r} does not produce embeddings (its outputs are not vectors)", "model")
            broken = next((i for i, v in enumerate(vectors) if v is not None and not all(map(math.isfinite, v))), None)
            if broken is not None:  # (a float16 overflow): JSON has no NaN, and a client no use for it
                raise OpenAIError(
                    502,
                    f"the model {model!r} failed: its embedding of input {broken} holds a value that is no "
                    "finite number (NaN or infinity)",
                    type="server_error",
                    code="model_error",
                    final=True,
                )
            return embeddings_body(model, [v for v in vectors if v is not None], encoding)

        await self.finish_off_loop(body)


def handlers() -> list[tuple[str, type]]:
    return [
        (r"/evalsched/v1/models/?", ModelsHandler),
        (r"/evalsched/v1/models/([^/]+)/?", ModelHandler),
        (r"/evalsched/v1/completions/?", CompletionsHandler),
        (r"/evalsched/v1/chat/completions/?", ChatCompletionsHandler),
        (r"/evalsched/v1/embeddings/?", EmbeddingsHandler),
    ]
