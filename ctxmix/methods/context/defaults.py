"""Context attribution's shipped defaults, read from one small mapping (defaults.json beside this module, written
by `python -m ctxmix.benchmark.context.defaults` from the benchmark's validation tables): the prompt form of a
model with or without a chat template, each shipped AT2 weights file's default kind (by the file's content hash),
and, per model matched by its weights' fingerprint (never its name), the AT2 weights trained on it and the page's
default methods, each with the table and date that chose it. A model that matches no entry gets no trained AT2
weights and the fallback methods.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

PACKAGE = "ctxmix.methods.context"
WEIGHTS_PACKAGE = "ctxmix.methods.context.at2_weights"


@cache
def shipped() -> dict:
    """The mapping (defaults.json), read once."""
    return json.loads((resources.files(PACKAGE) / "defaults.json").read_text())


def prompt_form_for(has_chat_template: bool) -> dict:
    """{"query_suffix", "stop", "template"} a model is asked with by default ({} with a chat template)."""
    form = shipped()["prompt_forms"]["chat_template" if has_chat_template else "no_chat_template"]
    return {k: v for k, v in form.items() if k in ("template", "query_suffix", "stop")}


def fallback_methods() -> tuple[str, ...]:
    """The methods of a model with no shipped entry (and `attribute_context`'s default methods)."""
    return tuple(shipped()["fallback"]["page_methods"])


def model_entry(model) -> dict | None:
    """The shipped entry of this model, matched by the SHA-256 of the packaged file it is built from
    (`source_sha256`: the same on every machine) or by its weights' fingerprint (`weights_sha256`, hashed only
    for a model of an entry's shape); None for any other model."""
    from ctxmix.engine.embedded import source_sha256
    from ctxmix.engine.fingerprint import weights_sha256

    entries = shipped()["models"]
    src = source_sha256(model)
    hit = next((e for e in entries if src is not None and e.get("source_sha256") == src), None)
    if hit is not None:
        return hit
    shaped = [e for e in entries if e.get("shape") == [model.n_layers, model.n_heads]]
    if not shaped:
        return None
    fp = weights_sha256(model)
    return next((e for e in shaped if e.get("weights_sha256") == fp), None)


def page_methods(model) -> tuple[list[str], str]:
    """(the Context attribution page's default methods for `model`, what chose them)."""
    entry = model_entry(model) or {}
    if entry.get("page_methods"):
        return list(entry["page_methods"]), f"{entry['page_methods_chosen_on']}, {entry.get('date')}"
    fb = shipped()["fallback"]
    return list(fb["page_methods"]), f"{fb['page_methods_chosen_on']}, {fb.get('date')}"


def at2_weights_file(model) -> Path | None:
    """The shipped AT2 weights file trained on this model (matched by fingerprint, `model_entry`), or None."""
    sha = (model_entry(model) or {}).get("at2_weights")
    if not sha:
        return None
    p = resources.files(WEIGHTS_PACKAGE) / shipped()["at2_weights"][sha]["file"]
    return Path(str(p)) if p.is_file() else None


def at2_file_defaults(sha16: str) -> dict | None:
    """A shipped AT2 weights file's defaults by its content hash: {"kind", "kind_chosen_on", "weights": "trained" |
    "uniform", "uniform_because"?, "date", ...}; None for a file that is not shipped (a user's)."""
    return shipped()["at2_weights"].get(sha16)
