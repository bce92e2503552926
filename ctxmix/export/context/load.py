"""Reopen a saved context attribution (`ctxmix.export.context.npz_file` writes it; the format is described
there), from a path or an upload's bytes, optionally under the hosted archive limits."""

from __future__ import annotations

import json

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.export.context.npz_file import FORMAT, JSON_FORMAT, KINDS, VERSION
from ctxmix.methods.context.attribution import ContextAttribution


def load_context_attribution(path, limits=None, name: str | None = None) -> ContextAttribution:
    """Reopen a saved `ContextAttribution` (no model needed) from a path or the file's bytes (an upload):
    the .npz `ContextAttribution.save` writes, or its JSON (`ctxmix.export.context.json_file`; a .json name, or
    bytes that open with "{"). `limits` (a `ctxmix.service.limits.Limits`) checks it as an upload first:
    size, and for an .npz its members and decompressed size."""
    from ctxmix.export.saved import archive_source

    if _is_json(path, name):
        return _load_json(path, limits, name)
    src, label = archive_source(path, limits, name)
    try:
        with np.load(src, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file gets one message
        raise BadInput(f"{label} could not be read as a saved context attribution: {type(e).__name__}: {e}") from None
    return context_attribution_from_parts(meta, arrays, label)


def context_attribution_from_parts(meta: dict, arrays: dict, label: str) -> ContextAttribution:
    """A `ContextAttribution` from the saved format's parts: `meta` (the JSON entry, parsed) and `arrays` (every
    other entry by name); shared by the .npz reader above and the JSON one (`ctxmix.export.context.json_file`)."""
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise BadInput(f"{label} is not a saved ctxmix context attribution this version can read")
    ca = ContextAttribution(
        model_name=meta["model_name"],
        context=meta["context"],
        query=meta["query"],
        sources=list(meta["sources"]),
        source_spans=[tuple(s) for s in meta["source_spans"]],
        source_tokens=[list(t) for t in meta["source_tokens"]],
        prompt_ids=list(meta["prompt_ids"]),
        labels=arrays.pop("labels"),
        response=meta["response"],
        response_ids=list(meta["response_ids"]),
        response_offsets=arrays.pop("response_offsets"),
        methods=list(meta["methods"]),
        intercepts=dict(meta["intercepts"]),
        cost=dict(meta["cost"]),
        options=dict(meta["options"]),
        provenance=dict(meta["provenance"]),
        warnings=list(meta["warnings"]),
        messages=meta.get("messages"),  # files before conversations: none
        source_messages=list(meta.get("source_messages") or [0] * len(meta["sources"])),
    )
    for key, a in arrays.items():
        kind, _, rest = key.partition("/")
        if kind not in KINDS or not rest:
            raise BadInput(f"{label}: unexpected entry {key!r}")
        if kind == "scores":
            ca.scores[rest] = a
        elif kind == "per_token":
            ca.per_token[rest] = a
        elif kind == "targets":
            ca.targets[rest] = a
        elif kind == "terms":
            m, _, term = rest.partition("/")
            ca.terms.setdefault(m, {})[term] = a
        elif kind in ("masks", "logit_probs"):
            ca.ablations.setdefault(rest, {})[kind] = a
    missing = [m for m in ca.methods if m not in ca.scores]
    if missing:
        raise BadInput(f"{label} has no scores for {', '.join(missing)}")
    ev = meta.get("evaluation")
    if ev:
        import pandas as pd

        table = pd.DataFrame(ev["rows"], columns=ev["columns"])
        table.attrs.update({k: ev[k] for k in ("options", "cost", "notes", "directions")})
        ca.evaluation = {
            "table": table,
            "masks": arrays["evaluation/masks"],
            "logit_probs": arrays["evaluation/logit_probs"],
            **{k: ev[k] for k in ("options", "cost", "notes", "directions")},
        }
    return ca


def _is_json(path, name: str | None) -> bool:
    if isinstance(path, (bytes, bytearray)):
        return bytes(path[:64]).lstrip().startswith(b"{") or (name or "").lower().endswith(".json")
    return str(path).lower().endswith(".json")


def _load_json(path, limits, name: str | None) -> ContextAttribution:
    """The JSON form, its size checked against the archive cap first when `limits` is given."""
    from pathlib import Path

    if isinstance(path, (bytes, bytearray)):
        data, label = bytes(path), name or "the file"
    else:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"no such file: {str(p)!r}")
        data, label = p.read_bytes(), name or p.name
    if limits is not None and len(data) > limits.max_archive_mb * 2**20:
        raise BadInput(
            f"{label} is {len(data) / 2**20:.1f} MB; saved files may be at most {limits.max_archive_mb:g} MB here"
        )
    return context_attribution_from_json(data, label)


def context_attribution_from_json(data: bytes, label: str) -> ContextAttribution:
    """A `ContextAttribution` from the JSON text (bytes) `ctxmix.export.context.json_file` writes."""
    try:
        doc = json.loads(data.decode("utf-8"))
        ok = isinstance(doc, dict) and doc.get("format") == JSON_FORMAT
        arrays = (
            {k: np.asarray(v["data"], dtype=v["dtype"]).reshape(v["shape"]) for k, v in doc["arrays"].items()}
            if ok
            else {}
        )
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file gets one message
        raise BadInput(f"{label} could not be read as a context attribution's JSON: {type(e).__name__}: {e}") from None
    if not ok:
        raise BadInput(f"{label} is not a ctxmix context attribution's JSON (format {JSON_FORMAT!r})")
    return context_attribution_from_parts(doc["meta"], arrays, label)
