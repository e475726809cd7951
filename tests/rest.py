"""Spec bodies and submission over the REST API, for the tests that drive a pytest-jupyter server."""

from __future__ import annotations

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
CRASH = "jupyter_evalsched.examples.basic:crash"
NOOP = "jupyter_evalsched.examples.basic:noop"


def spec(entry=SLEEPY, vram=0, episodes=1, sleep_s=0.05, **kw):
    """A spec body; ``scheduling`` given here is merged over ``{"marginal_vram_mb": vram}``."""
    body = {
        "entrypoint": entry,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "scheduling": {"marginal_vram_mb": vram},
    }
    body["scheduling"].update(kw.pop("scheduling", {}))
    body.update(kw)
    return body


async def submit(api, body):
    code, rec = await api("POST", "runs", body)
    assert code == 201, rec
    return rec
