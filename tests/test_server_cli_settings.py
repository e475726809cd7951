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


def test_the_old_name_of_reconcile_interval_s_still_works_and_warns():
    """``sweep_interval_s`` was renamed ``reconcile_interval_s`` (a sweep is a parameter grid): a
    configuration that sets the old name still sets the new one, with a warning in the log."""
    import logging

    from traitlets.config import Config

    from jupyter_evalsched.app import EvalSchedApp

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    kept = Kept()
    EvalSchedApp.clear_instance()
    app = EvalSchedApp(config=Config({"EvalSchedApp": {"reconcile_interval_s": 0.7}}))
    app.log.addHandler(kept)
    try:
        assert app.reconcile_interval_s == 0.7 and not kept.messages
        app.update_config(Config({"EvalSchedApp": {"sweep_interval_s": 0.25}}))
        assert app.reconcile_interval_s == 0.25
        assert any("sweep_interval_s is deprecated" in m for m in kept.messages)
    finally:
        app.log.removeHandler(kept)
    assert EvalSchedApp(config=Config({"EvalSchedApp": {"sweep_interval_s": 0.3}})).reconcile_interval_s == 0.3
