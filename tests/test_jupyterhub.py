"""Issue #32 under a real JupyterHub: the Hub (as root) with configurable-http-proxy, a password
authenticator, LocalProcessSpawner starting each user's single-user server as that system user,
and the host ledger as a Hub-managed service, configured from the example the package ships
(jupyter-config/host-ledger/jupyterhub_config.py) with only its paths and user name changed.

Both users log in with their passwords, start their servers, submit runs through the Hub's proxy
(``/user/<name>/evalsched/...``), and each one's ledger names the other's holdings. Slow: a Hub,
a proxy, a service and two servers start."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
from host_ledger_users import PREFIX, REPO, assert_never_over
from host_user_servers import sleepy
from waiting import wait_until

from jupyter_evalsched.host_ledger.client import status as ledger_status

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(600)]
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
PASSWORD = "correct horse battery staple"
EXAMPLE = REPO / "jupyter-config" / "host-ledger" / "jupyterhub_config.py"
BIN = Path(sys.executable).parent
# The browser, as tests/test_lab_panel.py drives it (Debian's Chromium through Playwright).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PANEL = "#jupyter-evalsched-panel"
PANEL_TAB = '.lm-TabBar-tab[data-id="jupyter-evalsched-panel"]'
UI_TIMEOUT_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HUB_CONFIG = """
import os
c = get_config()  # noqa: F821

# The example the package ships: the host ledger as a Hub-managed service, started through runuser.
load_subconfig({example!r})
(service,) = c.JupyterHub.services
assert service["name"] == "evalsched-host-ledger"
command = service["command"]
assert command[:4] == ["runuser", "-u", "evalsched", "--"], command
# This host's names for what the example calls evalsched, /run/evalsched and /etc/evalsched.
command[2] = {ledger_user!r}
command[command.index("/run/evalsched/ledger.sock")] = {socket!r}
command[command.index("/etc/evalsched/host-ledger.json")] = {policy!r}

c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.JupyterHub.db_url = "sqlite:///{dir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{dir}/jupyterhub_cookie_secret"
c.JupyterHub.pid_file = "{dir}/jupyterhub.pid"

c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {password!r}
c.Authenticator.allowed_users = {users!r}

