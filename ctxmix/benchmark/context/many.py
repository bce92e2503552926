"""`attribute_contexts`: many examples attributed in one call, one table out (docs/context.md).

    table = ctxmix.attribute_contexts(model, "examples.jsonl", methods=["logit", "contextcite"], store="run.jsonl")

Each example is one `attribute_context` call (the same numbers as calling it yourself); the ablation
methods batch their passes within an example (`batch_size`), the one-pass methods trace each example once.
With a `store` (a JSON-lines file, the context benchmark's resume file: `ctxmix.benchmark.context.bench`;
this runner sits in `benchmark` beside it),
each finished example is appended as it ends, so a run that is killed keeps what it finished and the same
call on the same file does only the rest; a record made with other options or another example text is
not reused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

if TYPE_CHECKING:
    import pandas as pd

EXAMPLE_KEYS = ("id", "context", "query", "messages", "response", "sources", "chat_template")
COLUMNS = ["example", "message", "method", "source", "start", "end", "text", "score", "rank"]


def read_examples(examples) -> list[dict]:
    """The examples checked: a list of dicts, or the path of a JSON-lines file (one dict per line, blank
    lines skipped). Keys: context (and query) or messages, and optionally response, sources, chat_template,
    id (default: the example's position); nothing else."""
    if isinstance(examples, (str, Path)):
        p = Path(examples)
        if not p.is_file():
            raise BadInput(f"no such examples file: {str(p)!r}")
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise BadInput(f"{p.name} line {n} is not JSON: {e}") from None
        examples = rows
    if not isinstance(examples, (list, tuple)) or not examples:
        raise BadInput("examples must be a non-empty list of dicts (or a JSON-lines file of them)")
    out, seen = [], set()
    for k, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise BadInput(f"example {k} must be a dict with context (and query) or messages, got {type(ex).__name__}")
        bad = sorted(set(ex) - set(EXAMPLE_KEYS))
        if bad:
            raise BadInput(f"example {k} has unknown keys {bad}; valid: {', '.join(EXAMPLE_KEYS)}")
        if ("context" in ex) == ("messages" in ex):
            raise BadInput(f"example {k} needs either 'context' (and 'query') or 'messages'")
        key = str(ex.get("id", k))
        if key in seen:
            raise BadInput(f"example id {key!r} appears twice")
        seen.add(key)
        out.append({**ex, "id": key})
    return out


def _frame_rows(ca, key: str) -> list[dict]:
    """`ca.to_frame()`'s rows with the example id and each source's message."""
    rows = ca.to_frame().to_dict("records")
    for r in rows:
        r["example"] = key
        r["message"] = int(ca.source_messages[r["source"]]) if ca.source_messages else 0
    return rows


def _stampable(call: dict) -> dict:
    """The call's options as the resume stamp sees them: arrays (at2 weights given as numbers) by the SHA-256
    of their bytes, not by numpy's shortened text."""
    import dataclasses
    import hashlib

    import numpy as np

    out = {}
    for k, v in call.items():
        if dataclasses.is_dataclass(v) and not isinstance(v, type):  # an option group: its fields
            v = _stampable(dataclasses.asdict(v))
        elif isinstance(v, dict):
            v = _stampable(v)
        if isinstance(v, np.ndarray):
            v = f"array:{v.dtype}:{v.shape}:" + hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        out[k] = v
    return out


def _resolved(model: Model, call: dict) -> dict:
    """What a call's numbers depend on beyond its arguments, for the resume stamp: the prompt form "auto" resolves to
    for this model (the shipped defaults may change it), and the AT2 weights file at2_exact reads (its content)."""
    import dataclasses

    from ctxmix.methods.context.at2 import weights_file_sha16
    from ctxmix.methods.context.attribution import DEFAULT_METHODS
    from ctxmix.methods.context.options import model_form

    out = {"prompt_form_resolved": dataclasses.asdict(model_form(model, call.get("prompt"), call.get("compat", False)))}
    if "at2_exact" in (call.get("methods") or DEFAULT_METHODS):
        at2 = _as_dict(call.get("at2"))
        out["at2_file"] = weights_file_sha16(model, at2.get("weights", call.get("at2_weights")))
    return out


def _as_dict(group) -> dict:
    """An option group (a dataclass, a dict or None) as a dict."""
    import dataclasses

    if group is None:
        return {}
    return dataclasses.asdict(group) if dataclasses.is_dataclass(group) else dict(group)


def attribute_contexts(model: Model, examples, *, store=None, progress=True, **options) -> pd.DataFrame:
    """Attribute every example (`read_examples`: a list of dicts or a JSON-lines path) with
    `attribute_context(model, ..., **options)` and return one table, one row per (example, method, source):
    example (its id), message (the source's message; 0 in the context/query form), then
    `ContextAttribution.to_frame`'s method, source, start, end, text, score and rank (1 = highest in its
    example and method). An example's own "response", "sources" and "chat_template" override `options`.

    store: a JSON-lines file keeping each finished example (a killed run resumes there: the same call does
    only the examples it lacks). progress: True (one bar over the examples), False, or a callable
    progress("examples", done, total). attrs: responses (id -> the response attributed), warnings
    (id -> list), seconds (id -> that example's seconds; 0 for one read from the store)."""
    import time

    import pandas as pd

    from ctxmix.benchmark.context.bench import _load_done, append_done, config_stamp
    from ctxmix.methods.context import attribution
    from ctxmix.progress import progress_bar

    rows = read_examples(examples)
    if "messages" in options or "context" in options or "query" in options:
        raise BadInput("give each example's context/query or messages in `examples`, not as options")
    path = Path(store) if store is not None else None
    done = _load_done(path)
    from ctxmix.service.cache import model_fingerprint

    # the model's identity, not its name: the same name in bf16, quantized or retrained must not reuse rows
    fingerprint = model_fingerprint(model)
    out, responses, warnings, seconds = [], {}, {}, {}
    total = len(rows)
    with progress_bar(total, "examples", enabled=bool(progress) and not callable(progress), unit="ex") as bar:
        for i, ex in enumerate(rows):
            key = ex["id"]
            call = {**options, **{k: v for k, v in ex.items() if k not in ("id", "chat_template")}}
            # the prompt form in its group: the flat template keywords and an example's own chat template
            prompt = {**_as_dict(call.pop("prompt", None))}
            prompt |= {k: call.pop(k) for k in ("template", "chat_template") if k in call}
            if ex.get("chat_template") is not None:
                prompt["chat_template"] = ex["chat_template"]
            if prompt:
                call["prompt"] = prompt
            stamp = config_stamp({"model": fingerprint, **_stampable(call), **_resolved(model, call)}, False, {}, None)
            rec = done.get((key, stamp))
            if rec is None:
                t0 = time.perf_counter()
                ca = attribution.attribute_context(model, **call, progress=False)
                rec = {
                    "key": key,
                    "stamp": stamp,
                    "rows": _frame_rows(ca, key),
                    "response": ca.response,
                    "warnings": ca.warnings,
                    "seconds": time.perf_counter() - t0,
                }
                if path is not None:
                    append_done(path, rec)
            else:
                rec = {**rec, "seconds": 0.0}
            out += rec["rows"]
            responses[key], warnings[key], seconds[key] = rec["response"], rec["warnings"], rec["seconds"]
            bar.update(1)
            if callable(progress):
                progress("examples", i + 1, total)
    table = pd.DataFrame(out, columns=COLUMNS)
    table.attrs.update(responses=responses, warnings=warnings, seconds=seconds)
    return table
