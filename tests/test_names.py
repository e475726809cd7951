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


def test_no_package_module_imports_the_old_name():
    import pathlib

    package = pathlib.Path(__file__).resolve().parent.parent / "jupyter_evalsched"
    offenders = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "models.py"
        and any(
            s in p.read_text(encoding="utf-8")
            for s in ("from .models import", "from ..models import", "jupyter_evalsched.models")
        )
    ]
    assert not offenders, offenders
