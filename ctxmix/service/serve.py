"""`python -m ctxmix serve`: start the dashboard with the settings its mode needs.

Local mode listens on 127.0.0.1 only. Hosted mode (`--hosted`, CTXMIX_HOSTED, `hosted = true`
in the secrets file, or any password) refuses to start without a login, and passes Streamlit
the server-wide upload cap, error pages without details, and XSRF protection. A container or a
public server runs `ctxmix serve --hosted --address 0.0.0.0` behind a proxy (README, "Security
model"). Streamlit itself is started as a subprocess: nothing here imports it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ctxmix.errors import BadInput
from ctxmix.service.limits import hosted_mode, load_limits, login_configured, read_secrets


def serve_plan(
    hosted_flag: bool = False,
    address: str | None = None,
    port: int = 8501,
    env: dict | None = None,
    secrets: dict | None = None,
    app: Path | None = None,
) -> dict:
    """What `serve` would run: {"command", "env", "hosted", "enforced" (lines to print)}; a
    BadInput when hosted mode has no login."""
    env = dict(os.environ if env is None else env)
    secrets = read_secrets() if secrets is None else secrets
    hosted = hosted_flag or hosted_mode(env, secrets)
    if not 1 <= int(port) <= 65535:
        raise BadInput(f"--port must be 1-65535, got {port}")
    if hosted and not login_configured(env, secrets):
        raise BadInput(
            "hosted mode needs a login: set CTXMIX_PASSWORD, or `password` or an [auth] (OIDC) section "
            "in .streamlit/secrets.toml; refusing to start an open server"
        )
    lim = load_limits(hosted, secrets)
    address = address or "127.0.0.1"
    if app is None:
        from ctxmix_dashboard import APP as app  # the dashboard ships beside ctxmix, in the same wheel
    settings = {
        "server.address": address,
        "server.port": str(int(port)),
        "server.headless": "true",
        "server.maxUploadSize": str(lim.server_upload_mb),
        "server.enableXsrfProtection": "true",
        "server.fileWatcherType": "none",  # as .streamlit/config.toml: a checkout's app.py would watch it all
        "client.showErrorDetails": "none" if hosted else "type",
        "browser.gatherUsageStats": "false",
        # what .streamlit/config.toml says, so an installed ctxmix started from any folder looks the same
        "theme.base": "light",
        "client.showSidebarNavigation": "false",
    }
    cmd = [sys.executable, "-m", "streamlit", "run", str(app)] + [f"--{k}={v}" for k, v in settings.items()]
    if hosted:
        env["CTXMIX_HOSTED"] = "1"  # the pages read the mode from here too
    how = "password" if (env.get("CTXMIX_PASSWORD") or secrets.get("password")) else "OIDC ([auth])"
    enforced = [f"ctxmix {'hosted' if hosted else 'local'} mode on http://{address}:{int(port)}"]
    if hosted:
        enforced += [
            f"login: {how}",
            f"uploads: {lim.max_upload_mb:g} MB (text), {lim.max_archive_mb:g} MB (archives); "
            f"server-wide {lim.server_upload_mb} MB",
            f"caps: {lim.max_tokens} tokens per sequence, {lim.max_sequences} sequences and "
            f"{lim.max_job_tokens} tokens per job, {lim.max_concurrent_jobs} jobs at once",
            "models: the allow-list only; errors: messages without details; XSRF protection on",
        ]
    else:
        enforced += [
            "no login: reachable from this machine only"
            if address in ("127.0.0.1", "localhost", "::1")
            else f"WARNING: no login and listening on {address}: anyone who reaches it can use it "
            "(use --hosted with a password to share)"
        ]
    return {"command": cmd, "env": env, "hosted": hosted, "enforced": enforced}


def cmd_serve(args) -> None:
    plan = serve_plan(args.hosted, args.address, args.port)
    for line in plan["enforced"]:
        print(line, file=sys.stderr)
    if args.dry_run:
        print(" ".join(plan["command"]))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # become Streamlit (same process): a SIGTERM from a supervisor or a container stops the server
    # itself, where a launcher waiting on a child would die and leave the server running
    os.execve(plan["command"][0], plan["command"], plan["env"])


def add_serve_arguments(s) -> None:
    s.add_argument("--hosted", action="store_true", help="shared server: login, caps, allow-list (also CTXMIX_HOSTED)")
    s.add_argument("--address", default=None, help="interface to listen on (default 127.0.0.1; 0.0.0.0 in a container)")
    s.add_argument("--port", type=int, default=8501)
    s.add_argument("--dry-run", action="store_true", help="print the settings and the command, start nothing")
