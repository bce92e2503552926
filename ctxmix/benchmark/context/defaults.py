"""Writes the shipped defaults of context attribution (ctxmix/methods/context/defaults.json) from the benchmark's
shipped validation tables (ctxmix/benchmark/shipped/onepass-validation*.json) and the shipped AT2 weights: the
methods layer reads that mapping (`ctxmix.methods.context.defaults`) and never a benchmark output.

    python -m ctxmix.benchmark.context.defaults   # after bench/onepass_eval.py --ship or a new weights file

What it decides, each entry with the table and the date that chose it:
- per AT2 weights file (by content hash): its default kind, the one-pass kind whose trained weights score best on
  the file's validation table (`at2.default_kind`), and whether the trained weights are used (not where the file's
  held-out table scores them below uniform ones);
- per model (by its weights' fingerprint, `weights_sha256`, and the SHA-256 of the packaged file it is built from,
  `source_sha256`; never its name): the prompt form it is asked in (the base-model form without a chat template),
  the AT2 weights file trained on it, and the page's default methods: the best mean validation LDS among the
  methods without ablations on its table in that form (at2_exact with its default kind where the table scored the
  model's weights, they are in use and were trained in that form), then contextcite;
- the base-model prompt form (configs/context-gemma3.yaml's: the cue and the first-sentence cut);
- the fallback for any other model: the best method of smollm2's table that needs no trained weights.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ctxmix.benchmark.context.validation import shipped_tables
from ctxmix.methods.context.at2 import file_sha16

DEFAULTS_FILE = Path(__file__).resolve().parents[2] / "methods" / "context" / "defaults.json"
WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "methods" / "context" / "at2_weights"
BASE_MODEL_CONFIG = "configs/context-gemma3.yaml"  # the benchmark config whose prompt form a base model gets
FALLBACK_MODEL = "smollm2"  # whose table chooses the methods of a model with no entry (no trained weights)


def _chosen_on(table: dict) -> str:
    from ctxmix.methods.context.at2 import VALIDATION_TASKS

    tasks = ", ".join(t for t in VALIDATION_TASKS if (table.get("tasks") or {}).get(t))
    return f"{table.get('name')}.json: the {table.get('split')} split's {tasks or 'examples'}"


def _lds(table: dict) -> dict[str, float]:
    """{method: mean LDS} of the table's methods that run no ablation and need no trained weights."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    rows = table.get("methods") or {}
    return {
        m: float(rows[m]["lds"])
        for m, r in CONTEXT_METHODS.items()
        if r.cost != "ablation" and not r.needs_weights and isinstance((rows.get(m) or {}).get("lds"), (int, float))
    }


def weights_entry(path: Path, tables: list[dict]) -> dict:
    """A shipped AT2 weights file's defaults: its kind, trained or uniform, and what chose them."""
    from ctxmix.methods.context.at2 import _below_uniform, default_kind, heldout_texts, load_weights

    ws, shape, meta = load_weights(path)
    sha = file_sha16(path)
    table = next((t for t in tables if t.get("at2_weights_sha256") == sha), None)
    kind = default_kind(meta, ws, table)
    below = {k: list(v) for k in ws if (v := _below_uniform(meta, k)) is not None}
    return {
        "file": path.name,
        "trained_on": meta.get("model"),
        "prompt": meta.get("prompt", {}),
        "shape": list(shape),
        "kind": kind,
        "kind_chosen_on": _chosen_on(table) if table else (heldout_texts(meta) if meta.get("heldout") else "default"),
        "weights": "uniform" if kind in below else "trained",  # the default kind's
        # the kinds whose trained weights scored below uniform ones on the file's held-out table: [trained, uniform]
        "below_uniform": below,
        "heldout_texts": heldout_texts(meta),
        "date": (table or {}).get("date") or meta.get("date"),
    }


def model_entry(model, form: dict, weights: dict[str, dict], tables: list[dict]) -> dict:
    """An embedded model's defaults (module docstring): fingerprints, prompt form, AT2 file, page methods."""
    from ctxmix.engine.embedded import source_sha256
    from ctxmix.engine.fingerprint import weights_sha256

    table = next((t for t in tables if t.get("model") == model.name and (t.get("prompt") or {}) == form), None)
    at2 = next((sha for sha, w in weights.items() if w["trained_on"] == model.name), None)
    entry: dict = {
        "name": model.name,
        "weights_sha256": weights_sha256(model),
        "source_sha256": source_sha256(model),
        "shape": [model.n_layers, model.n_heads],
        "prompt": form,
        "at2_weights": at2,
    }
    if table is None:
        return entry
    lds = _lds(table)
    w = weights.get(at2 or "")
    if w and table.get("at2_weights_sha256") == at2 and w["weights"] == "trained" and w["prompt"] == form:
        row = (table.get("methods") or {}).get(f"at2_exact/{w['kind']}") or {}
        if isinstance(row.get("lds"), (int, float)):
            lds["at2_exact"] = float(row["lds"])
    if lds:
        entry["page_methods"] = [max(lds, key=lambda m: lds[m]), "contextcite"]
        entry["page_methods_chosen_on"] = _chosen_on(table) + " (the best mean LDS without ablations)"
        entry["date"] = table.get("date")
    return entry


def build_defaults() -> dict:
    """The mapping (module docstring), from the shipped tables and weights files and the embedded models."""
    from ctxmix.benchmark.context.bench import load_context_config
    from ctxmix.benchmark.context.prompt_form import prompt_form
    from ctxmix.engine.models import load_model

    tables = shipped_tables()
    repo = Path(__file__).resolve().parents[3]
    cfg = repo / "ctxmix" / "benchmark" / BASE_MODEL_CONFIG
    base_form = prompt_form(load_context_config(cfg))
    weights = {file_sha16(p): weights_entry(p, tables) for p in sorted(WEIGHTS_DIR.glob("*.npz"))}
    models = []
    for name in sorted({w["trained_on"] for w in weights.values()} | {FALLBACK_MODEL}):
        m = load_model(name)
        has_chat = bool(getattr(m.tokenizer, "chat_template", None))
        models.append(model_entry(m, {} if has_chat else base_form, weights, tables))
    fallback_table = next(t for t in tables if t.get("model") == FALLBACK_MODEL and not t.get("prompt"))
    lds = _lds(fallback_table)
    return {
        "about": "context attribution's shipped defaults, written by `python -m ctxmix.benchmark.context.defaults` "
        "from the shipped validation tables; read by ctxmix.methods.context.defaults",
        "written": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "prompt_forms": {
            "chat_template": {},
            "no_chat_template": {**base_form, "chosen_on": f"{BASE_MODEL_CONFIG}: the base model's benchmark form"},
        },
        "at2_weights": weights,
        "models": models,
        "fallback": {
            "page_methods": [max(lds, key=lambda m: lds[m]), "contextcite"],
            "page_methods_chosen_on": _chosen_on(fallback_table) + " (the best method needing no trained weights)",
            "date": fallback_table.get("date"),
        },
    }


def write_defaults(path: Path = DEFAULTS_FILE) -> Path:
    path.write_text(json.dumps(build_defaults(), indent=1, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    print(write_defaults())
