"""The model host: one long-lived process per shared model, a child of the Jupyter server.

Started by ``ModelHostManager`` as::

    python -m jupyter_evalsched.shared_models.host --socket PATH --parent-pid PID

with its declaration on stdin, a pipe from the manager (``{"config": <the model's declaration>,
"failed_load": <a previous host's load failure> | null}``, read to EOF; stdin is then
``/dev/null``): the options may hold secrets (a hub token), which must not be in argv or the
environment, both readable by every user in ``/proc``.

It serves one model on a Unix socket (0600, in the manager's 0700 directory, peers checked with
SO_PEERCRED). The model is loaded at the first request (or at start with ``preload``) and stays
loaded. A crash or an out-of-memory while loading or running it ends this process only: the
server, its scheduler and the other models' hosts go on, and the manager starts a new host.

Threads: the main thread accepts connections; one thread per connection reads requests (one at a
time per connection) and waits for their answers; one batcher thread owns the model, loads it,
gathers queued inputs into batches (up to ``max_batch_size``, waiting at most ``max_wait_ms``
for more, and not at all when every connected client already has a request queued; an API
request names its client, the server's HTTP connection, and the wait also covers API clients
answered in the last API_CLIENT_RECENT_WAITS x max_wait_ms that have not sent again) and answers each request with
its slice of the outputs, in order. The size of every batch run is recorded.

Ops: ``call`` (inputs and keyword arguments for the batch callable; with ``"embeddings": true``
from the embeddings route, refused before it runs by a model that generates text, whose plain
call would generate for each input), ``openai`` (requests of the OpenAI-compatible routes, one
dict per prompt, batched with every caller's API requests into one call of the model's
``openai_batch``: see ``causal.py``), ``describe`` and ``ping``. An ``openai`` request with
``"stream": true`` gets ``{"ok": true, "delta": {"index", ...}}`` messages as its text is made,
before its reply. While a ``call`` or ``openai`` request waits, its connection is watched: a
caller that closes it (a client gone, a run killed) cancels the request (``cancelled_requests``).
Its inputs still queued leave the queue; an ``openai`` request's rows in a running batch stop
generating at the next step, while a ``call`` batch already running is computed to its end (a
batch callable cannot be stopped midway) and the cancelled request's outputs are dropped.

Events for the manager go to the original stdout as JSON lines (``ready``, ``loading``,
``loaded``, ``load_failed``, and ``busy``/``idle`` when requests start or stop being in flight,
which tell the manager when the model was last used); fd 1 is pointed at stderr so that prints of a loader cannot
corrupt them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import Counter, deque
from datetime import UTC, datetime

from .config import ModelConfig, parse_model
from .protocol import ProtocolError, recv_message, send_message

TYPE_CHECKING = False  # mypy knows this name; nothing more is imported at run time
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)
# Pipeline tasks whose plain call generates text: asked for embeddings, refused before they run.
TEXT_GENERATION_TASKS = ("text-generation", "text2text-generation", "summarization", "translation")
RATE_WINDOW_S = 60.0  # tokens_per_s is over the batches that ended this recently
ACCEPT_BACKOFF_S = 0.05  # out of descriptors: the next accept after this long
OPEN_FILES_WANTED = 65536  # the soft limit raised toward it (each request in flight holds three)
OPENAI_KEY = b"\0openai"  # the batching key of API requests (no pickle of kwargs starts with a NUL)
# An API client (one HTTP connection of the server's) answered within this many max_wait_ms and
# not yet back is expected to send again: the batcher waits for it (up to max_wait_ms). With the
# default 5 ms: 0.2 s, longer than a client's turnaround between two requests, short enough that
# a client that stopped costs little.
API_CLIENT_RECENT_WAITS = 40


# -- output conversion ----------------------------------------------------------------------


def to_plain(value):
    """Convert a model output to plain Python: tensors and arrays to lists, numpy scalars to
    floats/ints/bools. Raises TypeError for objects that have no plain form."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return value
    if kind is list or kind is tuple:
        return kind(to_plain(item) for item in value)
    if isinstance(value, dict):
        return {to_plain(key): to_plain(item) for key, item in value.items()}
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "tolist"):  # torch.Tensor
        return value.detach().cpu().tolist()
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy array or scalar
        return to_plain(value.tolist())
    # Subclasses of plain types (numpy.float64 is a float) would pickle as their own class.
    for base in (bool, int, float, str, bytes):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(item) for item in value]
    raise TypeError(f"the model returned a {kind.__module__}.{kind.__qualname__}, which has no plain-data form")


