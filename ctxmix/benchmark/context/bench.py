"""Context attribution's offline benchmark: `configs/context.yaml` read by `load_context_config`, run by
`run_context_benchmark`. Over 500 lines because the config's checks, its stamps and the runner are read together.

    from ctxmix.benchmark.context.bench import load_context_config, run_context_benchmark
    table = run_context_benchmark(load_context_config("configs/context.yaml"), limit=2)

Each task's examples come from `ctxmix.benchmark.context.data` (lengths counted by the model's tokenizer);
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

from ctxmix.benchmark.context.data import (
    OFFLINE_TASKS,
    SPLITS,
    TASKS,
    ContextExample,
    contains_answer,
)
from ctxmix.benchmark.context.prompt_form import (
    at2_default_kind,
    call_form,
    check_at2_prompt,
    cut_at_stop,
    example_query,
    runs_at2,
)
from ctxmix.errors import BadInput

CONFIG_KEYS = {
    "name",
    "description",
    "kind",
    "model",
    "methods",
    "n_ablations",
    "seed",
    "mask_seeds",
    "max_new_tokens",
    "batch_size",
    "evaluate",
    "tasks",
    "responses",
    "check",
    "examples",
    "template",
    "query_suffix",
    "stop",
    "at2_weights",
    "at2_features",
}
TASK_KEYS = {"id", "n", "min_tokens", "max_tokens", "seed", "n_documents", "methods", "split", "query"}
CHECK_KEYS = {"tasks", "evaluate", "max_new_tokens"}
CHECK_PREFIX = "check/"  # a check example's id in `responses` and the tables: "check/needle-0"


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
        if t["id"] in OFFLINE_TASKS and t.get("split", "test") not in SPLITS:
            raise BadInput(f"task {t['id']}: split must be one of {', '.join(SPLITS)}; got {t['split']!r}")
        tm = t.get("methods")
        if tm is not None and (not isinstance(tm, list) or not tm or any(m not in methods for m in tm)):
            raise BadInput(f"task {t['id']}: methods must be a non-empty sublist of the config's {methods}; got {tm!r}")
    check = raw.get("check") or {}
    if not isinstance(check, dict) or set(check) - CHECK_KEYS:
        raise BadInput(f"check is a mapping with keys among {sorted(CHECK_KEYS)}; got {check!r}")
    for tid, over in (check.get("tasks") or {}).items():
        if tid not in TASKS or not isinstance(over, dict) or set(over) - TASK_KEYS:
            raise BadInput(f"check.tasks maps a task id ({', '.join(TASKS)}) to overrides among {sorted(TASK_KEYS)}")
    if raw.get("mask_seeds") not in (None, "example", "official"):
        raise BadInput(f"mask_seeds must be example (the default) or official; got {raw.get('mask_seeds')!r}")
    if raw.get("template") not in (None, "chat", "plain"):
        what = raw["template"]
        raise BadInput(f"template must be chat or plain (default: chat where the model has one); got {what!r}")
    if "query_suffix" in raw and (not isinstance(raw["query_suffix"], str) or not raw["query_suffix"]):
        raise BadInput(f"query_suffix must be a non-empty string; got {raw['query_suffix']!r}")
    if raw.get("stop") not in (None, "line", "sentence"):
        raise BadInput(f"stop must be line or sentence (where a generated response is cut); got {raw['stop']!r}")
    if "at2_weights" in raw and (not isinstance(raw["at2_weights"], str) or not raw["at2_weights"]):
        raise BadInput(f"at2_weights is a file path or untrained; got {raw['at2_weights']!r}")
    if "at2_features" in raw:
        from ctxmix.methods.context.at2 import ESTIMATORS

        if raw["at2_features"] not in ESTIMATORS:
            what = raw["at2_features"]
            raise BadInput(f"at2_features must be one of {', '.join(ESTIMATORS)} (default: the weights'); got {what!r}")
    if not isinstance(raw.get("examples") or {}, dict):
        raise BadInput("examples is a mapping (a record of what the tasks build: counts and lengths)")
    responses = raw.get("responses") or {}
    if not isinstance(responses, dict) or not all(isinstance(v, str) and v for v in responses.values()):
        raise BadInput("responses must map example ids to non-empty response strings")
    return {**raw, "responses": responses, "check": check}


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

    args = {k: v for k, v in task.items() if k not in ("id", "methods")}
    if limit is not None:
        args["n"] = min(int(args.get("n", limit)), limit)
    return TASKS[task["id"]](count_tokens=count, **args)


def with_check(config: dict, check: bool) -> dict:
    """The config a check run uses: `check.max_new_tokens` (shorter responses) over the config's."""
    c = config.get("check") or {}
    return {**config, "max_new_tokens": c["max_new_tokens"]} if check and "max_new_tokens" in c else config