c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.args = ["--ServerApp.jpserver_extensions={{'jupyter_evalsched': True}}",
                  "--EvalSchedApp.reconcile_interval_s=0.5"]
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.environment = {{
    # What an admin sets for every user's server: the host ledger's socket.
    "EVALSCHED_HOST_LEDGER": {socket!r},
    "EVALSCHED_VIRTUAL_GPUS": "24000",
    "EVALSCHED_CPU_SLOTS": "4",
    "EVALSCHED_RUNS_DIR": lambda spawner: os.path.join({dir!r}, spawner.user.name, "runs"),
    "JUPYTER_RUNTIME_DIR": lambda spawner: os.path.join({dir!r}, spawner.user.name, "runtime"),
    "PYTHONPATH": {repo!r},
}}
"""


class Hub:
    def __init__(self, users) -> None:
        self.dir = tempfile.mkdtemp(prefix="evhub-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        ledger = users["ledger"]
        run_dir = os.path.join(self.dir, "run-evalsched")  # what tmpfiles.d makes: /run/evalsched
        os.mkdir(run_dir)
        os.chmod(run_dir, 0o755)  # (writable by its owner alone, or the ledger refuses it)
        os.chown(run_dir, ledger.pw_uid, ledger.pw_gid)
        self.socket = os.path.join(run_dir, "ledger.sock")
        policy = os.path.join(self.dir, "host-ledger.json")
        with open(policy, "w", encoding="utf-8") as f:
            json.dump({"virtual_gpus": [24000], "reclaim_window_s": 0}, f)
        os.chmod(policy, 0o644)
        for role in ("alice", "bob"):
            pw = users[role]
            home = os.path.join(self.dir, pw.pw_name)
            os.mkdir(home)
            os.chown(home, pw.pw_uid, pw.pw_gid)
        chp = BIN / "configurable-http-proxy"
        assert chp.exists(), f"{chp}: scripts/setup.sh installs configurable-http-proxy (npm) into the venv"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = HUB_CONFIG.format(
            example=str(EXAMPLE),
            ledger_user=ledger.pw_name,
            socket=self.socket,
            policy=policy,
            port=self.port,
            hub_port=free_port(),
            proxy_api_port=free_port(),
            chp=str(chp),
            dir=self.dir,
            password=PASSWORD,
            users={ALICE, BOB},
            singleuser=str(BIN / "jupyterhub-singleuser"),
            repo=str(REPO),
        )
        config_path = os.path.join(self.dir, "jupyterhub_config.py")
        with open(config_path, "w", encoding="utf-8") as f:
            f.write(config)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(
            [str(BIN), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        )
        env["PYTHONPATH"] = str(REPO)
        for var in (
            "EVALSCHED_URL",
            "EVALSCHED_TOKEN",
            "JPY_PARENT_PID",
            "EVALSCHED_HOST_LEDGER",
            "JUPYTERHUB_API_TOKEN",
        ):
            env.pop(var, None)
        self.log_path = os.path.join(self.dir, "hub.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", config_path],
                cwd=self.dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_until(self._up, timeout=120, interval=0.2, message=f"the Hub never answered: {self.log_tail()}")

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"the Hub exited: {self.log_tail()}"
        try:
            return requests.get(f"{self.url}/hub/api", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the Hub stops the servers, the service and the proxy
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class HubUser:
    """A user in a browser's shoes: logs in with a password (the form, its XSRF field), then
    works through the Hub's proxy with the token the Hub issues to that session."""

    def __init__(self, hub: Hub, name: str) -> None:
        self.hub, self.name = hub, name
        self.session = requests.Session()
        form = self.session.get(f"{hub.url}/hub/login", timeout=30)
        assert form.status_code == 200, form.text[:500]
        xsrf = re.search(r'name="_xsrf"\s+value="([^"]+)"', form.text)
        assert xsrf, "no _xsrf field on the Hub's login form"
        bad = self.session.post(
            f"{hub.url}/hub/login",
            data={"username": name, "password": "wrong", "_xsrf": xsrf.group(1)},
            allow_redirects=False,
            timeout=30,
        )
        assert bad.status_code == 403, bad.status_code  # the password is checked
        done = self.session.post(
            f"{hub.url}/hub/login",
            data={"username": name, "password": PASSWORD, "_xsrf": xsrf.group(1)},
            allow_redirects=False,
            timeout=30,
        )
        assert done.status_code == 302, (done.status_code, done.text[:500])
        # A token of this user, asked for by the logged-in session (as the Hub's token page does).
        made = self.session.post(
            f"{hub.url}/hub/api/users/{name}/tokens",
            json={"note": "evalsched test", "expires_in": 3600},
            headers={"X-XSRFToken": self.session.cookies.get("_xsrf", path="/hub/") or ""},
            timeout=30,
        )
        assert made.status_code == 201, (made.status_code, made.text[:500])
        self.token = made.json()["token"]
        self.headers = {"Authorization": f"token {self.token}"}

    def start_server(self) -> None:
        started = requests.post(f"{self.hub.url}/hub/api/users/{self.name}/server", headers=self.headers, timeout=60)
        assert started.status_code in (201, 202), (started.status_code, started.text[:500])

    def ready(self) -> bool:
        try:
            code, body = self.api("GET", "status")
        except requests.RequestException:
            return False
        if code != 200 or not isinstance(body, dict):  # not routed yet: the Hub's own pages answer
            return False
        return bool(body["host_ledger"]["connected"]) and body["host_ledger"]["user"] == self.name

    def api(self, method: str, path: str, body=None):
        """``/user/<name>/evalsched/<path>`` through the Hub's proxy."""
        answer = requests.request(
            method, f"{self.hub.url}/user/{self.name}/evalsched/{path}", json=body, headers=self.headers, timeout=30
        )
        try:
            return answer.status_code, answer.json()
        except ValueError:
            return answer.status_code, answer.text

    def ok(self, method: str, path: str, body=None, expect: int = 200):
        code, answer = self.api(method, path, body)
        assert code == expect, (self.name, method, path, code, answer)
        return answer


def panel_holder(chromium, hub: Hub, name: str, run_id: str) -> dict:
    """Log in as ``name`` in a fresh browser context, open Lab at /user/<name>/lab and the
    evalsched panel, and read the holder of the run's waiting reason of kind ``user``."""
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(UI_TIMEOUT_MS)
        page.goto(f"{hub.url}/hub/login", wait_until="domcontentloaded", timeout=60_000)
        page.fill("#username_input", name)
        page.fill("#password_input", PASSWORD)
        page.click("#login_submit")
        page.wait_for_url(re.compile(r".*/(hub|user)/.*"), timeout=60_000)
        page.goto(f"{hub.url}/user/{name}/lab", wait_until="domcontentloaded", timeout=120_000)
        page.wait_for_selector(PANEL, state="attached", timeout=120_000)
        page.wait_for_selector(PANEL_TAB, state="visible", timeout=60_000)
        for _ in range(5):  # the layout restorer may close the side bar our click opened
            if page.locator(PANEL).is_visible():
                break
            page.click(PANEL_TAB)
            page.wait_for_timeout(500)
        page.wait_for_selector(PANEL, state="visible")
        selector = f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"] .jp-EvalSched-reasonHolder[data-kind="user"]'
        page.wait_for_selector(selector, state="attached", timeout=60_000)
        holder = page.locator(selector).first
        return {"text": holder.inner_text().strip(), "title": holder.get_attribute("title")}
    finally:
        context.close()


