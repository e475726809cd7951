# The host ledger as a JupyterHub-managed service (the Hub starts it, and restarts it with the Hub).
# A Hub running as root starts it as the unprivileged user `evalsched` through runuser; the socket
# directory is made at boot by systemd-tmpfiles, with this line in
# /etc/tmpfiles.d/evalsched.conf:
#     d /run/evalsched 0755 evalsched evalsched -
# (A Hub not running as root: drop "runuser", "-u", "evalsched", "--" and give the directory to the
# Hub's user.)
c = get_config()  # noqa: F821

c.JupyterHub.services = [
    {
        "name": "evalsched-host-ledger",
        "command": [
            "runuser",
            "-u",
            "evalsched",
            "--",
            "jupyter",
            "evalsched",
            "host-ledger",
            "--socket",
            "/run/evalsched/ledger.sock",
            "--config",
            "/etc/evalsched/host-ledger.json",
        ],
    }
]