def _error_dict(exc: BaseException, phase: str) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc) or repr(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "phase": phase,
    }


# -- figures --------------------------------------------------------------------------------


def token_counts(fn) -> tuple[int, int]:
    """The (prompt, completion) tokens a model callable has served so far: what its ``usage``
    dict says (``CausalLM`` keeps one), else (0, 0) for models that do not count tokens."""
    usage = getattr(fn, "usage", None)
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def tokens_per_s(samples: Iterable[tuple[float, int]], now: float, since: float | None, window_s: float) -> float:
    """Tokens per second over the last ``window_s`` (or since ``since``, the load, when that is
    more recent): the tokens of the ``(ended_at, tokens)`` batch samples in that span over its
    length, at least one second (a first batch must not read as millions a second)."""
    if since is None:
        return 0.0
    start = max(now - window_s, since)
    total = sum(tokens for ended, tokens in samples if ended >= start)
    return round(total / max(1.0, now - start), 3)


def iso_time(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds")


# -- the served model -----------------------------------------------------------------------


class _PipelineCaller:
    """Calls a transformers pipeline on a whole batch at once."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.unpad = getattr(pipe, "task", None) == "feature-extraction"

    def __call__(self, inputs: list, **kwargs):
        outputs = self.pipe(inputs, **{"batch_size": len(inputs), **kwargs})
        if self.unpad:
            from .loaders import unpad_feature_extraction

            outputs = unpad_feature_extraction(self.pipe, inputs, outputs, kwargs)
        return outputs


def _files_of(model: str | None) -> str | None:
    """``model_digest`` of the model's files, None where it cannot be made: what the response
    cache keys on must never fail a load (a model is served all the same, its answers uncached)."""
    from .model_files import model_digest

    try:
        return model_digest(model)
    except Exception:
        return None


def load_callable(config: ModelConfig):
    """Build the batch callable of a model: ``fn(list_of_inputs, **kwargs) -> list_of_outputs``."""
    options = dict(config.options)
    # main() narrows CUDA_VISIBLE_DEVICES to the model's GPU, which is then cuda:0 in here.
    device = "cuda:0" if config.gpu_index is not None else config.device
    if config.task is not None:
        from transformers import pipeline  # imported here only: the host stays light until a load

        if config.dtype is not None:
            options.setdefault("dtype", config.dtype)
        # transformers overloads pipeline() per literal task name only; the function takes any str.
        return _PipelineCaller(pipeline(config.task, model=config.model, device=device, **options))  # type: ignore[call-overload]
    if config.loader is None:  # parse_model requires exactly one of task and loader
        raise ValueError(f"shared model {config.name!r}: neither 'task' nor 'loader' is set")
    module_name, function_name = config.loader.split(":", 1)
    loader = getattr(importlib.import_module(module_name), function_name)
    fn = loader(model=config.model, device=device, dtype=config.dtype, **options)
    if not callable(fn):
        raise TypeError(f"loader {config.loader} returned a {type(fn).__name__}, not a callable")
    return fn


def generates_text(fn: Any) -> bool:
    """Whether a loaded batch callable's plain call generates text: a causal language model
    (``openai_batch``: ``causal.py``), or a pipeline of a generating task."""
    if getattr(fn, "openai_batch", None) is not None:
        return True
    task = getattr(fn.pipe, "task", None) if isinstance(fn, _PipelineCaller) else None
    return isinstance(task, str) and task.startswith(TEXT_GENERATION_TASKS)


class _Call:
    """One client request: its inputs, and the outputs filled in batch by batch."""

    __slots__ = (
        "inputs", "kwargs", "key", "openai", "embeddings", "client", "outputs", "remaining", "error",
        "done", "cancelled", "deltas", "wake_r", "wake_w",
    )  # fmt: skip

    def __init__(
        self,
        inputs: list,
        kwargs: dict,
        openai: bool = False,
        client: str | None = None,
        *,
        watched: bool = False,
        embeddings: bool = False,
    ):
        self.inputs = inputs
        self.kwargs = kwargs
        self.embeddings = embeddings  # (the embeddings route's: refused by a model that generates text)
        # The API client the server received it from (its HTTP connection): see ``api_waiting``.
        self.client = client
        # An API request (the ``openai`` op) goes to the model's ``openai_batch`` with the other
        # API requests; each carries its own parameters, so any of them can share a batch.
        self.openai = openai
        # Only requests with equal keyword arguments can share a forward pass.
        self.key = OPENAI_KEY if openai else pickle.dumps(sorted(kwargs.items()), protocol=5) if kwargs else b""
        self.outputs: list = [None] * len(inputs)
        self.remaining = len(inputs)
        self.error: dict | None = None
        self.done = threading.Event()
        self.cancelled = False  # its caller went away: compute nothing more for it
        self.deltas: list[dict] = []  # streamed parts not yet sent to the caller
        # Wakes the connection thread (which also watches its socket) when a delta or the end
        # comes; a socket pair, not a pipe: a write after close raises, never hits a reused fd.
        self.wake_r: socket.socket | None = None
        self.wake_w: socket.socket | None = None
        if openai or watched:
            self.wake_r, self.wake_w = socket.socketpair()
            self.wake_w.setblocking(False)

    def wake(self) -> None:
        if self.wake_w is not None:
            with contextlib.suppress(OSError):  # full (the reader is awake anyway) or closed
                self.wake_w.send(b"\0")

    def close(self) -> None:
        for end in (self.wake_r, self.wake_w):
            if end is not None:
                end.close()


class ModelHost:
    def __init__(self, config: ModelConfig, socket_path: str, emit):
        self.config = config
        self.socket_path = socket_path
        self.emit = emit
        self.cond = threading.Condition()
        self.queue: deque[tuple[_Call, int]] = deque()  # one entry per input, in arrival order
        self.fn: Callable[..., Any] | None = None  # the batch callable, once loaded
        self.state = "not_loaded"
        self.error: dict | None = None
        self.failed_at = 0.0
        self.load_count = 0
        self.load_seconds: float | None = None
        self.outstanding = 0  # requests queued or being computed
        self.callers = 0  # open connections that have sent a call
        # API clients: each request comes on a connection of its own, so ``callers`` cannot tell
        # whether more are coming. Per client key: requests outstanding, and when it was last
        # answered (a client with nothing outstanding, answered recently, is expected back).
        self.api_busy: Counter[str] = Counter()
        self.api_answered: dict[str, float] = {}
        self.api_recent_s = API_CLIENT_RECENT_WAITS * config.max_wait_ms / 1000.0
        self.requests = 0
        self.failed_requests = 0
        self.cancelled_requests = 0  # callers that went away before their answer
        self.batches = 0
        self.inputs = 0
        self.batch_sizes: Counter[int] = Counter()
        self.forward_seconds = 0.0  # time spent in the model (and output conversion)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.loaded_at: float | None = None  # monotonic time of the last load
        self.loaded_files: str | None = None  # model_digest of what the last load read, if known
        self.tokens_since_load = 0
        self.recent: deque[tuple[float, int]] = deque()  # (ended_at, tokens) of recent batches
        self.last_used: float | None = None  # wall-clock time a caller last sent or got a request

    # -- figures --

    def _error(self, exc: BaseException, phase: str) -> dict:
        error = _error_dict(exc, phase)
        if isinstance(exc, MemoryError):
            cap = self.config.max_memory_mb
            limit = f"; this host's address space is capped at max_memory_mb={cap}" if cap else ""
            detail = f" ({exc})" if str(exc) else ""
            error["message"] = (
                f"out of memory while {'loading the model' if phase == 'load' else 'running a batch'}{detail}{limit}"
            )
        return error

    def describe(self) -> dict:
        with self.cond:
            now = time.monotonic()
            loaded_for = now - self.loaded_at if self.loaded_at is not None else 0.0
            return {
                "name": self.config.name,
                "state": self.state,
                "device": self.config.device,
                "vram_mb": self.config.vram_mb,
                "pid": os.getpid(),
                "requests": self.requests,
                "failed_requests": self.failed_requests,
                "cancelled_requests": self.cancelled_requests,
                "batches": self.batches,
                "inputs": self.inputs,
                "mean_batch_size": round(self.inputs / self.batches, 3) if self.batches else 0.0,
                "batch_sizes": {str(size): count for size, count in sorted(self.batch_sizes.items())},
                "mean_batch_ms": round(1000 * self.forward_seconds / self.batches, 3) if self.batches else 0.0,
                "max_batch_size": self.config.max_batch_size,
                "max_wait_ms": self.config.max_wait_ms,
                "load_count": self.load_count,
                "load_seconds": self.load_seconds,
                "error": self.error and {k: self.error[k] for k in ("type", "message")},
                "queued": len(self.queue),
                "callers": self.callers,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_s": tokens_per_s(self.recent, now, self.loaded_at, RATE_WINDOW_S),
                "tokens_per_s_since_load": (
                    round(self.tokens_since_load / max(1.0, loaded_for), 3) if self.loaded_at is not None else 0.0
                ),
                "last_used_at": iso_time(self.last_used),
            }

    # -- the batcher thread --

    def run_batcher(self) -> None:
        try:
            self._batch_forever()
        except BaseException:
            # Without its batcher the host would accept requests and never answer them: end the
            # process instead, so that callers get HostDied and the manager starts a new host.
            traceback.print_exc()
            os._exit(70)

    def _batch_forever(self) -> None:
        if self.config.preload:
            self._load()
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
            if self.state != "loaded":
                error = self._load()
                if error is not None:
                    self._fail_queued(error)
                    continue
            call_batch = self._refuse(self._gather())
            if call_batch:
                self._run(call_batch)

    def _load(self) -> dict | None:
        """Load the model; None when it is loaded, else the error (also kept in ``self.error``)."""
        with self.cond:
            self.state = "loading"
            self.load_count += 1
        self.emit("loading", load_count=self.load_count)
        started = time.monotonic()
        files = _files_of(self.config.model)  # (again after the load: what was loaded, if alike)
        try:
            fn = load_callable(self.config)
        except BaseException as exc:  # a loader's SystemExit or MemoryError is a failed load too
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = self._error(exc, "load")
            del exc
            gc.collect()  # give back what a half-done load allocated
            with self.cond:
                self.state, self.error, self.failed_at = "failed", error, time.monotonic()
            self.emit("load_failed", error=error, load_count=self.load_count)
            return error
        if files is not None and _files_of(self.config.model) != files:
            files = None  # rewritten while it loaded: which files it holds is not known
        with self.cond:
            self.fn, self.state, self.error = fn, "loaded", None
            self.loaded_files = files
            self.load_seconds = round(time.monotonic() - started, 3)
            self.loaded_at, self.tokens_since_load = time.monotonic(), 0
            self.recent.clear()
        self.emit("loaded", seconds=self.load_seconds, load_count=self.load_count)
        return None

    def _fail_queued(self, error: dict) -> None:
        with self.cond:
            calls = {id(call): call for call, _ in self.queue}
            self.queue.clear()
            for call in calls.values():
                self._finish(call, error)

    def _refusal(self, call: _Call) -> dict | None:
        """Why the loaded model will not run ``call`` (None: it will). Said before anything runs:
        a model that generates text, asked for embeddings, would generate for every input (16
        tokens each, a causal LM's plain call) only for its answer to be refused as no vectors."""
        if not call.embeddings or self.fn is None or not generates_text(self.fn):
            return None
        what = f"a {self.config.task} pipeline" if self.config.task else f"loader {self.config.loader}"
        return {
            "type": "NotSupported",
            "message": (
                f"the model {self.config.name!r} does not produce embeddings: it generates text ({what}); "
                "embeddings come from a model such as jupyter_evalsched.shared_models.loaders:sentence_embeddings"
            ),
            "phase": "call",
        }

    def _refuse(self, entries: list[tuple[_Call, int]]) -> list[tuple[_Call, int]]:
        """The entries of a gathered batch the model will run; the requests it will not (asked
        while it was not loaded yet) are answered with why."""
        kept = []
        with self.cond:
            for call, index in entries:
                refusal = self._refusal(call)
                if refusal is None:
                    kept.append((call, index))
                else:
                    self._finish(call, refusal, refused=True)
        return kept

    def _gather(self) -> list[tuple[_Call, int]]:
        """Take the next batch off the queue: entries with the head's kwargs, up to the limit."""
        limit = self.config.max_batch_size
        deadline = time.monotonic() + self.config.max_wait_ms / 1000.0
        with self.cond:
            while True:
                # Drop entries of requests that already failed, or whose caller went away.
                while self.queue and (self.queue[0][0].error is not None or self.queue[0][0].cancelled):
                    self._finish(self.queue.popleft()[0], None)
                if not self.queue:
                    return []
                key = self.queue[0][0].key
                compatible = sum(
                    1 for call, _ in self.queue if call.key == key and call.error is None and not call.cancelled
                )
                if compatible >= limit:
                    break
                # Waiting helps only if some connected client could still send: when every caller
                # already has a request queued, nobody else can join this batch.
                if self.outstanding >= self.callers and not (
                    key == OPENAI_KEY
                    and api_waiting(self.api_busy, self.api_answered, time.monotonic(), self.api_recent_s)
                ):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            batch: list[tuple[_Call, int]] = []
            kept: deque[tuple[_Call, int]] = deque()
            for entry in self.queue:
                call = entry[0]
                if call.error is not None or call.cancelled:
                    self._finish(call, None)
                    continue
                if call.key == key and len(batch) < limit:
                    batch.append(entry)
                else:
                    kept.append(entry)
            self.queue = kept
            return batch

    def _forward(self, entries: list[tuple[_Call, int]], answered: set[int], streamed: set[int]) -> list:
        """The outputs of a batch; ``answered`` collects the positions an API batch answered
        early (its scoring and short generations, before its longest generation is done), and
        ``streamed`` those it sent a part of to their caller."""
        fn = self.fn
        if fn is None:  # the batcher runs batches only once the model is loaded
            raise RuntimeError("the model is not loaded")
        inputs = [call.inputs[index] for call, index in entries]
        with self.cond:
            self.batches += 1
            self.inputs += len(inputs)
            self.batch_sizes[len(inputs)] += 1
        started = time.perf_counter()
        tokens_before = token_counts(fn)
        try:
            if entries[0][0].openai:
                batch = getattr(fn, "openai_batch", None)
                if batch is None:
                    raise NotSupported(
                        f"shared model {self.config.name!r} does not serve completions: its loader "
                        f"({self.config.loader or self.config.task}) is not a causal language model "
                        "(use jupyter_evalsched.shared_models.loaders:causal_lm)"
                    )

                def on_done(position: int, answer) -> None:
                    call, index = entries[position]
                    plain = to_plain(answer)
                    with self.cond:
                        if position in answered or call.done.is_set():
                            return
                        answered.add(position)
                        call.outputs[index] = plain
                        call.remaining -= 1
                        if call.remaining == 0:
                            self._finish(call, None)

                def on_delta(position: int, delta) -> None:
                    call, index = entries[position]
                    plain = to_plain(delta)
                    with self.cond:
                        if call.done.is_set() or call.cancelled:
                            return
                        if "prompt_text" not in plain:  # (a head is sent to a client once, however often made)
                            streamed.add(position)
                        call.deltas.append({"index": index, **plain})
                    call.wake()

                def cancelled(position: int) -> bool:
                    return entries[position][0].cancelled

                outputs = batch(inputs, on_done=on_done, on_delta=on_delta, cancelled=cancelled)
            else:
                outputs = fn(inputs, **entries[0][0].kwargs)
            if not isinstance(outputs, list):
                outputs = list(outputs)
            if len(outputs) != len(inputs):
                raise ValueError(f"the model returned {len(outputs)} outputs for a batch of {len(inputs)} inputs")
            return [to_plain(output) for output in outputs]
        finally:
            self.forward_seconds += time.perf_counter() - started
            self._count_tokens(tokens_before, token_counts(fn))

    def _count_tokens(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        """Add a batch's tokens (what the model's counters moved by) to the figures."""
        prompt, completion = after[0] - before[0], after[1] - before[1]
        now = time.monotonic()
        with self.cond:
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.tokens_since_load += prompt + completion
            if prompt + completion:
                self.recent.append((now, prompt + completion))
            while self.recent and self.recent[0][0] < now - RATE_WINDOW_S:
                self.recent.popleft()

    def _run(self, entries: list[tuple[_Call, int]]) -> None:
        answered: set[int] = set()
        streamed: set[int] = set()
        again: list[list[tuple[_Call, int]]] | None
        try:
            outputs = self._forward(entries, answered, streamed)
        except BaseException as exc:  # a model's sys.exit() must not end the batcher thread
            again = self._after_failure(entries, answered, streamed, self._error(exc, "call"))
        else:
            again = None
        if again is not None:
            # Run outside the except block, which keeps the failed batch's frames alive (its
            # tensors: the very memory a GPU's out-of-memory failure is about).
            for rest in again:
                self._run(rest)
            return
        with self.cond:
            for position, ((call, index), output) in enumerate(zip(entries, outputs, strict=False)):
                if position in answered:
                    continue
                call.outputs[index] = output
                call.remaining -= 1
                if call.remaining == 0:
                    self._finish(call, None)

    def _after_failure(
        self, entries: list[tuple[_Call, int]], answered: set[int], streamed: set[int], error: dict
    ) -> list[list[tuple[_Call, int]]]:
        """What to run again, each request alone, after the batch of ``entries`` failed with
        ``error``; the requests that cannot be run again are failed here. One request alone
        fails with the batch's error. Several shared it: each is run again alone, so that one bad
        input fails its own request only. Only its inputs still unanswered go again (an answered
        one is counted in ``remaining`` already); a request that was sent a part of one (a
        token) fails instead, its caller would get that part twice, and not with another
        request's error, which its message would show that caller."""
        calls = [c for c in {id(call): call for call, _ in entries}.values() if not c.done.is_set()]
        if len(calls) == 1:
            with self.cond:
                self._finish(calls[0], error)
            return []
        shared = {
            **error,
            "message": "the batch it shared with other requests failed after part of its answer was sent",
        }
        again = []
        for call in calls:
            rest = [(p, e) for p, e in enumerate(entries) if e[0] is call and p not in answered]
            if any(p in streamed for p, _ in rest):
                with self.cond:
                    self._finish(call, shared)
            elif rest:
                again.append([entry for _, entry in rest])
        return again

    def _finish(self, call: _Call, error: dict | None, *, refused: bool = False) -> None:
        """Complete a request (with ``self.cond`` held). ``refused``: not run at all (``_refusal``),
        which is the caller's mistake, not a failed request."""
        if call.done.is_set():
            return
        call.error = error
        self.outstanding -= 1
        self.last_used = time.time()
        if self.outstanding == 0:
            self.emit("idle")
        if call.client is not None:
            self.api_busy[call.client] -= 1
            if self.api_busy[call.client] <= 0:
                del self.api_busy[call.client]
            self.api_answered[call.client] = time.monotonic()
        if call.cancelled or refused:
            pass  # (cancelled: counted when its caller went away)
        elif error is None:
            self.requests += 1
        else:
            self.failed_requests += 1
        call.done.set()
        call.wake()
        self.cond.notify_all()

    def _cancel(self, call: _Call) -> None:
        """The caller of ``call`` went away: its queued entries are dropped at the next gather,
        its rows in a running batch stop at the next step (``openai_batch``'s ``cancelled``)."""
        with self.cond:
            if call.done.is_set() or call.cancelled:
                return
            call.cancelled = True
            self.cancelled_requests += 1
            self.cond.notify_all()

    # -- connections --

    def submit(
        self,
        inputs: list,
        kwargs: dict,
        openai: bool = False,
        conn: socket.socket | None = None,
        stream: bool = False,
        client: str | None = None,
        embeddings: bool = False,
    ) -> dict | None:
        """Queue a request and wait for its answer (None: its caller went away). ``conn``, when
        given, is watched meanwhile (its caller gone cancels the request), and an API request's
        deltas are sent there when ``stream``; ``client`` names the API client it came from (see
        ``api_waiting``); ``embeddings``: see ``_refusal``."""
        call = _Call(inputs, kwargs, openai, client, watched=conn is not None, embeddings=embeddings)
        try:
            return self._submit(call, conn, stream)
        finally:
            call.close()

    def _submit(self, call: _Call, conn: socket.socket | None, stream: bool) -> dict | None:
        with self.cond:
            failure = self.error if self.state == "failed" else None
            if failure is not None and time.monotonic() < self.failed_at + self.config.load_retry_s:
                # Fail fast instead of loading a failing model again for every request.
                error = dict(failure)
                wait = self.failed_at + self.config.load_retry_s - time.monotonic()
                error["message"] += f" (the next load attempt is allowed in {wait:.0f} s)"
                self.failed_requests += 1
                return {"ok": False, "error": error}
            refusal = self._refusal(call) if self.state == "loaded" else None  # (else: once loaded)
            if refusal is not None:
                return {"ok": False, "error": refusal}
            self.outstanding += 1
            self.last_used = time.time()
            if self.outstanding == 1:
                self.emit("busy")
            if call.client is not None:
                self.api_busy[call.client] += 1
            self.queue.extend((call, index) for index in range(len(call.inputs)))
            self.cond.notify_all()
        if conn is None or call.wake_r is None:
            call.done.wait()
        elif not self._await(call, conn, stream):
            return None
        if call.error is not None:
            return {"ok": False, "error": call.error}
        # The files of the load that answered: the response cache stores the answer only under
        # their key (the files on disk may have changed since, the loaded weights not).
        return {"ok": True, "outputs": call.outputs, "files": self.loaded_files}

    def _await(self, call: _Call, conn: socket.socket, stream: bool) -> bool:
        """Wait for ``call`` to be done, sending its deltas when ``stream``, and watching ``conn``:
        False (the call cancelled) when its caller closed the connection or cannot be written."""
        assert call.wake_r is not None
        # poll, not select: select cannot watch a descriptor numbered 1024 or more, which a host
        # with a few hundred requests in flight (three descriptors each) reaches.
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        poller.register(call.wake_r, select.POLLIN)
        try:
            while True:
                with self.cond:
                    deltas, call.deltas = call.deltas, []
                    finished = call.done.is_set()
                try:
                    for delta in deltas if stream else ():
                        send_message(conn, {"ok": True, "delta": delta})
                except OSError:
                    self._cancel(call)
                    return False
                if finished:
                    return True
                ready = {fd for fd, _ in poller.poll()}
                if call.wake_r.fileno() in ready:
                    with contextlib.suppress(OSError):
                        call.wake_r.recv(4096)
                if conn.fileno() in ready:
                    try:
                        gone = conn.recv(1, socket.MSG_PEEK) == b""
                    except OSError:
                        gone = True
                    if gone:
                        self._cancel(call)
                        return False
                    poller.unregister(conn)  # a caller that sends before its answer: no longer watched
        except BaseException:
            self._cancel(call)  # whatever ends this wait, nobody takes the answer any more
            raise

    def serve_connection(self, conn: socket.socket) -> None:
        is_caller = False
        try:
            if not _peer_is_owner(conn):
                return
            # The greeting tells the client that this host accepted the connection: a connection
            # that breaks before it was never served, so the client may safely connect again.
            send_message(conn, {"ok": True, "hello": {"model": self.config.name, "pid": os.getpid()}})
            while True:
                try:
                    message = recv_message(conn, plain_only=False)
                except (ProtocolError, OSError):
                    return
                if message.get("op") in ("call", "openai") and not is_caller:
                    # Only connections that send calls count as callers for the batching wait.
                    is_caller = True
                    with self.cond:
                        self.callers += 1
                        self.cond.notify_all()
                reply = self._handle(message, conn)
                if reply is None:  # the caller went away
                    return
                send_message(conn, reply)
        except OSError:
            return
        except Exception:  # a bug of ours ends this connection (its call cancelled), not the host
            traceback.print_exc()
            return
        finally:
            if is_caller:
                with self.cond:
                    self.callers -= 1
                    self.cond.notify_all()
            conn.close()

    def _handle(self, message: dict, conn: socket.socket | None = None) -> dict | None:
        op = message.get("op")
        if message.get("model") != self.config.name:
            return _bad_request(f"this host serves {self.config.name!r}, not {message.get('model')!r}")
        if op == "describe":
            return {"ok": True, "describe": self.describe()}
        if op == "ping":
            return {"ok": True}
        if op == "openai":
            requests = message.get("requests")
            if not isinstance(requests, list) or not requests or not all(isinstance(r, dict) for r in requests):
                return _bad_request("'requests' must be a non-empty list of dicts")
            stream = bool(message.get("stream"))
            client = message.get("client")
            return self.submit(
                requests, {}, openai=True, conn=conn, stream=stream, client=client if isinstance(client, str) else None
            )
        if op != "call":
            return _bad_request(f"unknown op {op!r}")
        inputs, kwargs = message.get("inputs"), message.get("kwargs", {})
        if not isinstance(inputs, list) or not inputs:
            return _bad_request("'inputs' must be a non-empty list")
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            return _bad_request("'kwargs' must be a dict with string keys")
        # Watched: a caller gone (the embeddings route's client, a run killed or timed out)
        # cancels its call, whose queued inputs are then never computed.
        return self.submit(inputs, kwargs, conn=conn, embeddings=message.get("embeddings") is True)

    def serve_forever(self) -> None:
        listener = _listen(self.socket_path)
        threading.Thread(target=self.run_batcher, name="batcher", daemon=True).start()
        self.emit("ready", socket=self.socket_path)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors (or memory) while many requests are in flight: the
                    # connection waits in the backlog until some end, and the host lives on.
                    time.sleep(ACCEPT_BACKOFF_S)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue  # (that one connection's trouble)
                raise
            try:
                threading.Thread(target=self.serve_connection, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had (the host's memory cap, say): that caller's loss only
                conn.close()
                time.sleep(ACCEPT_BACKOFF_S)


def api_waiting(busy: Counter[str], answered: dict[str, float], now: float, recent_s: float) -> bool:
    """Whether an API client is expected to send soon: answered within ``recent_s`` and nothing
    outstanding. Forgets clients answered longer ago (so ``answered`` stays small)."""
    waiting = False
    for client, at in list(answered.items()):
        if now - at >= recent_s:
            del answered[client]
        elif not busy.get(client):
            waiting = True
    return waiting


class NotSupported(TypeError):
    """An API request to a model that cannot serve it (an embedding model asked for text)."""


def _bad_request(message: str) -> dict:
    return {"ok": False, "error": {"type": "BadRequest", "message": message, "phase": "call"}}


def _peer_is_owner(conn: socket.socket) -> bool:
    """Defence in depth over the 0600 socket: serve only processes of our own user."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return True  # no SO_PEERCRED on this platform: the file permissions still apply
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _listen(path: str) -> socket.socket:
    """Bind under a temporary name with a 0600 mode, then rename into place atomically."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # No longer than the socket's own name ("m<index>.sock"): the manager sized the directory for
    # that, and a longer temporary name would not fit in sun_path (108 bytes).
    temporary = os.path.join(os.path.dirname(path), f".b{os.getpid()}")
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass
    previous_umask = os.umask(0o177)
    try:
        listener.bind(temporary)
    finally:
        os.umask(previous_umask)
    os.chmod(temporary, 0o600)
    listener.listen(256)
    os.replace(temporary, path)
    return listener


# -- process set-up -------------------------------------------------------------------------


def _die_with_parent(parent_pid: int | None) -> None:
    """PR_SET_PDEATHSIG after exec (no preexec_fn), then close the race with a getppid check."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 == PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(0)


def _raise_open_files_limit() -> None:
    """The soft limit on open descriptors raised toward the hard one: each API request in flight
    holds three here, and the usual soft limit (1,024) would cap the host at about 340."""
    import resource

    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _limit_memory(max_memory_mb: int | None) -> None:
    if max_memory_mb:
        import resource

        limit = max_memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _event_writer():
    """Keep the real stdout for events; point fd 1 (and print) at stderr."""
    stream = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    lock = threading.Lock()

    def emit(event: str, **fields) -> None:
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str)
        with lock:
            try:
                stream.write(line + "\n")
            except (OSError, ValueError):
                pass  # the manager is gone; the death signal ends us

    return emit


def _read_declaration() -> dict:
    """The declaration from stdin (the manager's pipe, read to EOF); stdin becomes /dev/null."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    declaration = json.loads(b"".join(chunks))
    if not isinstance(declaration, dict) or not isinstance(declaration.get("config"), dict):
        raise SystemExit("the model host expects its declaration as a JSON object on stdin")
    return declaration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_evalsched.shared_models.host")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    declaration = _read_declaration()
    config = parse_model(declaration["config"])
    failed_load = declaration.get("failed_load")
    emit = _event_writer()
    _limit_memory(config.max_memory_mb)
    _raise_open_files_limit()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Before torch is imported (OpenMP reads it once): idle intra-op threads sleep instead of
    # spinning. The host shares its cores with runs; spinning workers that wait for a preempted
    # peer made a forward pass of the tiny LM 50x slower on a busy 2-core host (docs/performance.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if config.cpu_threads:
        # Before torch is imported: its OpenMP/MKL pools read these once. On a busy host, fewer
        # threads than cores avoids the OpenMP barrier stalls of preempted workers.
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[variable] = str(config.cpu_threads)
    if config.gpu_index is not None:
        # See only the model's GPU, numbered as NVML numbers it: no CUDA context on other GPUs.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = str(config.gpu_index)
    host = ModelHost(config, args.socket, emit)
    if failed_load:
        # The previous host died while loading: answer with that error for load_retry_s.
        host.state, host.error, host.failed_at = "failed", failed_load, time.monotonic()
    host.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
