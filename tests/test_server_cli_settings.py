"""List and dict settings given on the server's command line (``jupyter lab
--EvalSchedApp.virtual_gpus=[24000,24000]``): traitlets hands an extension's command-line values
over as strings, which these settings parse (as JSON or Python literals, or comma-separated)."""

from __future__ import annotations

import pytest


@pytest.fixture
def jp_argv():
    return [
        "--EvalSchedApp.virtual_gpus=[16000, 8000, 4000]",
        '--EvalSchedApp.usable_vram_mb={"1": 6000}',
        '--EvalSchedApp.run_env={"EVAL_FROM_CLI": "yes"}',
        "--EvalSchedApp.preload_modules=json,csv",
    ]


async def test_list_and_dict_settings_from_the_command_line(api, evalsched):
    code, ledger = await api("GET", "ledger")
    assert code == 200
    assert [(d["total_mb"], d["usable_mb"]) for d in ledger["devices"]] == [(16000, 16000), (8000, 6000), (4000, 4000)]
    assert evalsched.config.run_env == {"EVAL_FROM_CLI": "yes"}
    code, status = await api("GET", "status")
    assert status["warm_start"]["preload"] == ["json", "csv"]
