"""``ctx.log``: the eval's logger, a ``logging.Logger`` that can also be called.

Imported on the first ``ctx.log`` only (``logging`` is not on the runner's start-up path).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, cast

EVAL_LOGGER_NAME = "jupyter_evalsched.eval"


class EvalLogger(logging.Logger):
    """A Logger whose call logs at INFO: ``ctx.log("done %d", n)`` is ``ctx.log.info("done %d", n)``."""

    def __call__(self, msg: object, *args: object, **kwargs: Any) -> None:
        if self.isEnabledFor(logging.INFO):
            # stacklevel + 1: the caller's file and line, not this method's.
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
            self._log(logging.INFO, msg, args, **kwargs)


def make_eval_logger() -> EvalLogger:
    """The logger named ``jupyter_evalsched.eval``: INFO and up to stderr (the run's ``stderr.log``).

    It is the one ``logging.getLogger`` gives for that name, made callable in place (its class
    swapped for a subclass that only adds ``__call__``), so configuring it by name still works.
    """
    logger = logging.getLogger(EVAL_LOGGER_NAME)
    if not isinstance(logger, EvalLogger):
        base = type(logger)  # logging.Logger, or a class set with logging.setLoggerClass
        logger.__class__ = EvalLogger if base is logging.Logger else type("EvalLogger", (EvalLogger, base), {})
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [pid %(process)d] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return cast(EvalLogger, logger)
