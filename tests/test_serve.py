"""`python -m ctxmix serve`: safe by default, hosted mode fails closed, one place for the caps."""

import os
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from ctxmix.errors import BadInput
from ctxmix.service.limits import HOSTED, LOCAL, hosted_mode, load_limits, read_secrets
from ctxmix.service.serve import serve_plan

ROOT = Path(__file__).resolve().parents[1]


def _settings(plan) -> dict:
    return dict(a[2:].split("=", 1) for a in plan["command"] if a.startswith("--"))


def test_local_mode_listens_on_this_machine_only():
    plan = serve_plan(env={}, secrets={})
    s = _settings(plan)
    assert not plan["hosted"] and s["server.address"] == "127.0.0.1"
    assert s["server.enableXsrfProtection"] == "true" and s["client.showErrorDetails"] != "full"
    assert s["server.maxUploadSize"] == str(LOCAL.server_upload_mb)
    assert "CTXMIX_HOSTED" not in plan["env"]


@pytest.mark.parametrize("how", ["env password", "secrets password", "hosted flag + oidc", "CTXMIX_HOSTED + password"])
def test_hosted_mode_and_what_it_passes(how):
    env, secrets, flag = {}, {}, False
    if how == "env password":
        env = {"CTXMIX_PASSWORD": "s3cret"}
    elif how == "secrets password":
        secrets = {"password": "s3cret"}
    elif how == "hosted flag + oidc":
        flag, secrets = True, {"auth": {"client_id": "x"}}
    else:
        env = {"CTXMIX_HOSTED": "1", "CTXMIX_PASSWORD": "s3cret"}
    plan = serve_plan(hosted_flag=flag, address="0.0.0.0", env=env, secrets=secrets)
    s = _settings(plan)
    assert plan["hosted"] and plan["env"]["CTXMIX_HOSTED"] == "1"  # the pages see the mode too
    assert s["client.showErrorDetails"] == "none" and s["server.enableXsrfProtection"] == "true"
    assert s["server.maxUploadSize"] == str(HOSTED.server_upload_mb)
    assert any(line.startswith("login:") for line in plan["enforced"])


@pytest.mark.parametrize("env,flag", [({"CTXMIX_HOSTED": "1"}, False), ({}, True), ({"CTXMIX_HOSTED": "yes"}, False)])
def test_hosted_mode_without_a_login_refuses_to_start(env, flag):
    with pytest.raises(BadInput, match="needs a login"):
        serve_plan(hosted_flag=flag, env=env, secrets={})


def test_any_password_means_hosted_mode():
    assert hosted_mode({"CTXMIX_PASSWORD": "x"}, {}) and hosted_mode({}, {"password": "x"})
    assert not hosted_mode({"CTXMIX_HOSTED": "0"}, {}) and not hosted_mode({}, {"hosted": False})


def test_limits_from_secrets_are_checked(tmp_path):
    assert load_limits(True, {"max_tokens": 64}).max_tokens == 64
    for bad in ({"max_tokens": -1}, {"max_tokens": 1.5}, {"max_upload_mb": "big"}, {"max_sequences": True}):
        with pytest.raises(BadInput, match="secrets"):
            load_limits(True, bad)
    assert load_limits(False, {"max_tokens": 1}) == LOCAL  # local mode ignores them
    p = tmp_path / "secrets.toml"
    p.write_text('password = "x"\nmax_tokens = 32\n')
    assert read_secrets([p]) == {"password": "x", "max_tokens": 32}
    p.write_text("password = \n")
    with pytest.raises(BadInput, match="not valid TOML"):
        read_secrets([p])


def test_bad_flags_are_messages():
    for args in (["--hosted"], ["--port", "0"], ["--port", "abc"]):
        r = subprocess.run(
            [sys.executable, "-m", "ctxmix", "serve", "--dry-run", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k not in ("CTXMIX_PASSWORD", "CTXMIX_HOSTED")},
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)


def test_repository_config_is_safe_for_a_plain_streamlit_run():
    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1"
    assert cfg["server"]["maxUploadSize"] <= 20 and cfg["server"]["enableXsrfProtection"] is True
    assert cfg["client"]["showErrorDetails"] == "none"
    assert "-m ctxmix serve" in (ROOT / "Makefile").read_text()
    # app.py is at the checkout's top: a file watcher would watch .venv and the caches recursively
    assert cfg["server"]["fileWatcherType"] == "none"
    assert "--server.fileWatcherType=none" in serve_plan()["command"]


def _bound_addresses(port: int) -> set[str]:
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


@pytest.mark.slow
def test_serve_starts_on_localhost_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("CTXMIX_PASSWORD", "CTXMIX_HOSTED")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxmix", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("ctxmix serve did not start")
        assert _bound_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # the launcher became the server: stopping it stopped the server (no orphan keeps the port)
    time.sleep(1)
    assert _bound_addresses(port) == set()


def test_hub_probe_honours_the_endpoint_and_offline_switches(monkeypatch):
    """One hub check (ctxmix.hub) through huggingface_hub's session: HF_ENDPOINT is the address
    probed, the offline switches answer without any request."""
    import ctxmix.hub as hub

    calls = []

    class Session:
        def head(self, url, **kw):
            calls.append(url)

            class R:
                status_code = 200

            return R()

    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Session())
    for v in hub.OFFLINE_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example.org/")
    assert hub.hub_reachable() is True and calls == ["https://mirror.example.org"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.hub_reachable() is False and len(calls) == 1


def test_archives_are_checked_before_numpy_opens_them(tmp_path):
    """A saved explanation (.npz) upload: size cap, a zip, .npy members only, and a cap on the
    decompressed size (a zip bomb of zeros is refused without being expanded)."""
    import io
    import zipfile

    import numpy as np

    from ctxmix.service.limits import check_archive

    lim = HOSTED
    ok = io.BytesIO()
    np.savez_compressed(ok, a=np.ones((10, 10)))
    check_archive(ok.getvalue(), lim)
    bomb = io.BytesIO()
    np.savez_compressed(bomb, a=np.zeros(60 * 2**20, dtype=np.uint8))  # 60 MB of zeros, ~60 kB compressed
    check_archive(bomb.getvalue(), lim)  # within 20 x the cap
    big_bomb = io.BytesIO()
    with zipfile.ZipFile(big_bomb, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(12):  # 12 x 40 MB > 20 x the 20 MB cap
            z.writestr(f"a{i}.npy", b"\\0" * (20 * 2**20))
    with pytest.raises(BadInput, match="decompress"):
        check_archive(big_bomb.getvalue(), lim)
    with pytest.raises(BadInput, match="not an .npz"):
        check_archive(b"hello", lim)
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("payload.pkl", b"x")
    with pytest.raises(BadInput, match="not arrays"):
        check_archive(evil.getvalue(), lim)
    with pytest.raises(BadInput, match="at most"):
        check_archive(b"x" * int((lim.max_archive_mb + 1) * 2**20), lim)
