"""A live run's own API key on the OpenAI routes of a server whose operator configured their own
authorizer, one that, as JupyterHub's does, reads what its identity provider puts in its users
(their scopes). A run's key names no such user: it is authorized by the key, on these routes
only, not handed to that authorizer (which raised on it: a 500 for every request of the run)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from jupyter_server.auth import Authorizer, IdentityProvider, User
from jupyter_server.utils import ensure_async
from rest import spec, submit

from jupyter_evalsched.openai_keys import run_key


@dataclasses.dataclass
class ScopedUser(User):
    scopes: frozenset[str] = frozenset()


class ScopedIdentityProvider(IdentityProvider):
    """Jupyter's token login, whose users carry the scopes a hub would have granted them."""

    async def get_user(self, handler):
        user = await ensure_async(super().get_user(handler))
        if user is None:
            return None
        return ScopedUser(**dataclasses.asdict(user), scopes=frozenset({"access:servers"}))


class ScopesAuthorizer(Authorizer):
    """Reads the scopes of its identity provider's users, as JupyterHub's authorizer reads
    ``user.hub_user``: any other user fails here."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return "access:servers" in user.scopes


@pytest.fixture
def jp_server_config(runs_dir, gpu_processes_file):
    return {
        "ServerApp": {
            "jpserver_extensions": {"jupyter_evalsched": True},
            "identity_provider_class": ScopedIdentityProvider,
            "authorizer_class": ScopesAuthorizer,
        },
        "EvalSchedApp": {
            "runs_dir": str(runs_dir),
            "virtual_gpus": [24000],
            "virtual_gpu_processes": str(gpu_processes_file),
            "reconcile_interval_s": 0.5,
            "progress_interval_s": 0.05,
            "freeze_startup_objects": False,
            "models": [{"name": "upper", "loader": "jupyter_evalsched.shared_models.testing:upper"}],
        },
    }


async def test_a_runs_key_is_authorized_by_the_key_not_the_configured_authorizer(jp_fetch, jp_serverapp, api, wait_for):
    async def models(key: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = await jp_fetch("evalsched", "v1", "models", headers=headers, raise_error=False)
        return resp.code, json.loads(resp.body)

    code, listed = await models()  # the server's own token, its user scoped
    assert code == 200 and [m["id"] for m in listed["data"]] == ["upper"], listed

    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    run = await submit(api, spec(sleep_s=60, models=["upper"]))  # (a key answers for its models only)
    await wait_for(run["id"], states=("running",))
    key = run_key(app.model_host.api_secret, run["id"])
    code, listed = await models(key)
    assert code == 200 and [m["id"] for m in listed["data"]] == ["upper"], listed

    # Its key is good on these routes only, and while the run runs.
    resp = await jp_fetch("evalsched", "runs", headers={"Authorization": f"Bearer {key}"}, raise_error=False)
    assert resp.code == 403
    code, _ = await api("POST", f"runs/{run['id']}/cancel")
    await wait_for(run["id"], states=("cancelled",))
    code, answer = await models(key)
    assert code == 403 and answer["error"]["type"] == "permission_error", answer