def run_tasks(config: dict, check: bool = False) -> list[dict]:
    """The config's tasks, with `check.tasks`' overrides (shorter contexts) when `check`."""
    over = (config.get("check") or {}).get("tasks") or {} if check else {}
    return [{**t, **over.get(t["id"], {})} for t in config["tasks"]]


def example_key(ex: ContextExample, check: bool = False) -> str:
    """An example's id in `responses` and the tables ("needle-0"; "check/needle-0" in a check run)."""
    return CHECK_PREFIX + ex.id if check else ex.id


def check_rows(ca, table: pd.DataFrame) -> list[dict]:
    """What the shipped check compares for one evaluated example (`ctxmix.benchmark.shipped.context_check_moves`),
    rows {method, metric, index, value}: every method's per-source scores ("score", index = source); the
    measured quantities behind them, from float32 forward passes: log P(response | context) ("log_prob_full"),
    the held-out ablations' logit P(response) ("heldout", index = held-out mask; method "-") and ContextCite's
    own ablation targets ("cc_target", index = mask: what its LASSO is fitted to); the first held-out seed
    ("heldout_seed": the masks are `contextcite_masks(m, d, seed)`, the same on any machine), ContextCite's first
    seed under per-example seeds ("mask_seed"; the official scheme's is the config's seed); and the metrics
    of `evaluate` (index -1)."""
    from ctxmix.methods.context.ablation import aggregate

    ev = ca.evaluation
    rows = [{"method": "-", "metric": "log_prob_full", "index": -1, "value": float(ev["options"]["log_prob_full"])}]
    rows.append(
        {"method": "-", "metric": "heldout_seed", "index": -1, "value": float(ev["options"]["heldout_seeds"][0])}
    )
    if ca.options.get("seeds") == "example":  # ContextCite's first seed is the example's own (official: the config's)
        rows.append({"method": "-", "metric": "mask_seed", "index": -1, "value": float(ca.options["mask_seed"])})
    a, b = ev["options"]["span_tokens"]
    measured = aggregate(np.asarray(ev["logit_probs"])[:, a:b], False)
    rows += [{"method": "-", "metric": "heldout", "index": j, "value": float(v)} for j, v in enumerate(measured)]
    if "contextcite" in ca.ablations:
        y = aggregate(ca.ablations["contextcite"]["logit_probs"], bool(ca.options.get("compat", False)))
        rows += [
            {"method": "contextcite", "metric": "cc_target", "index": j, "value": float(v)} for j, v in enumerate(y)
        ]
    for m in ca.methods:
        rows += [{"method": m, "metric": "score", "index": i, "value": float(v)} for i, v in enumerate(ca.scores[m])]
    for rec in table.to_dict("records"):
        m = rec.pop("method")
        rows += [{"method": m, "metric": k, "index": -1, "value": float(v)} for k, v in rec.items()]
    return rows


def _load_done(path: Path | None) -> dict[tuple[str, str], dict]:
    """Finished examples of an interrupted run (one JSON object per line), keyed by (example id, stamp): a
    record made under another config (`config_stamp`: e.g. before its response was stored) is not reused."""
    import json

    if path is None or not path.is_file():
        return {}
    done = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill: that example is recomputed
            continue
        done[(rec["key"], rec.get("stamp", ""))] = rec
    return done


