"""Is the Hugging Face hub usable from here? One answer for models and datasets.

The probe goes through `huggingface_hub`'s own HTTP session, so it honours HF_ENDPOINT (a
mirror), the proxy variables (HTTPS_PROXY, NO_PROXY) and the offline switches exactly as the
downloads that follow will; a raw socket to huggingface.co:443 would not.
"""

from __future__ import annotations

import os

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline() -> bool:
    """An offline switch is set (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE or HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"} for v in OFFLINE_VARS)


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT (a mirror) or huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """One HEAD request to the hub's endpoint, so an offline machine fails in seconds rather than
    after the download's long retries. False when offline switches are set."""
    if offline():
        return False
    try:
        from huggingface_hub.utils import get_session

        r = get_session().head(endpoint(), timeout=timeout, follow_redirects=False)
        return r.status_code < 500
    except Exception:  # noqa: BLE001 - any transport error means: not reachable
        return False
