"""Names with one meaning: the pydantic types are ``schemas`` (``models`` is kept as a deprecated
alias of the same module), and the periodic reconciliation is not a "sweep"."""

from __future__ import annotations

import importlib
import subprocess
import sys


def test_the_old_module_name_is_the_schemas_module_with_a_warning():
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n    import jupyter_evalsched.models\nexcept DeprecationWarning as w:\n    print('warned:', w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "jupyter_evalsched.schemas" in out
    from jupyter_evalsched import schemas

    old = importlib.import_module("jupyter_evalsched.models")
    assert old is schemas
    assert old.EvalSpec is schemas.EvalSpec


def test_no_module_of_the_repository_imports_the_old_name():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    old = re.compile(r"from \.+models import|jupyter_evalsched\.models\b|from jupyter_evalsched import .*\bmodels\b")
    offenders = [
        str(p.relative_to(root))
        for folder in ("jupyter_evalsched", "tests", "bench", "scripts")
        for p in (root / folder).rglob("*.py")
        if p.name not in ("models.py", "test_names.py") and old.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, offenders
