"""Python client of the ``/evalsched/`` REST API, used by the magics, the widget and the CLI.

One concept per module:

- :mod:`.errors`: what the client raises (all :class:`EvalSchedClientError`);
- :mod:`.discovery`: finding the server (arguments, ``EVALSCHED_URL``, the runtime directory);
- :mod:`.spec`: the submit flags shared by the CLI and the magics, spec files;
- :mod:`.rest_client`: :class:`EvalSchedClient`, the REST calls over ``urllib``;
- :mod:`.events`: :class:`EventStream`, the ``/evalsched/events`` WebSocket;
- :mod:`.live_feed`: :class:`LiveFeed`, events with polling fallback, and what it tracks;
- :mod:`.handle`: :class:`RunHandle`, one run;
- :mod:`.log_reader`: :class:`LogReader`, what is new in a run's log at each read;
- :mod:`.sweep`: :class:`SweepHandle`, one sweep and its runs;
- :mod:`.progress`: how ``wait()`` shows progress (text, or a widget registered by the notebook side);
- :mod:`.local_server`: :class:`LocalServer`, a private server for the demo and the tests;
- :mod:`.formatting`: times, durations and metrics as text.

Cheap to import (a kernel or a CLI call pays for it): the standard library only; the WebSocket
libraries are imported when a stream opens. Nothing here imports the widget, the magics or the CLI.
"""

from ..contract import TERMINAL_STATES
from .discovery import discover_server, running_servers
from .errors import (
    EvalSchedClientError,
    EvalSchedError,
    EventStreamClosed,
    ServerNotFound,
    SpecError,
    WaitTimeout,
)
from .events import EventStream
from .formatting import elapsed_s, format_duration, format_metrics, metric_means, parse_time
from .handle import RunHandle
from .live_feed import LiveFeed, QueueTracker, RunTracker
from .local_server import LocalServer
from .log_reader import LogReader
from .progress import ProgressReporter, TextProgress, register_notebook_progress
from .rest_client import EvalSchedClient
from .spec import (
    SPEC_FILE_SUFFIXES,
    SPEC_FLAGS,
    SWEEP_FLAGS,
    apply_spec_options,
    load_spec_file,
    parse_param,
    sweep_from_options,
)
from .sweep import SweepHandle

__all__ = [
    "TERMINAL_STATES",
    "EvalSchedClientError",
    "ServerNotFound",
    "EvalSchedError",
    "SpecError",
    "WaitTimeout",
    "EventStreamClosed",
    "EvalSchedClient",
    "EventStream",
    "LiveFeed",
    "RunTracker",
    "QueueTracker",
    "RunHandle",
    "LogReader",
    "SweepHandle",
    "ProgressReporter",
    "TextProgress",
    "register_notebook_progress",
    "LocalServer",
    "SPEC_FLAGS",
    "SWEEP_FLAGS",
    "sweep_from_options",
    "SPEC_FILE_SUFFIXES",
    "apply_spec_options",
    "load_spec_file",
    "parse_param",
    "discover_server",
    "running_servers",
    "parse_time",
    "elapsed_s",
    "format_duration",
    "metric_means",
    "format_metrics",
]
