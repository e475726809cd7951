"""Standard-library shared models for tests and benchmarks (no torch: they start in milliseconds).

Each function is a loader: ``"loader": "jupyter_evalsched.shared_models.testing:upper"``, with its
keyword arguments given in the model's ``options``.
"""

from __future__ import annotations

import os
import signal
import time


def upper(model=None, device="cpu", dtype=None, batch_ms: float = 0.0, item_ms: float = 0.0):
    """Upper-cases strings. Each batch sleeps ``batch_ms`` plus ``item_ms`` per input, the cost
    shape of an accelerator's forward pass (a fixed launch cost, a small per-item cost)."""

    def call(inputs: list, suffix: str = "") -> list:
        delay = batch_ms + item_ms * len(inputs)
        if delay:
            time.sleep(delay / 1000.0)
        return [str(text).upper() + suffix for text in inputs]

    return call


def fail_on_load(model=None, device="cpu", dtype=None, message: str = "this loader always fails"):
    """A loader that raises."""
    raise RuntimeError(message)


def allocate_on_load(model=None, device="cpu", dtype=None, megabytes: int = 1 << 20):
    """A loader that tries to hold ``megabytes`` of memory (to be capped with ``max_memory_mb``)."""
    hoard = bytearray(megabytes * 1024 * 1024)
    return lambda inputs: [len(hoard)] * len(inputs)


def fail_on_input(model=None, device="cpu", dtype=None, poison: str = "boom"):
    """Echoes its inputs, but a batch containing ``poison`` raises ValueError."""

    def call(inputs: list) -> list:
        if poison in inputs:
            raise ValueError(f"poisoned input {poison!r}")
        return list(inputs)

    return call


def crash_on_input(model=None, device="cpu", dtype=None, trigger: str = "crash"):
    """Echoes its inputs, but kills its own process (SIGKILL) when it sees ``trigger``: a model
    whose kernel crashes the host."""

    def call(inputs: list) -> list:
        if trigger in inputs:
            os.kill(os.getpid(), signal.SIGKILL)
        return list(inputs)

    return call


def crash_on_load(model=None, device="cpu", dtype=None):
    """A loader that kills its own process (SIGKILL), like the kernel's OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # not reached


def _wait_while_held(gate: str, count: int) -> None:
    """The gate's hold on the ``count``-th pass: wait while ``<gate>/hold-<count>`` exists."""
    hold = os.path.join(gate, f"hold-{count}")
    while os.path.exists(hold):
        time.sleep(0.01)


def gated_causal_lm(model=None, device="cpu", dtype=None, gate: str = "", **options):
    """``loaders:causal_lm`` whose forward passes can be held, so that a test sees what happens
    between two tokens by events, not by timing: before its n-th forward pass (1: the first
    batch's prefill) the model waits while the file ``<gate>/hold-<n>`` exists, and it appends a
    line to ``<gate>/calls`` at every pass. Where ``<gate>/fail-<n>`` exists, the n-th pass
    removes it and raises instead (a model's error mid-batch, as a GPU's out-of-memory is)."""
    from .causal import load_causal_lm

    lm = load_causal_lm(model, device=device, dtype=dtype, **options)
    network = lm.model
    forward = network.forward
    count = 0

    def gated(*args, **kwargs):
        nonlocal count
        count += 1
        _wait_while_held(gate, count)
        with open(os.path.join(gate, "calls"), "a") as calls:
            calls.write(f"{count}\n")
        fail = os.path.join(gate, f"fail-{count}")
        if os.path.exists(fail):
            os.unlink(fail)
            raise RuntimeError(f"forward pass {count} failed ({fail} said so)")
        return forward(*args, **kwargs)

    network.forward = gated
    return lm


def gated_vectors(model=None, device="cpu", dtype=None, gate: str = ""):
    """Embeddings of a kind (each string's length and its count of vowels) whose batches can be
    held like ``gated_causal_lm``'s forward passes: before its n-th batch it waits while the file
    ``<gate>/hold-<n>`` exists, and it appends each input it computes to ``<gate>/inputs``, one a
    line, so that a test sees which inputs were computed at all. ``"overflow"`` gets ``[NaN, 0]``."""
    count = 0

    def call(inputs: list) -> list:
        nonlocal count
        count += 1
        _wait_while_held(gate, count)
        with open(os.path.join(gate, "inputs"), "a") as computed:
            computed.writelines(f"{text}\n" for text in inputs)
        # "overflow": a vector that is no number (what a float16 overflow makes).
        return [
            [float("nan"), 0.0] if text == "overflow" else [float(len(text)), float(sum(c in "aeiou" for c in text))]
            for text in inputs
        ]

    return call


def listed_vectors(model=None, device="cpu", dtype=None, vectors: dict | None = None):
    """Embeddings looked up: each input's vector is ``vectors[input]`` (given in the model's
    ``options``), ``[0.0]`` for any other input. Values no real model makes on demand (beyond
    float32's range) for the routes' tests."""
    table = dict(vectors or {})

    def call(inputs: list) -> list:
        return [list(table.get(text, [0.0])) for text in inputs]

    return call


def causal_lm_on_cpu(model=None, device="cpu", dtype=None, **options):
    """The causal-LM loader on the CPU whatever device is declared: a model declared on a
    (virtual) GPU, so that the ledger holds its ``vram_mb`` there, on a host without one."""
    from .loaders import causal_lm

    return causal_lm(model, device="cpu", dtype=dtype, **options)
