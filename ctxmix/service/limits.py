"""The caps that keep a shared server responsive, from one place, and what decides hosted mode.

Hosted mode is on when CTXMIX_HOSTED is set, when the secrets file says `hosted = true`, or
when any password is configured (CTXMIX_PASSWORD or `password` in secrets): a password means
the server is meant to be shared, so login, caps and the model allow-list all apply (fail
closed). The secrets file is Streamlit's `.streamlit/secrets.toml` (the working directory's,
then the user's); its `max_*` keys override the hosted caps. `check_tokens`, `generation_room` and
`check_generation` apply the caps to one request before any model call (the pages call them).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ctxmix.errors import BadInput


@dataclass(frozen=True)
class Limits:
    """Caps on one server. Sizes in MB; tokens counted with the model's special tokens."""

    max_tokens: int  # tokens per sequence
    max_sequences: int  # sequences per corpus job
    max_upload_mb: float  # an uploaded text file
    max_archive_mb: float  # an uploaded archive (a saved explanation's .npz), compressed
    max_job_tokens: int  # tokens in all the sequences of one corpus job
    max_concurrent_jobs: int  # corpus jobs running at once on the server
    max_archive_ratio: float = 20.0  # an archive's decompressed size / its compressed cap
    # the Context attribution page (one request: a prompt of documents, a query, a generated response)
    max_context_tokens: int = 4096  # the prompt's tokens: template, documents and query
    max_documents: int = 5  # documents (uploaded files) in one context
    max_ablations: int = 32  # ContextCite's ablations, and evaluate's held-out ones, per request
    max_context_new_tokens: int = 64  # the response's new tokens
    # the Images page: the image given (before the processor) and the positions the model reads
    max_image_pixels: int = 4096 * 4096
    max_image_positions: int = 1370  # DINOv2 at its full 518 x 518 resolution: 37 x 37 patches and the class token
    # the Speech page: a clip's length (Whisper reads at most 30 s, whatever the cap)
    max_audio_seconds: float = 30.0

    @property
    def server_upload_mb(self) -> int:
        """Streamlit's server-wide `server.maxUploadSize`: whole MB, the ceiling of the largest cap."""
        return max(1, math.ceil(max(self.max_upload_mb, self.max_archive_mb)))


LOCAL = Limits(
    max_tokens=512,
    max_sequences=2000,
    max_upload_mb=5.0,
    max_archive_mb=20.0,
    max_job_tokens=1_000_000,
    max_concurrent_jobs=4,
)
HOSTED = Limits(
    max_tokens=128,
    max_sequences=100,
    max_upload_mb=1.0,
    max_archive_mb=20.0,
    max_job_tokens=12_800,
    max_concurrent_jobs=2,
    max_context_tokens=1024,
    max_image_pixels=2048 * 2048,
    max_image_positions=257,  # a 224 x 224 crop in 14-pixel patches (DINOv2), or 16-pixel ones (ViT-B/16: 197)
    max_audio_seconds=10.0,
)


def _truthy(v) -> bool:
    return str(v).strip().lower() not in ("", "0", "false", "no", "off", "none")


def read_secrets(paths: list[Path] | None = None) -> dict:
    """Streamlit's secrets file as a dict ({} when there is none); a broken file is an error."""
    paths = (
        paths
        if paths is not None
        else [Path.cwd() / ".streamlit" / "secrets.toml", Path.home() / ".streamlit" / "secrets.toml"]
    )
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
    return (
        _truthy(env.get("CTXMIX_HOSTED", ""))
        or _truthy(secrets.get("hosted", False))
        or password(env, secrets) is not None
    )


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
                raise BadInput(
                    f"secrets: {f.name} must be a positive {'whole ' if kind is int else ''}number, got {v!r}"
                )
            over[f.name] = kind(v)
    return replace(HOSTED, **over)


# ---------------------------------------------------------------- caps on one request, before any model call
# The pages call these before the model runs (tokenising is not a model call), so a request over a cap
# costs the server nothing: no forward pass, no generation step.

GENERATE_MAX_NEW = 64  # new tokens one click of the dashboard's Generate may ask for, whatever the cap


def check_tokens(n: int, limits: Limits, what: str = "The text") -> None:
    """Refuse a sequence of n tokens (special tokens included) over the per-sequence cap `max_tokens`."""
    if n > limits.max_tokens:
        raise BadInput(
            f"{what} has {n} tokens; the limit here is {limits.max_tokens} tokens per sequence "
            f"(max_tokens, special tokens included): shorten it by {n - limits.max_tokens} tokens"
        )


def generation_room(prompt_tokens: int, limits: Limits, most: int = GENERATE_MAX_NEW) -> int:
    """How many new tokens a prompt of `prompt_tokens` may still get: the prompt and its continuation
    count together against `max_tokens` (prompt + max_new_tokens <= max_tokens), and at most `most`.
    0 when the prompt leaves no room."""
    return max(0, min(int(most), limits.max_tokens - int(prompt_tokens)))


