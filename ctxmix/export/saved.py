"""Saved explanations: one compressed .npz per Explanation, reopened without any model.

Arrays go in as `layer/<method>`, `global/<method>`, `saliency/<method>`; everything else
(tokens, methods, prediction, options, provenance) as one JSON string entry, `meta`, so the
file opens with `numpy.load(..., allow_pickle=False)` and can run no code. Layout version 2 (the
prediction methods' `logit/`, `layer_saliency/`, `head_saliency/` arrays and `logit_terms`); version 1
files read as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.methods.explanation import FORMAT, KIND_FIELDS, KINDS, VERSION, Explanation


def explanation_bytes(ex: Explanation, half: bool = False) -> bytes:
    """The saved-explanation file as bytes (a download button's data)."""
    return ex.to_bytes(half=half)


def save_explanation(ex: Explanation, path, half: bool = False) -> Path:
    """Write `ex` to `path` (.npz added if missing); see `Explanation.save`."""
    return ex.save(path, half=half)


def archive_source(path, limits=None, name: str | None = None) -> tuple:
    """(what np.load opens, the name messages use) for a saved file given as a path or as an upload's
    bytes; with `limits` (a `ctxmix.service.limits.Limits`) the archive is checked first as an upload:
    size, members, decompressed size, before numpy reads it."""
    import io

    if isinstance(path, (bytes, bytearray)):
        src, label, data = io.BytesIO(path), name or "the file", bytes(path)
    else:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"no such file: {str(p)!r}")
        src, label, data = p, name or p.name, p
    if limits is not None:
        from ctxmix.service.limits import check_archive

        check_archive(data, limits, name=label)
    return src, label


def load_explanation(path, limits=None, name: str | None = None) -> Explanation:
    """Reopen a saved explanation (no model needed) from a path or the file's bytes (an upload).
    `limits` (a `ctxmix.service.limits.Limits`) checks it as an upload first: size, members, decompressed
    size. Maps come back in float64."""
    src, label = archive_source(path, limits, name)
    try:
        with np.load(src, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise BadInput(f"{label} is not a saved ctxmix explanation (no metadata)")
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file gets one message
        raise BadInput(f"{label} could not be read as a saved explanation: {type(e).__name__}: {e}") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise BadInput(f"{label} is not a saved ctxmix explanation this version can read")
    ex = Explanation(
        tokens=list(meta["tokens"]),
        input_ids=list(meta["input_ids"]),
        methods=list(meta["methods"]),
        prediction=meta["prediction"],
        position=int(meta["position"]),
        target=meta["target"],
        foil=meta.get("foil"),
        model_name=meta["model_name"],
        reconstruction_error=float(meta["reconstruction_error"]),
        warnings=list(meta["warnings"]),
        options=dict(meta.get("options") or {}),
        provenance=dict(meta.get("provenance") or {}),
        segments=meta.get("segments"),
        logit_terms=_logit_terms(meta.get("logit_terms") or {}, label),
    )
    n = len(ex.tokens)
    segs = ex.segments
    if segs is not None and (
        not isinstance(segs, list) or len(segs) != n or any(isinstance(v, bool) or v not in (-1, 0, 1) for v in segs)
    ):
        raise BadInput(f"{label} has segments that do not fit its {n} tokens")
    kinds = KINDS if meta["version"] >= 2 else KINDS[:4]
    for key, a in arrays.items():
        kind, _, m = key.partition("/")
        if kind not in kinds or not m:
            raise BadInput(f"{label}: unexpected entry {key!r}")
        a = a.astype(np.float64)
        # the trailing axes each kind must have: maps end in (n, n), every other array in (n,)
        ndim = {"saliency": 1, "head": 4, "logit": 2, "layer_saliency": 2, "head_saliency": 3}.get(kind, 3)
        tail = (n, n) if kind in ("layer", "global", "head") else (n,)
        if a.ndim != ndim or a.shape[-len(tail) :] != tail:
            raise BadInput(f"{label}: {key} has shape {a.shape}, which does not fit {n} tokens")
        getattr(ex, KIND_FIELDS[kind])[m] = a
    return ex


def _logit_terms(terms, label: str) -> dict:
    """The prediction methods' unattributed terms: {method: {name: number or list of numbers}}."""
    ok = isinstance(terms, dict) and all(
        isinstance(v, dict)
        and all(
            isinstance(x, (int, float)) or (isinstance(x, list) and all(isinstance(y, (int, float)) for y in x))
            for x in v.values()
        )
        for v in terms.values()
    )
    if not ok:
        raise BadInput(f"{label} has logit_terms that are not numbers per method and term")
    return terms