def append_done(path: Path, rec: dict) -> None:
    """Keep one finished example (`_load_done` reads it back): one JSON line, appended and flushed."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def at2_weights_sha256(config: dict) -> str | None:
    """The hash of the AT2 weights file a context config's at2_exact reads (`at2.weights_file_sha16`; None where no
    task runs at2_exact or its weights are untrained): a retrained shipped file changes the numbers, not the
    config."""
    from ctxmix.methods.context.at2 import weights_file_sha16

    if not runs_at2(config):
        return None
    weights = config.get("at2_weights", (config.get("at2") or {}).get("weights"))  # a config's key, or the group
    return weights_file_sha16(str(config.get("model")), weights)


def config_stamp(config: dict, check: bool, task: dict, response: str | None) -> str:
    """A hash of everything that changes one example's numbers: the config but its other examples' responses,
    the check switch, the task (with its check overrides), the example's stored response and the AT2 weights
    file's hash (`at2_weights_sha256`) and, where it is not F-logit, the kind its validation table chose
    (`at2_default_kind`)."""
    import hashlib
    import json

    rest = {k: v for k, v in config.items() if k != "responses"}
    parts = [rest, check, task, response]
    weights = at2_weights_sha256(config)
    if weights is not None:  # appended only where at2_exact reads a file: other configs keep their stamps
        parts.append(weights)
        from ctxmix.methods.context.at2 import DEFAULT_KIND

        kind = at2_default_kind(config)
        if kind not in (None, DEFAULT_KIND):  # a default chosen anew on validation changes the results too
            parts.append(kind)
    raw = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def run_context_benchmark(
    config: dict,
    *,
    model=None,
    limit: int | None = None,
    progress: bool = False,
    check: bool = False,
    resume: str | Path | None = None,
    log=None,
) -> pd.DataFrame:
    """Every task's examples attributed and evaluated; one row per task x method x metric: mean, std, n (NaN
    values left out of mean and counted in `nan`). `model`: an already loaded model (default: load the
    config's). check: the config's `check` sizes (shorter contexts, `check.evaluate`), ids prefixed
    "check/". resume: a JSON-lines file that keeps each finished example (a killed run loses at most the
    example in progress; the same file resumes it). log: a callable given one line per example (progress).

    attrs: examples (per-example rows), check (`check_rows` of every kept example, with task and example),
    dropped (ids per task), responses (id -> text used), seconds (this call), example_seconds (id ->)."""
    from ctxmix.engine.models import load_model
    from ctxmix.methods.context.attribution import attribute_context

    config = with_check(validate_context_config(config), check)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadInput(f"limit must be a whole number of at least 1, got {limit!r}")
    check_at2_prompt(config)
    if model is None:
        model = load_model(config["model"])
    ev = dict(config.get("evaluate") or {})
    if check:
        ev.update((config.get("check") or {}).get("evaluate") or {})
    stored = config["responses"]
    resume = Path(resume) if resume is not None else None
    done = _load_done(resume)
    rows, crows, dropped, responses, secs = [], [], {}, {}, {}
    t0 = time.perf_counter()
    for task in run_tasks(config, check):
        dropped[task["id"]] = []
        for ex in task_examples(task, model, limit):
            key = example_key(ex, check)
            stamp = config_stamp(config, check, task, stored.get(key))
            rec = done.get((key, stamp))
            if rec is None:
                t1 = time.perf_counter()
                methods = task.get("methods") or config["methods"]
                rec = _one_example(
                    model, config, methods, ex, stored.get(key, ex.response), ev, progress, attribute_context
                )
                rec.update(key=key, task=task["id"], seconds=time.perf_counter() - t1, stamp=stamp)
                if resume is not None:
                    append_done(resume, rec)
            responses[key] = rec["response"]
            secs[key] = rec["seconds"]
            if rec["dropped"]:
                dropped[task["id"]].append(key)
            rows += [{"task": task["id"], "example": key, **r} for r in rec["rows"]]
            crows += [{"task": task["id"], "example": key, **r} for r in rec["check"]]
            if log is not None:
                what = "dropped (the response lacks the answer)" if rec["dropped"] else "done"
                log(f"{task['id']} {key}: {what} in {rec['seconds']:.1f} s; response {rec['response'][:60]!r}")
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
    from ctxmix.benchmark.context.metrics import context_metric

    agg["higher_is_better"] = [int(bool(context_metric(m).higher_is_better)) for m in agg["metric"]]
    agg.attrs.update(
        examples=long,
        check=pd.DataFrame(crows, columns=["task", "example", "method", "metric", "index", "value"]),
        dropped=dropped,
        responses=responses,
        seconds=time.perf_counter() - t0,
        example_seconds=secs,
    )
    return agg


def _one_example(
    model, config: dict, methods: list, ex: ContextExample, response, ev: dict, progress: bool, attribute
) -> dict:
    """One example attributed and (unless dropped) evaluated: {response, dropped, rows, check}. A stored response
    that lacks the needle's answer is dropped before any pass."""
    if response is None and config.get("stop"):  # generated here, cut at the stop text, then explained
        response = generate_response(model, config, ex)[0]
    if response is not None and ex.answer is not None and not contains_answer(response, ex.answer):
        return {"response": response, "dropped": True, "rows": [], "check": []}
    ca = attribute(
        model,
        ex.context,
        example_query(config, ex),
        response=response,
        sources=ex.sources,
        methods=methods,
        prompt=call_form(config),
        # None: the model's shipped weights, and their default kind (chosen on their validation table)
        at2={"weights": config.get("at2_weights"), "features": config.get("at2_features")},
        max_new_tokens=int(config.get("max_new_tokens", 64)),
        ablations={
            "n": int(config.get("n_ablations", 32)),
            "seed": int(config.get("seed", 0)),
            "seeds": config.get("mask_seeds") or "example",
            "batch_size": int(config.get("batch_size", 8)),
        },
        progress=progress,
        share_trace=False,  # each method's seconds are its own (the time columns), not alti_logit's full trace
    )
    if ex.answer is not None and not contains_answer(ca.response, ex.answer):
        return {"response": ca.response, "dropped": True, "rows": [], "check": []}
    table = ca.evaluate(model, gold=ex.gold or None, progress=progress, **ev)
    rows = []
    for rec in table.to_dict("records"):
        method = rec.pop("method")
        rows += [{"method": method, "metric": k, "value": float(v)} for k, v in rec.items()]
    rows += cost_rows(ca.cost)
    return {"response": ca.response, "dropped": False, "rows": rows, "check": check_rows(ca, table)}


def cost_rows(cost: dict) -> list[dict]:
    """Each method's seconds on the example and, beside a ContextCite run, their ratio to ContextCite's."""
    rows = [{"method": m, "metric": "seconds", "value": float(c["seconds"])} for m, c in cost.items()]
    ref = (cost.get("contextcite") or {}).get("seconds")
    if ref:
        rows += [{"method": r["method"], "metric": "time_vs_contextcite", "value": r["value"] / ref} for r in rows]
    return rows


def write_tables(table: pd.DataFrame, out: Path) -> list[Path]:
    """The run's tables as CSV in `out`: aggregates.csv (task x method x metric: mean, std, n, nan,
    higher_is_better), examples.csv (per example), check.csv (`check_rows`), responses.yaml (id -> response:
    paste into the config's `responses`) and dropped.yaml (per task)."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "aggregates.csv", out / "examples.csv", out / "check.csv"]
    table.to_csv(paths[0], index=False, float_format="%.10g")
    table.attrs["examples"].to_csv(paths[1], index=False, float_format="%.10g")
    table.attrs["check"].to_csv(paths[2], index=False, float_format="%.17g")  # float64 exactly (the shipped check)
    for name in ("responses", "dropped"):
        paths.append(out / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(table.attrs[name], sort_keys=False, allow_unicode=True), encoding="utf-8")
    return paths


def context_table(agg: pd.DataFrame, task: str, value: str = "mean") -> pd.DataFrame:
    """One task's method x metric table of `value` ("mean" or "std" over examples; columns "metric ↑" or
    "metric ↓" by the metric's direction, in the order topk_drop@k, lds, recall@k), with "n" (examples)."""
    t = agg[agg["task"] == task]
    head = {m: f"{m} {'↑' if h else '↓'}" for m, h in zip(t["metric"], t["higher_is_better"])}
    order = sorted(head, key=lambda m: (m.split("@")[0] != "topk_drop", m.split("@")[0] == "recall", m))
    methods = list(dict.fromkeys(t["method"]))
    out = t.pivot(index="method", columns="metric", values=value)[order].rename(columns=head).loc[methods]
    out["n"] = t.groupby("method")["n"].max().loc[methods]
    out.columns.name = None
    return out


def format_table(table: pd.DataFrame) -> str:
    """One method x metric block per task (mean ± std, n), each metric's direction in its header."""
    blocks = []
    for task, t in table.groupby("task", sort=False):
        cell = t.assign(
            cell=[f"{m:.3f} ± {s:.3f} (n={n})" for m, s, n in zip(t["mean"], t["std"], t["n"])],
            head=[f"{k} {'↑' if h else '↓'}" for k, h in zip(t["metric"], t["higher_is_better"])],
        )
        wide = cell.pivot(index="method", columns="head", values="cell").rename_axis(columns=None)
        blocks.append(f"== {task} ==\n{wide.to_string()}")
    return "\n\n".join(blocks)


def cmd_context_bench(args) -> None:
    """`ctxmix bench --config <kind: context>`: run (or resume) it, print one line per example and the tables,
    write them (`write_tables`) to --out (default results/<name>/). --db: the resume file (default
    results/<name>.jsonl; results/<name>-check.jsonl with --check-sizes). --threads: torch threads."""
    import sys

    config = load_context_config(args.config)
    name = config.get("name") or Path(args.config).stem
    check = bool(getattr(args, "check_sizes", False))
    if args.check:
        print(
            f"config {args.config} is valid: kind context, tasks {', '.join(t['id'] for t in config['tasks'])}, "
            f"methods {', '.join(config['methods'])}"
        )
        return
    for flag in ("report", "figures", "fresh"):
        if getattr(args, flag, False):
            raise BadInput(
                f"--{flag} is not available for kind: context configs (delete the --db file to start afresh)"
            )
    if getattr(args, "executor", "local") != "local":
        raise BadInput("kind: context configs run with --executor local only")
    if args.threads:
        import torch

        torch.set_num_threads(int(args.threads))
    suffix = "-check" if check else ""
    db = Path(args.db) if args.db else Path("results") / f"{name}{suffix}.jsonl"
    out = Path(args.out) if args.out else Path("results") / f"{name}{suffix}"
    print(f"context benchmark {name!r}{' (check sizes)' if check else ''}: finished examples kept in {db}", flush=True)
    try:
        table = run_context_benchmark(
            config, limit=args.limit, check=check, resume=db, log=lambda line: print(line, flush=True)
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished examples are kept in {db}: run the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
    print(format_table(table))
    dropped = {k: len(v) for k, v in table.attrs["dropped"].items()}
    print(f"dropped (response lacks the answer): {dropped}; {table.attrs['seconds']:.0f} s")
    for p in write_tables(table, out):
        print(f"wrote {p}")


def generate_response(model, config: dict, ex: ContextExample) -> tuple[str, int, int]:
    """(response, prompt tokens, sources) of one example: greedy, as `attribute_context` would generate it (the
    same prompt and `max_new_tokens`, end-of-sequence dropped), cut at the config's `stop`."""
    from ctxmix.methods.context.prompt import PromptBuilder, make_response
    from ctxmix.methods.context.sources import make_sources

    src = make_sources(ex.context, ex.sources)
    builder = PromptBuilder(model, example_query(config, ex), config.get("template"), False)
    prompt = builder.encode(src)
    resp = make_response(model, builder, src, prompt, None, int(config.get("max_new_tokens", 64)), False)
    return cut_at_stop(resp.text, config.get("stop")), len(prompt.ids), len(src)


def generate_responses(
    config: dict, model, *, check: bool = False, limit: int | None = None, log=None, skip=frozenset()
) -> dict:
    """Every example's greedy response (`generate_response`), with no attribution: {key: response}. `check`:
    the check sizes' examples ("check/..." keys); `skip`: keys left out (responses already stored). Cheap next
    to a run: one generation per example."""
    config = with_check(validate_context_config(config), check)
    out = {}
    for task in run_tasks(config, check):
        for ex in task_examples(task, model, limit):
            key = example_key(ex, check)
            if key in skip:
                continue
            text, n_prompt, n_sources = generate_response(model, config, ex)
            out[key] = text
            if log is not None:
                ok = ex.answer is None or contains_answer(text, ex.answer)
                log(f"{key}: {n_prompt} prompt tokens, {n_sources} sources, {'' if ok else 'DROPPED '}{text!r}")
    return out


def store_responses(path: str | Path, responses: dict) -> None:
    """Rewrite the `responses:` block that ends a config file (comments above it kept) with `responses`."""
    import yaml

    p = Path(path)
    text = p.read_text(encoding="utf-8")
    head, sep, _ = text.partition("\nresponses:")
    if not sep:
        raise BadInput(f"{p} has no final `responses:` block to fill")
    body = yaml.safe_dump(responses, sort_keys=False, allow_unicode=True, width=1000)
    block = "\n".join("  " + line for line in body.splitlines())
    p.write_text(f"{head}\nresponses:   # example id -> greedy response (bench/context_responses.py)\n{block}\n")
    validate_context_config(yaml.safe_load(p.read_text(encoding="utf-8")))