def check_generation(prompt_tokens: int, max_new_tokens: int, limits: Limits) -> None:
    """Refuse a generation whose prompt plus new tokens would pass `max_tokens` (the continuation is
    explained with its prompt, so both count), before any generation step."""
    cap = limits.max_tokens
    if prompt_tokens + max_new_tokens <= cap:
        return
    rule = f"the limit here is {cap} tokens per sequence (max_tokens), the prompt and its continuation together"
    if prompt_tokens >= cap:
        raise BadInput(
            f"The prompt has {prompt_tokens} tokens; {rule}: shorten the prompt to at most {cap - 1} tokens to generate"
        )
    raise BadInput(
        f"{prompt_tokens} prompt tokens + {max_new_tokens} new ones = {prompt_tokens + max_new_tokens}; {rule}: "
        f"ask for at most {cap - prompt_tokens} new tokens, or shorten the prompt"
    )


def check_archive(data: bytes | Path, limits: Limits, name: str = "the file") -> None:
    """Refuse an uploaded .npz (a zip of arrays) before numpy opens it: larger than the archive cap,
    not a zip, too many members, anything but .npy members, or members that would decompress to
    more than `max_archive_ratio` times the cap (a zip bomb). numpy then reads it with
    allow_pickle=False, so no member can run code."""
    import io
    import zipfile

    size = len(data) if isinstance(data, (bytes, bytearray)) else Path(data).stat().st_size
    cap = limits.max_archive_mb * 2**20
    if size > cap:
        raise BadInput(f"{name} is {size / 2**20:.1f} MB; archives may be at most {limits.max_archive_mb:g} MB here")
    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with zipfile.ZipFile(src) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError):
        raise BadInput(f"{name} is not an .npz archive") from None
    if len(members) > 1000:
        raise BadInput(f"{name} holds {len(members)} files; an explanation holds far fewer")
    bad = [m.filename for m in members if not m.filename.endswith(".npy")]
    if bad:
        raise BadInput(f"{name} holds files that are not arrays: {', '.join(bad[:5])}")
    total = sum(m.file_size for m in members)
    if total > limits.max_archive_ratio * cap:
        raise BadInput(
            f"{name} would decompress to {total / 2**20:.0f} MB; at most "
            f"{limits.max_archive_ratio * limits.max_archive_mb:g} MB here"
        )


def check_context_request(
    prompt_tokens: int, n_documents: int, n_ablations: int | None, max_new_tokens: int, limits: Limits
) -> None:
    """Refuse a context-attribution request over the page's caps, before any model call (tokenising the
    prompt is not one): the prompt's tokens (template, documents, query) against `max_context_tokens`, the
    documents against `max_documents`, ContextCite's ablations (None: none asked for) against
    `max_ablations`, the new tokens against `max_context_new_tokens`. The message names the limit."""
    if n_documents > limits.max_documents:
        raise BadInput(
            f"the context has {n_documents} documents; the limit here is {limits.max_documents} documents "
            f"(max_documents): remove {n_documents - limits.max_documents}"
        )
    if prompt_tokens > limits.max_context_tokens:
        raise BadInput(
            f"the prompt (context, query and template) has {prompt_tokens} tokens; the limit here is "
            f"{limits.max_context_tokens} tokens (max_context_tokens): shorten the context by "
            f"{prompt_tokens - limits.max_context_tokens} tokens"
        )
    if n_ablations is not None and n_ablations > limits.max_ablations:
        raise BadInput(f"{n_ablations} ablations asked for; the limit here is {limits.max_ablations} (max_ablations)")
    if max_new_tokens > limits.max_context_new_tokens:
        raise BadInput(
            f"{max_new_tokens} new tokens asked for; the limit here is {limits.max_context_new_tokens} "
            "(max_context_new_tokens)"
        )


def check_image(limits: Limits, image) -> None:
    """Refuse an image (an `ctxmix.engine.inputs.ImageInput`) over the caps, before any model call: the pixels of the
    image given, and the positions the model would read."""
    if image.source_size is not None:
        h, w = image.source_size
        if h * w > limits.max_image_pixels:
            raise BadInput(
                f"the image is {w} x {h} pixels; the limit here is {limits.max_image_pixels:,} pixels "
                "(max_image_pixels): shrink it first"
            )
    if image.n > limits.max_image_positions:
        raise BadInput(
            f"the model would read {image.n} positions of this image; the limit here is "
            f"{limits.max_image_positions} (max_image_positions)"
        )


def check_audio(limits: Limits, clip) -> None:
    """Refuse a clip (an `ctxmix.engine.inputs.AudioInput`) longer than the cap, before any model call."""
    seconds = clip.clip_samples / clip.sampling_rate
    if seconds > limits.max_audio_seconds:
        raise BadInput(
            f"the clip lasts {seconds:.1f} s; the limit here is {limits.max_audio_seconds:g} s (max_audio_seconds): "
            "cut it first"
        )
