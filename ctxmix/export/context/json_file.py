"""A context attribution as one JSON document (`ctxmix cite --out x.json`), reopened to the same numbers.

The document holds exactly what the .npz of `ctxmix.export.context.npz_file` holds: `meta` (the same metadata
object, parsed rather than a string) and `arrays`, each entry by its .npz name as {"dtype", "shape",
"data"} with `data` flattened in C order. Floats are written by Python's `repr` (the shortest string that
reads back to the same float64, and float32 values widened exactly), so the scores reload bit for bit;
NaN and infinities use JSON's common extension (`NaN`, `Infinity`), as `json` reads and writes them. The
reader (`ctxmix.load_context_attribution`, in `export.context.load`) rebuilds the arrays and hands them to the .npz
parser, so both formats
open through one code path. JSON is for reading and diffing; the .npz is smaller.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.export.context.npz_file import JSON_FORMAT, _arrays


def context_attribution_json(ca, indent: int | None = None) -> str:
    """`ca` (a `ContextAttribution`) as one JSON string: {"format", "meta", "arrays"}."""
    parts = _arrays(ca)
    meta = json.loads(str(parts.pop("meta")))
    arrays = {
        k: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.ravel().tolist()}
        for k, a in ((k, np.asarray(v)) for k, v in parts.items())
    }
    return json.dumps({"format": JSON_FORMAT, "meta": meta, "arrays": arrays}, indent=indent, default=str)


def save_context_attribution_json(ca, path) -> Path:
    """Write `ca` as JSON to `path`, atomically (a temporary file renamed)."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{p} is a folder; give a file name")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(context_attribution_json(ca), encoding="utf-8")
    tmp.replace(p)
    return p
