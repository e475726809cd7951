"""IPython magics: ``%eval_submit``, ``%%eval_submit``, ``%eval_sweep``, ``%%eval_sweep``,
``%eval_queue``, ``%eval_lease`` and ``%eval_release``.

Load with ``%load_ext jupyter_evalsched``. Errors (no server, invalid spec, a run that can never
fit) raise IPython's ``UsageError`` with one line, ``eval_submit: 422: ...``: IPython shows it as that
line without a traceback (which would only hide the message) and stops the cell, so that its next
line (``h.wait()``) never runs on a handle that does not exist; ``except UsageError`` catches it.
"""

from __future__ import annotations

import ast
import os
import shlex
import sys
from typing import Any, NoReturn

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from .client import (
    SPEC_FILE_SUFFIXES,
    SPEC_FLAGS,
    SWEEP_FLAGS,
    EvalSchedClient,
    EvalSchedClientError,
    RunHandle,
    SpecError,
    SweepHandle,
    apply_spec_options,
    load_spec_file,
    sweep_from_options,
)
from .client.spec import did_you_mean
from .contract import EVAL_SOURCE_FILE, LEASE_ENDED

__all__ = ["EvalSchedMagics", "load_ipython_extension", "unload_ipython_extension"]


def _parse(magic_func, line: str):
    """Parse the magic's flags with POSIX shell quoting (IPython's own splitter keeps the quotes,
    so ``--param cfg='{"a": 1}'`` or ``--name "my run"`` would arrive quoted)."""
    try:
        argv = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"cannot split the arguments: {e}") from None
    parser = magic_func.parser
    try:
        return parser.parse_args(argv)  # MagicArgumentParser raises UsageError itself
    except UsageError as e:
        raise UsageError(did_you_mean(str(e), parser._option_string_actions)) from None


def _refuse(magic: str, message: object) -> NoReturn:
    """Stop the cell with ``magic: message``: one line, no traceback, the cause not chained."""
    raise UsageError(f"{magic}: {message}") from None


def cell_problem(cell: str, function: str = "episode") -> str | None:
    """Why the cell, as a run's ``eval.py``, would fail as soon as it is admitted (maybe hours
    later), or None: it does not compile, or nothing at its top level binds ``function`` (a
    ``def``, an assignment, an import, a ``match`` pattern). Compiled only, never run. A cell
    that may bind names in ways not told here (``globals()[...] = ``, ``exec``, ``setattr``, a
    module ``__getattr__``) passes."""
    try:
        tree = ast.parse(cell, EVAL_SOURCE_FILE)
        compile(tree, EVAL_SOURCE_FILE, "exec", dont_inherit=True)  # what only the compiler says (return outside a def)
    except SyntaxError as e:
        return f"the cell does not compile: {EVAL_SOURCE_FILE}{f' line {e.lineno}' if e.lineno else ''}: {e.msg}"
    except ValueError as e:  # a lone surrogate, or a NUL byte before Python 3.12
        return f"the cell does not compile: {e}"
    except (RecursionError, MemoryError):  # the compiler's limits: `1+1+...`, `- - - 1` thousands deep
        return f"the cell does not compile: {EVAL_SOURCE_FILE}: too deeply nested to compile"
    names = _top_level_names(tree)
    if names is None or function in names or "__getattr__" in names:  # (PEP 562: getattr(module, name))
        return None
    return f"the cell defines no {function}(ctx, index) at its top level: the run's entrypoint is {EVAL_SOURCE_FILE}:{function}"


