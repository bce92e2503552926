"""The caps that keep a shared server responsive, from one place, and what decides hosted mode.

Hosted mode is on when CTXMIX_HOSTED is set, when the secrets file says `hosted = true`, or
when any password is configured (CTXMIX_PASSWORD or `password` in secrets): a password means
the server is meant to be shared, so login, caps and the model allow-list all apply (fail
closed). The secrets file is Streamlit's `.streamlit/secrets.toml` (the working directory's,
then the user's); its `max_*` keys override the hosted caps.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

from .errors import BadInput


@dataclass(frozen=True)
class Limits:
    """Caps on one server. Sizes in MB; tokens counted with the model's special tokens."""

    max_tokens: int  # tokens per sequence
    max_sequences: int  # sequences per corpus job
    max_upload_mb: float  # an uploaded text file
    max_archive_mb: float  # an uploaded archive (a saved explanation's .npz), compressed
    max_job_tokens: int  # tokens in all the sequences of one corpus job
    max_concurrent_jobs: int  # corpus jobs running at once on the server

    @property
    def server_upload_mb(self) -> int:
        """Streamlit's server-wide `server.maxUploadSize`: whole MB, the ceiling of the largest cap."""
        return max(1, math.ceil(max(self.max_upload_mb, self.max_archive_mb)))


LOCAL = Limits(max_tokens=512, max_sequences=2000, max_upload_mb=5.0, max_archive_mb=20.0, max_job_tokens=1_000_000,
               max_concurrent_jobs=4)
HOSTED = Limits(max_tokens=128, max_sequences=100, max_upload_mb=1.0, max_archive_mb=20.0, max_job_tokens=12_800,
                max_concurrent_jobs=2)


def _truthy(v) -> bool:
    return str(v).strip().lower() not in ("", "0", "false", "no", "off", "none")


def read_secrets(paths: list[Path] | None = None) -> dict:
    """Streamlit's secrets file as a dict ({} when there is none); a broken file is an error."""
    paths = paths if paths is not None else [Path.cwd() / ".streamlit" / "secrets.toml",
                                             Path.home() / ".streamlit" / "secrets.toml"]
    out: dict = {}
    for p in reversed(paths):  # the working directory's wins
        if p.is_file():
            try:
                out.update(tomllib.loads(p.read_text(encoding="utf-8")))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise BadInput(f"{p} is not valid TOML: {e}") from None
    return out


def password(env: Mapping[str, str], secrets: Mapping) -> str | None:
    return env.get("CTXMIX_PASSWORD") or (str(secrets["password"]) if secrets.get("password") else None)


def hosted_mode(env: Mapping[str, str] | None = None, secrets: Mapping | None = None) -> bool:
    """Hosted when asked for (CTXMIX_HOSTED, `hosted = true`) or when any password is set."""
    env = os.environ if env is None else env
    secrets = {} if secrets is None else secrets
    return (_truthy(env.get("CTXMIX_HOSTED", "")) or _truthy(secrets.get("hosted", False))
            or password(env, secrets) is not None)


def login_configured(env: Mapping[str, str], secrets: Mapping) -> bool:
    """A password, or an OIDC provider in an [auth] section (Streamlit's st.login)."""
    return password(env, secrets) is not None or bool(secrets.get("auth"))


def load_limits(hosted: bool, secrets: Mapping | None = None) -> Limits:
    """The caps of this server: LOCAL, or HOSTED with the secrets' `max_*` overrides (checked)."""
    if not hosted:
        return LOCAL
    secrets = secrets or {}
    over = {}
    for f in fields(Limits):
        if f.name in secrets:
            v = secrets[f.name]
            kind = int if f.type in (int, "int") else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (kind is int and v != int(v)):
                raise BadInput(f"secrets: {f.name} must be a positive {'whole ' if kind is int else ''}number, got {v!r}")
            over[f.name] = kind(v)
    return replace(HOSTED, **over)
