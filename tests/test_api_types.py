"""The Lab extension's REST types (labextension/src/generated/api-types.ts) match the server's
OpenAPI document: regenerated in memory and compared with the committed file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api_types", REPO / "scripts" / "gen_api_types.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_api_types_are_fresh() -> None:
    gen = _generator()
    committed = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    assert committed == gen.generate(), (
        "labextension/src/generated/api-types.ts is stale: run scripts/gen_api_types.py "
        "(PYTHONPATH=. python scripts/gen_api_types.py) and commit it"
    )


def test_generated_types_cover_the_records() -> None:
    text = _generator().generate()
    for name in ("IRunRecord", "ILeaseRecord", "ILedger", "ILedgerDevice", "IQueueView", "ISweepView", "IComparison"):
        assert f"export interface {name} {{" in text, name
    # Responses carry their defaults (required); requests may leave them out (optional).
    assert "  state: 'queued' | 'running'" in text
    assert "  reason: string | null;" in text