# Calls that may bind any name in the module's namespace: ``globals()["episode"] = f``,
# ``vars()[...]``, ``exec("def episode...")``, ``setattr(sys.modules[__name__], ...)``.
_BINDS_ANY_NAME = frozenset({"globals", "vars", "locals", "exec", "eval", "setattr"})


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds at its top level (in if/try/with/for/match blocks too), or None
    when it may bind any (``import *``, a ``global`` statement, a call of ``globals()``, ``exec``
    and the like, a ``__dict__``): then it cannot be told here."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Global) or (isinstance(node, ast.ImportFrom) and node.names[0].name == "*"):
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BINDS_ANY_NAME:
            return None
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            return None
    names: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # its body is a scope of its own
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:  # case episode: / case [*episode]:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:  # case {**episode}:
            names.add(node.rest)
        if not isinstance(node, ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return names


def _spec_flags(func):
    # Added in reverse because decorators stack bottom-up: the help then lists them in order.
    for args, kwargs in reversed(SPEC_FLAGS):
        func = magic_arguments.argument(*args, **kwargs)(func)
    return func


def _sweep_flags(func):
    for args, kwargs in reversed(SWEEP_FLAGS):
        func = magic_arguments.argument(*args, **kwargs)(func)
    return func


@magics_class
class EvalSchedMagics(Magics):
    """Submit evaluation runs to the host's scheduler and watch its queue."""

    def __init__(self, shell=None, client: EvalSchedClient | None = None):
        super().__init__(shell)
        self._client = client
        self._client_key: tuple | None = None
        self._leases: list[Any] = []  # what %eval_lease took, for %eval_release

    @property
    def client(self) -> EvalSchedClient:
        """The client in use; set it to point the magics at a given server."""
        # Re-discover when EVALSCHED_URL/TOKEN change in the kernel (os.environ[...] = ...).
        key = (os.environ.get("EVALSCHED_URL"), os.environ.get("EVALSCHED_TOKEN"))
        if self._client is None or (self._client_key is not None and key != self._client_key):
            self._client = EvalSchedClient()
            self._client_key = key
        return self._client

    @client.setter
    def client(self, value: EvalSchedClient | None) -> None:
        self._client = value
        self._client_key = None

    # ------------------------------------------------------------------ %eval_submit

    @line_cell_magic
    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "target",
        nargs="?",
        metavar="ARG",
        help="line form only: a .json/.yaml spec file, else the name of a dict spec in the "
        "namespace, else an entrypoint ('pkg.module:function' or 'path/file.py:function')",
    )
    @_spec_flags
    @magic_arguments.argument("--out", metavar="VAR", help="also store the run handle in the variable VAR")
    def eval_submit(self, line: str, cell: str | None = None) -> RunHandle:
        """Submit an evaluation run to the host's scheduler and return its handle.

        Line form::

            %eval_submit jupyter_evalsched.examples.basic:sleepy --episodes 5 --param sleep_s=0.2
            %eval_submit spec.yaml --priority high
            %eval_submit my_spec --vram 16000 --out h      # my_spec: a dict in the namespace

        Cell form: the cell is the eval's source, saved as the run's ``eval.py``; the entrypoint
        is ``eval.py:episode``::

            %%eval_submit --episodes 3 --param k=2
            def episode(ctx, index):
                return {"score": index * ctx.params["k"]}

        Flags override what the spec file or dict says; ``--depends-on``, ``--model`` and
        ``--param`` add to it. ``--depends-on`` takes a run id or the name of a run handle
        variable (``--depends-on h``). ``cwd`` is the kernel's working directory unless the spec sets it.
        Both forms return a handle (``h = _`` works after the cell form) with ``id``, ``run_dir``,
        ``status()``, ``record()``, ``wait(timeout=None)``, ``summary()``, ``episodes()``,
        ``logs(stream="stdout", tail=None)`` and ``cancel()``; displaying it shows live progress.
        """
        args = _parse(self.eval_submit, line)
        try:
            if args.out is not None and not args.out.isidentifier():
                raise SpecError(f"--out expects a variable name, got {args.out!r}")
            spec = self._spec(args, cell, "eval_submit")
            handle = self.client.handle(self.client.submit(spec))
        except EvalSchedClientError as e:
            _refuse("eval_submit", e)
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = handle
        return handle

    # ------------------------------------------------------------------ %eval_sweep

    @line_cell_magic
    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "target",
        nargs="?",
        metavar="ARG",
        help="line form only: a .json/.yaml spec file, a dict spec in the namespace, or an entrypoint",
    )
    @_sweep_flags
    @_spec_flags
    @magic_arguments.argument("--out", metavar="VAR", help="also store the sweep handle in the variable VAR")
    def eval_sweep(self, line: str, cell: str | None = None) -> SweepHandle:
        """Submit one run per point of a sweep and return the sweep's handle.

        Line form::

            %eval_sweep jupyter_evalsched.examples.basic:accuracy_toy --sweep skill=0.3,0.6,0.9
            %eval_sweep spec.yaml --sweep-points '[{"k": 1}, {"k": 5, "temperature": 0.2}]'

        Cell form (the cell is the eval's source, ``eval.py:episode``)::

            %%eval_sweep --sweep skill=0.3,0.6,0.9 --episodes 20
            def episode(ctx, index):
                ...

        ``--sweep PARAM=V1,V2`` (repeatable) makes a grid, every combination; ``--sweep-points``
        a list of points. Each run's params are the spec's updated with its point. The handle has
        ``runs``, ``wait()`` (one progress bar), ``cancel()`` and ``compare()``.
        """
        args = _parse(self.eval_sweep, line)
        try:
            if args.out is not None and not args.out.isidentifier():
                raise SpecError(f"--out expects a variable name, got {args.out!r}")
            sweep = sweep_from_options(args)
            if sweep is None:
                raise SpecError("%eval_sweep needs --sweep PARAM=V1,V2,... or --sweep-points JSON")
            spec = self._spec(args, cell, "eval_sweep")
            handle = self.client.sweep_handle(self.client.submit_sweep(spec, sweep))
        except EvalSchedClientError as e:
            _refuse("eval_sweep", e)
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = handle
        return handle

    def _spec(self, args: Any, cell: str | None, magic: str) -> dict:
        """The spec of ``%magic ARG`` (a spec file, a dict spec or an entrypoint) or of
        ``%%magic`` (the cell is the eval's source), with the flags applied."""
        self._resolve_handles(args)
        if cell is not None:
            if args.target is not None:
                raise SpecError(f"%%{magic} takes flags only: the cell is the eval's source (got ARG {args.target!r})")
            if not cell.strip():
                raise SpecError(f"%%{magic}: the cell is empty; it should define episode(ctx, index)")
            problem = cell_problem(cell)
            if problem:
                raise SpecError(f"%%{magic}: {problem}")
            base: dict = {"source": cell}
        else:
            if args.target is None:
                raise SpecError(f"%{magic} needs ARG: a spec file, a dict spec or an entrypoint")
            base = self._resolve_target(args.target)
        return apply_spec_options(base, args, default_cwd=os.getcwd())

    def _resolve_target(self, target: str) -> dict:
        if target.endswith(SPEC_FILE_SUFFIXES):
            return load_spec_file(os.path.expanduser(target))
        ns = self.shell.user_ns if self.shell is not None else {}
        if target.isidentifier() and target in ns:
            value = ns[target]
            if isinstance(value, dict):
                return dict(value)
            raise SpecError(f"{target} is a {type(value).__name__}, not a dict spec")
        if ":" in target:
            return {"entrypoint": target}
        if target.isidentifier():
            raise SpecError(
                f"{target!r} is neither a spec file, a dict in the namespace, "
                "nor an entrypoint ('pkg.module:function' or 'path/file.py:function')"
            )
        raise SpecError(f"{target!r} is not a spec file (.json, .yaml), a dict spec or an entrypoint")

    def _resolve_handles(self, args: Any) -> None:
        """``--depends-on h1`` where ``h1`` is a run handle in the namespace means its id (a
        sweep handle: its runs' ids)."""
        if not args.depends_on or self.shell is None:
            return
        resolved: list[str] = []
        for value in args.depends_on:
            obj = self.shell.user_ns.get(value) if value.isidentifier() else None
            if isinstance(obj, SweepHandle):  # every run of the sweep
                resolved.extend(r.id for r in obj.runs)
            else:
                resolved.append(obj.id if isinstance(obj, RunHandle) else value)
        args.depends_on = resolved

    # ------------------------------------------------------------------ %eval_queue

    @line_magic
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--out", metavar="VAR", help="also store the widget in the variable VAR")
    @magic_arguments.argument(
        "--poll",
        action="store_true",
        help="poll REST instead of using the event stream (e.g. behind a proxy that drops WebSockets)",
    )
    def eval_queue(self, line: str) -> None:
        """Show the host's evaluation queue as a live widget: running runs with progress and
        metrics, queued runs in admission order with their reasons, recently finished runs, one
        VRAM bar per GPU and a cancel button per run. ``close()`` on the widget stops its updates.
        """
        args = _parse(self.eval_queue, line)
        if args.out is not None and not args.out.isidentifier():
            _refuse("eval_queue", f"--out expects a variable name, got {args.out!r}")
        try:
            from .widget import QueueWidget

            widget = QueueWidget(self.client, use_events=not args.poll)
        except ImportError as e:
            _refuse("eval_queue", f"ipywidgets is needed ({e}): pip install ipywidgets, then restart the kernel")
        except EvalSchedClientError as e:
            _refuse("eval_queue", e)
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = widget
        from IPython.display import display

        display(widget)
        return None

    # ------------------------------------------------------------------ %eval_lease, %eval_release

    @line_magic
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("vram", metavar="MB", nargs="?", type=int, default=0, help="VRAM per GPU, in MB")
    @magic_arguments.argument("--gpus", type=int, default=1, metavar="N", help="GPUs to lease (default 1)")
    @magic_arguments.argument(
        "--exclusive", action="store_true", help="whole GPUs, nothing else on them (the interactive lock)"
    )
    @magic_arguments.argument("--ttl", type=float, metavar="SECONDS", help="end the lease this long after its grant")
    @magic_arguments.argument("--label", help="shown in the ledger (default: the notebook's name)")
    @magic_arguments.argument("--priority", choices=["high", "normal", "low"], default="high", help="default high")
    @magic_arguments.argument("--timeout", type=float, metavar="SECONDS", help="give up waiting after this long")
    @magic_arguments.argument("--out", metavar="VAR", help="also store the lease in the variable VAR")
    def eval_lease(self, line: str):
        """Hold VRAM for this kernel in the host's ledger before loading a model, and wait until it is
        granted (interrupt the kernel to give up)::

            %eval_lease 14000                 # 14000 MB on one GPU
            %eval_lease --exclusive --ttl 3600

        Granted before CUDA starts in the kernel, ``CUDA_VISIBLE_DEVICES`` is set so that ``cuda:0``
        is the first lease's GPU (a later lease's is added after it: use ``cuda_device``). The lease ends with ``%eval_release``, when the kernel exits, or after
        ``--ttl``. Returns the lease (``id``, ``devices``, ``cuda_device``, ``release()``).
        """
        args = _parse(self.eval_lease, line)
        if args.out is not None and not args.out.isidentifier():
            _refuse("eval_lease", f"--out expects a variable name, got {args.out!r}")
        from .client.lease import lease

        try:
            held = lease(
                args.vram,
                gpus=args.gpus,
                exclusive_gpu=args.exclusive,
                timeout=args.timeout,
                label=args.label,
                priority=args.priority,
                ttl_s=args.ttl,
                client=self.client,
            )
        except KeyboardInterrupt:
            # Stops the cell too: its next line would load a model onto a GPU without the lease.
            _refuse("eval_lease", "stopped waiting; the request was withdrawn")
        except EvalSchedClientError as e:
            _refuse("eval_lease", e)
        self._leases.append(held)
        print(
            f"lease {held.id}: {held.record.get('vram_mb')} MB on GPU {', '.join(map(str, held.devices))}"
            + (f"; {held.note}" if held.note else "")
        )
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = held
        return held

    @line_magic
    def eval_release(self, line: str) -> None:
        """End this kernel's leases (``%eval_release``: those ``%eval_lease`` took and every other
        live lease of this kernel's process), or those named (``%eval_release LEASE_ID ...``)."""
        from .client.lease import looks_like_lease_id

        try:
            wanted = shlex.split(line)
        except ValueError as e:
            _refuse("eval_release", f"cannot split the arguments: {e}")
        for item_id in wanted:
            if not looks_like_lease_id(item_id):
                _refuse("eval_release", f"{item_id!r} is not a lease id (lease-...)")
        try:
            held = self._leases_to_release(wanted)
        except EvalSchedClientError as e:  # no server to find, or it cannot list the leases
            _refuse("eval_release", e)
        if not held:  # nothing to end is no failure: a last cell that releases may run twice
            print("eval_release: this kernel holds no lease", file=sys.stderr)
            return None
        failed: list[str] = []
        for item in held:
            try:
                before = item.refresh()
                if before.get("state") == LEASE_ENDED:
                    print(f"lease {item.id}: already ended ({before.get('reason') or 'no reason given'})")
                else:
                    item.release()
                    print(f"lease {item.id}: released")
            except EvalSchedClientError as e:  # the others are still released first
                failed.append(str(e))
            if item in self._leases:
                self._leases.remove(item)
        if failed:
            _refuse("eval_release", "; ".join(failed))
        return None

    def _leases_to_release(self, wanted: list[str]) -> list[Any]:
        """The leases named (those %eval_lease took as they are), or with no name this kernel's:
        what %eval_lease took and the live leases whose pid is this process (``lease()``'s)."""
        from .client.lease import Lease

        known = {h.id: h for h in self._leases}
        if wanted:
            return [known.get(i) or Lease(self.client, {"id": i, "state": "granted"}) for i in dict.fromkeys(wanted)]
        self._leases = [h for h in self._leases if h.record.get("state") != LEASE_ENDED]  # released otherwise
        held = list(self._leases)
        mine = [rec for rec in self.client.request("GET", "leases")["leases"] if rec.get("pid") == os.getpid()]
        return held + [Lease(self.client, rec) for rec in mine if rec.get("id") not in known]


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(EvalSchedMagics)
    try:
        # Importing the widget module registers it as the notebook's view of runs (handles,
        # wait()'s progress); without ipywidgets, runs show as text.
        from . import widget  # noqa: F401
    except ImportError:
        pass


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.pop("EvalSchedMagics", None)
    for kind in ("line", "cell"):
        table = ipython.magics_manager.magics[kind]
        for name in ("eval_submit", "eval_sweep", "eval_queue", "eval_lease", "eval_release"):
            bound = table.get(name)
            if magics is not None and getattr(bound, "__self__", None) is magics:
                del table[name]