@pytest.fixture
def hub(users):
    served = Hub(users)
    yield served
    served.stop()


def test_two_users_behind_a_real_jupyterhub_share_the_host_ledger_and_see_each_other_by_name(users, hub):
    # The Hub started the host ledger (its managed service) as the unprivileged ledger user.
    view = wait_until(
        lambda: os.path.exists(hub.socket) and ledger_status(hub.socket),
        timeout=60,
        message=f"the Hub-managed host ledger never answered: {hub.log_tail()}",
        ignore=(Exception,),
    )
    assert view["admin"] is True and [d["usable_mb"] for d in view["devices"]] == [24000]
    assert os.stat(hub.socket).st_uid == users["ledger"].pw_uid

    alice, bob = HubUser(hub, ALICE), HubUser(hub, BOB)
    for user in (alice, bob):
        user.start_server()
    for user in (alice, bob):
        wait_until(user.ready, timeout=180, interval=0.5, message=f"{user.name}'s server: {hub.log_tail()}")
    # (Each server joined the host ledger as its user: the kernel says so, see ``ready``.) A
    # user's token opens no other user's server.
    denied = requests.get(f"{hub.url}/user/{BOB}/evalsched/ledger", headers=alice.headers, timeout=30)
    assert denied.status_code == 403, (denied.status_code, denied.url)

    # Alice holds 14000 MB; bob holds 6000 MB: each sees the other by name, and nothing more.
    a = alice.ok("POST", "runs", sleepy(14000, 600), expect=201)
    b = bob.ok("POST", "runs", sleepy(6000, 600), expect=201)
    for user, run in ((alice, a), (bob, b)):
        wait_until(lambda: user.ok("GET", f"runs/{run['id']}")["state"] == "running", timeout=90, interval=0.2)

    def sees(user: HubUser, other: str, mb: int):
        ledger = user.ok("GET", "ledger")
        users_seen = ledger["devices"][0]["users"]
        return (
            ledger if users_seen == [{"user": other, "allocated_mb": mb, "leases": 0, "runs": 1, "models": 0}] else None
        )

    seen_by_alice = wait_until(lambda: sees(alice, BOB, 6000), timeout=60, interval=0.2)
    seen_by_bob = wait_until(lambda: sees(bob, ALICE, 14000), timeout=60, interval=0.2)
    assert seen_by_alice["devices"][0]["allocated_mb"] == 14000 and seen_by_bob["devices"][0]["allocated_mb"] == 6000
    assert a["id"] not in json.dumps(seen_by_bob) and b["id"] not in json.dumps(seen_by_alice)
    host = ledger_status(hub.socket)
    assert_never_over(host)
    assert sorted((g["user"], g["vram_mb"]) for g in host["grants"]) == [(ALICE, 14000), (BOB, 6000)]

    # Bob's next run does not fit beside alice's: it waits, naming her.
    big = bob.ok("POST", "runs", sleepy(10000, 0.1), expect=201)

    def named():
        rec = bob.ok("GET", f"runs/{big['id']}")
        assert rec["state"] == "queued", rec
        return rec if f"user {ALICE} holds 14000 MB on GPU 0" in (rec["reason"] or "") else None

    wait_until(named, timeout=60, interval=0.2, message="bob's run never named alice")
    # And alice's next one (8000 MB; 4000 MB are left) names bob.
    more = alice.ok("POST", "runs", sleepy(8000, 0.1), expect=201)
    wait_until(
        lambda: f"user {BOB} holds 6000 MB on GPU 0" in (alice.ok("GET", f"runs/{more['id']}")["reason"] or ""),
        timeout=60,
        interval=0.2,
        message="alice's run never named bob",
    )

    # Each user's panel, in Chromium, logged in through the Hub's form and served through its
    # proxy: the waiting run is held by the other user, by name.
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is not installed: run scripts/setup.sh"
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            for me, run, other, mb in ((bob, big, ALICE, 14000), (alice, more, BOB, 6000)):
                holder = panel_holder(chromium, hub, me.name, run["id"])
                assert (
                    holder["text"] == other and holder["title"].replace(",", "") == f"user {other} on GPU 0: {mb} MB"
                ), holder
        finally:
            chromium.close()

    alice.ok("POST", f"runs/{a['id']}/cancel")
    for user, run in ((bob, big), (alice, more)):
        wait_until(lambda: user.ok("GET", f"runs/{run['id']}")["state"] == "succeeded", timeout=90, interval=0.2)
    bob.ok("POST", f"runs/{b['id']}/cancel")
    wait_until(lambda: not ledger_status(hub.socket)["grants"], timeout=60, message="grants outlived their runs")
