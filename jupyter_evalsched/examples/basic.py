"""Example evals. Standard library only, and nothing imported at module level beyond what the
runner has already loaded, so that ``noop`` measures the runner itself.

* ``noop`` returns ``{}`` at once (turnaround benchmarks).
* ``sleepy`` sleeps ``params["sleep_s"]`` (default 0.1 s) and returns a deterministic
  ``score`` in [0, 1) derived from ``ctx.seed``.
* ``accuracy_toy`` answers a small built-in arithmetic quiz with a fake "model" that is right
  with probability ``params["skill"]`` (default 0.7), deterministically per seed.
* ``crash`` fails in the way ``params["how"]`` names (see its docstring).
"""

import os
import sys
import time


def _unit_float(seed: int) -> float:
    """A deterministic number in [0, 1) from an integer seed (splitmix64)."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def noop(ctx, index):
    return {}


def sleepy(ctx, index):
    time.sleep(float(ctx.params.get("sleep_s", 0.1)))
    return {"score": _unit_float(ctx.seed)}


# (question, answer): the quiz the toy model is graded on.
QUIZ = [
    ("2 + 2", 4),
    ("3 * 7", 21),
    ("10 - 4", 6),
    ("9 / 3", 3),
    ("5 + 8", 13),
    ("6 * 6", 36),
    ("15 - 9", 6),
    ("12 / 4", 3),
    ("7 + 6", 13),
    ("8 * 3", 24),
    ("20 - 13", 7),
    ("18 / 6", 3),
]


def accuracy_toy(ctx, index):
    """One quiz item per episode (``index`` modulo the quiz). The returned ``accuracy`` is 1.0
    or 0.0, so the run's mean is the accuracy; ``answer_length`` is a second, non-binary metric."""
    question, answer = QUIZ[index % len(QUIZ)]
    skill = float(ctx.params.get("skill", 0.7))
    roll = _unit_float(ctx.seed)
    prediction = answer if roll < skill else answer + 1 + int(roll * 10)
    return {"accuracy": float(prediction == answer), "answer_length": len(str(prediction))}


def crash(ctx, index):
    """Fail as ``params["how"]`` says, in episode ``params["at"]`` (default: the first episode
    this function runs); the other episodes sleep ``params["sleep_s"]`` (default 0) and succeed.
    With ``params["until_attempt"]``, only attempts up to that number crash (a later attempt of
    the resumed run succeeds: how retries and resume are shown).

    * ``exception``: raise RuntimeError (the runner finalizes: failed, reason ``exception``)
    * ``memoryerror``: a real allocation that cannot succeed, raising MemoryError
    * ``sys_exit``: ``sys.exit(params["code"])`` (a SystemExit: the runner finalizes as failed)
    * ``exit``: ``os._exit(params["code"])``, default 3 (not finalized: ``exit_code:3``)
    * ``segfault``: a real segmentation fault (``signal:SIGSEGV``)
    * ``sigkill``: SIGKILL to itself (``signal:SIGKILL``)
    * ``ignore_sigterm``: ignore SIGTERM, then sleep ``params["hold_s"]`` (default 300 s), so a
      cancel must escalate to SIGKILL
    * ``fork_and_exit``: fork a child that sleeps 300 s, then return ``{"child_pid": pid}``;
      the child is a stray in the run's process group
    """
    at = ctx.params.get("at")
    until_attempt = ctx.params.get("until_attempt")
    if (at is not None and index != at) or (until_attempt is not None and ctx.attempt > until_attempt):
        time.sleep(float(ctx.params.get("sleep_s", 0)))
        return {"ok": 1}
    how = ctx.params.get("how", "exception")
    if how == "exception":
        raise RuntimeError(f"crash requested in episode {index}")
    if how == "memoryerror":
        # The size cannot be allocated, so this fails at once without using the memory.
        bytearray(1 << 62)
        raise AssertionError("unreachable: a 4 EiB allocation succeeded")
    if how == "sys_exit":
        sys.exit(ctx.params.get("code", 3))
    if how == "exit":
        sys.stdout.flush()
        os._exit(int(ctx.params.get("code", 3)))
    if how == "segfault":
        import ctypes

        sys.stdout.flush()
        ctypes.string_at(0)  # reads address 0: SIGSEGV
        import signal  # not reached on Linux; kept for platforms that map page 0

        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "sigkill":
        import signal

        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "ignore_sigterm":
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(float(ctx.params.get("hold_s", 300)))
        return {"ok": 1}
    if how == "fork_and_exit":
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(300)
            finally:
                os._exit(0)
        return {"child_pid": pid}
    raise ValueError(
        f"unknown crash mode {how!r}; choose one of exception, memoryerror, sys_exit, exit, segfault, "
        f"sigkill, ignore_sigterm, fork_and_exit"
    )
