"""Context attribution's offline benchmark (issue 27, Evaluation point 3): `configs/context.yaml` read by
`load_context_config`, run by `run_context_benchmark`.

    from ctxmix.benchmark.context_bench import load_context_config, run_context_benchmark
    table = run_context_benchmark(load_context_config("configs/context.yaml"), limit=2)

Each task's examples come from `ctxmix.benchmark.context_data` (lengths counted by the model's tokenizer);
each is attributed with `ctxmix.attribute_context` (every method of the config, the stored response when
the config has one, else generated greedily) and measured by `ContextAttribution.evaluate`. Needles and
documents whose response lacks the needle's answer are dropped (and counted). The result: the mean,
std (population) and n of every metric per task and method; `table.attrs["examples"]` holds the per-example
rows, `["dropped"]` the dropped ids per task, `["responses"]` every response used (id -> text: paste the
generated ones into the config's `responses` so another CPU explains the same text), `["seconds"]`.
Kept apart from the SQLite runner (`ctxmix.benchmark.command`), whose units are token-level explanations.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from ctxmix.benchmark.context_data import TASKS, ContextExample, contains_answer
from ctxmix.errors import BadInput

CONFIG_KEYS = {
    "name",
    "description",
    "kind",
    "model",
    "methods",
    "n_ablations",
    "seed",
    "max_new_tokens",
    "batch_size",
    "evaluate",
    "tasks",
    "responses",
}
TASK_KEYS = {"id", "n", "min_tokens", "max_tokens", "seed", "n_documents"}


def validate_context_config(raw) -> dict:
    """The config checked before any model is loaded: known keys, known tasks and methods, counts whole."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    if not isinstance(raw, dict) or raw.get("kind") != "context":
        raise BadInput("a context benchmark config is a mapping with kind: context")
    unknown = set(raw) - CONFIG_KEYS
    if unknown:
        raise BadInput(f"unknown config keys {sorted(unknown)}; valid: {sorted(CONFIG_KEYS)}")
    methods = raw.get("methods")
    if not isinstance(methods, list) or not methods or any(m not in CONTEXT_METHODS for m in methods):
        raise BadInput(f"methods must be a non-empty list of {', '.join(CONTEXT_METHODS)}; got {methods!r}")
    tasks = raw.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise BadInput("tasks must be a non-empty list of {id: needles|summaries|documents, n: ..., ...}")
    for t in tasks:
        if not isinstance(t, dict) or t.get("id") not in TASKS or set(t) - TASK_KEYS:
            raise BadInput(f"a task is {{id: one of {', '.join(TASKS)}, keys among {sorted(TASK_KEYS)}}}; got {t!r}")
    responses = raw.get("responses") or {}
    if not isinstance(responses, dict) or not all(isinstance(v, str) and v for v in responses.values()):
        raise BadInput("responses must map example ids to non-empty response strings")
    return {**raw, "responses": responses}


def load_context_config(path) -> dict:
    """Read a YAML context config (`validate_context_config`)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise BadInput(f"no such config file: {str(p)!r}")
    return validate_context_config(yaml.safe_load(p.read_text(encoding="utf-8")))


def task_examples(task: dict, model, limit: int | None = None) -> list[ContextExample]:
    """A task's examples, lengths counted by the model's tokenizer; the first `limit` only."""
    tok = model.tokenizer

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    args = {k: v for k, v in task.items() if k != "id"}
    if limit is not None:
        args["n"] = min(int(args.get("n", limit)), limit)
    return TASKS[task["id"]](count_tokens=count, **args)


def run_context_benchmark(
    config: dict, *, model=None, limit: int | None = None, progress: bool = False
) -> pd.DataFrame:
    """Every task's examples attributed and evaluated; one row per task x method x metric: mean, std, n (NaN
    values left out of mean and counted in `nan`). `model`: an already loaded model (default: load the
    config's)."""
    from ctxmix.engine.models import load_model
    from ctxmix.methods.context import attribute_context

    config = validate_context_config(config)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadInput(f"limit must be a whole number of at least 1, got {limit!r}")
    if model is None:
        model = load_model(config["model"])
    ev = dict(config.get("evaluate") or {})
    stored = config["responses"]
    rows, dropped, responses = [], {}, {}
    t0 = time.perf_counter()
    for task in config["tasks"]:
        dropped[task["id"]] = []
        for ex in task_examples(task, model, limit):
            ca = attribute_context(
                model,
                ex.context,
                ex.query,
                response=stored.get(ex.id, ex.response),
                sources=ex.sources,
                methods=config["methods"],
                max_new_tokens=int(config.get("max_new_tokens", 64)),
                n_ablations=int(config.get("n_ablations", 32)),
                seed=int(config.get("seed", 0)),
                batch_size=int(config.get("batch_size", 8)),
                progress=progress,
            )
            responses[ex.id] = ca.response
            if ex.answer is not None and not contains_answer(ca.response, ex.answer):
                dropped[task["id"]].append(ex.id)
                continue
            table = ca.evaluate(model, gold=ex.gold or None, progress=progress, **ev)
            for rec in table.to_dict("records"):
                method = rec.pop("method")
                rows += [
                    {"task": task["id"], "example": ex.id, "method": method, "metric": k, "value": float(v)}
                    for k, v in rec.items()
                ]
    long = pd.DataFrame(rows, columns=["task", "example", "method", "metric", "value"])
    agg = (
        long.groupby(["task", "method", "metric"], sort=False)["value"]
        .agg(
            mean="mean",
            std=lambda v: float(np.std(v.dropna())) if v.notna().any() else np.nan,
            n="count",
            nan=lambda v: int(v.isna().sum()),
        )
        .reset_index()
    )
    agg.attrs.update(examples=long, dropped=dropped, responses=responses, seconds=time.perf_counter() - t0)
    return agg
