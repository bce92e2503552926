"""Saved context attributions: one compressed .npz per `ContextAttribution`, reopened without any model.

Arrays go in as `scores/<method>`, `per_token/<method>`, `targets/<method>`, `terms/<method>/<name>`,
`masks/<method>`, `logit_probs/<method>` (the ablations behind a fit), and, once `evaluate` has run,
`evaluation/masks` and `evaluation/logit_probs` (its held-out ablations); everything else (context,
sources, spans, ids, options, cost, provenance, the evaluation's table) as one JSON string entry,
`meta`, so the file opens with `numpy.load(..., allow_pickle=False)` and can run no code.

The writer (here) and the reader (`ctxmix.export.context.load`) of the format live in `export`, the
stage of files: the reader takes the hosted archive limits of `ctxmix.service.limits` for an upload (the
dashboard's page), which `methods` could not import. `ContextAttribution.save` calls
`save_context_attribution` from inside the method (tests/test_layout.py's PRESENTATION); so this module
reads the attribution by its attributes and imports nothing of `methods.context` (no import cycle), and
the reader, which builds one, sits in its own module. Layout version 2 adds the evaluation; version 1
files read as before.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from ctxmix.errors import BadInput

FORMAT = "ctxmix-context-attribution"
JSON_FORMAT = FORMAT + "-json"  # the same contents as JSON (`ctxmix.export.context.json_file`)
VERSION = 2
KINDS = ("scores", "per_token", "targets", "terms", "masks", "logit_probs", "evaluation")  # the arrays' prefixes


def _arrays(ca) -> dict:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model_name": ca.model_name,
        "context": ca.context,
        "query": ca.query,
        "sources": ca.sources,
        "source_spans": [list(s) for s in ca.source_spans],
        "source_tokens": ca.source_tokens,
        "prompt_ids": ca.prompt_ids,
        "response": ca.response,
        "response_ids": ca.response_ids,
        "methods": ca.methods,
        "intercepts": ca.intercepts,
        "cost": ca.cost,
        "options": ca.options,
        "provenance": ca.provenance,
        "warnings": ca.warnings,
        "terms": {m: list(t) for m, t in ca.terms.items()},
        "messages": ca.messages,
        "source_messages": ca.source_messages,
    }
    arrays: dict = {
        "labels": np.asarray(ca.labels, dtype=np.int64),
        "response_offsets": np.asarray(ca.response_offsets, dtype=np.int64),
    }
    for m in ca.methods:
        arrays[f"scores/{m}"] = np.asarray(ca.scores[m], dtype=np.float64)
    for m, a in ca.per_token.items():
        arrays[f"per_token/{m}"] = a
        arrays[f"targets/{m}"] = ca.targets[m]
        for k, v in ca.terms.get(m, {}).items():
            arrays[f"terms/{m}/{k}"] = np.asarray(v, dtype=np.float64)
    for m, ab in ca.ablations.items():
        arrays[f"masks/{m}"] = ab["masks"]
        arrays[f"logit_probs/{m}"] = ab["logit_probs"]
    ev = ca.evaluation
    if ev:
        table = ev["table"]
        meta["evaluation"] = {
            "columns": list(table.columns),
            "rows": table.to_dict("records"),  # NaN (an undefined LDS) is written as JSON's NaN
            "options": ev["options"],
            "cost": ev["cost"],
            "notes": ev["notes"],
            "directions": ev["directions"],
        }
        arrays["evaluation/masks"] = ev["masks"]
        arrays["evaluation/logit_probs"] = ev["logit_probs"]
    arrays["meta"] = np.array(json.dumps(meta, default=str))
    return arrays


def context_attribution_bytes(ca) -> bytes:
    """The saved file as bytes (a download button's data)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **_arrays(ca))
    return buf.getvalue()


def save_context_attribution(ca, path) -> Path:
    """Write `ca` to `path` (.npz added if missing), atomically (a temporary file renamed)."""
    p = Path(path)
    if p.suffix != ".npz":
        p = p.with_name(p.name + ".npz")
    if p.is_dir():
        raise BadInput(f"{p} is a folder; give a file name")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_bytes(context_attribution_bytes(ca))
    tmp.replace(p)
    return p
