"""Held-out faithfulness of any context-attribution methods on the validation split (docs/context.md, "Key-mask
gradient"): which one-pass method comes closest to ContextCite's 32 ablations.

    python bench/onepass_eval.py --model smollm2 --out out/onepass_eval --needles 10 --summaries 10 --threads 1 \
        --methods logit attention alti_logit grad_x_input key_mask_grad key_mask_ig contextcite

Examples: the needles and summaries of the validation split built as bench/at2_eval.py builds them (`needle_examples` /
`summary_examples`, 200-400 tokens, seed 0; texts the benchmark's test examples never use), and, shaped like the
benchmark's other two test tasks, --documents questions over five documents (`document_examples`, 40-120 tokens each)
and --long contexts of 1,000-4,000 tokens (`long_examples`, needles and summaries in turn), all of the validation split;
the response generated greedily (at most --max-new-tokens, at2_eval's 48). Per example, one `attribute_context` call
with every method (ContextCite with --masks ablations), then `evaluate` with --masks held-out removal ablations (seeds
disjoint from ContextCite's), k = 1 and 3, the needle's sentence as gold: LDS, top-k log-probability drops (natural log,
higher is better), recall@1; and each method's `cost["seconds"]` (each method's own passes: `share_trace=False`;
--shared-trace lets logit and attention share alti_logit's full trace, as runs before 2026-11-27 did). One JSON line per
finished example in OUT/examples.jsonl (a killed run resumes).
Prints the table (mean over examples, LDS ± its standard error) and writes OUT/onepass_eval.md.

These are the tables defaults are chosen on (validation, never the benchmark's test split): a table asked in the
form a model is asked in by default (a chat model: no --prompt-from; a base model: --prompt-from its benchmark
config, the cue and the first-sentence cut) chooses the Context attribution page's default methods for its model,
and a table with --at2-weights chooses those weights' default kind (`at2.default_kind`, on the four tasks' shapes).
--ship writes it to ctxmix/benchmark/shipped/ (onepass-validation[-MODEL].json, or --name) and rewrites the shipped
defaults from every shipped table (`ctxmix.benchmark.context.defaults`: ctxmix/methods/context/defaults.json, the
one file the methods layer reads).

    python bench/onepass_eval.py --out out/onepass_eval --report --ship   # ship the examples stored so far
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ctxmix, not an installed one

from ctxmix.methods.context.at2 import VALIDATION_TASKS as TASKS  # noqa: E402  # the test tasks' validation twins

SPLIT = "validation"
DEFAULT_METHODS = ["logit", "attention", "alti_logit", "grad_x_input", "key_mask_grad", "key_mask_ig", "contextcite"]


def score_example(
    model,
    ex,
    methods: list[str],
    masks: int,
    max_new_tokens: int,
    share_trace: bool = False,
    at2_weights=None,
    prompt: dict | None = None,
    task: str | None = None,
) -> dict:
    """One example's evaluation row per method: {"id", "kind", "task" (`TASKS`; default the kind), "tokens", "T",
    "methods": {m: {lds, topk_drop@1, topk_drop@3, recall@1, seconds}}}. at2_weights (a file from `ctxmix
        at2-train`): also a row "at2_exact/<kind>" per estimator in it, scored against the same held-out ablations (LDS,
    recall@1 and seconds; no top-k drops,
    which would need each ranking's own removal passes). prompt: a context config's prompt form
    (`ctxmix.benchmark.context.prompt_form`: a base model's template, answer cue and stop, the response generated
    and cut as the benchmark's `generate_response` does)."""
    import ctxmix
    from ctxmix.benchmark.context.metrics import lds, recall_at
    from ctxmix.benchmark.context.prompt_form import call_form, example_query
    from ctxmix.methods.context.ablation import aggregate

    form = dict(prompt or {})
    query = example_query(form, ex)
    response = ex.response
    if response is None and form.get("stop"):
        from ctxmix.benchmark.context.bench import generate_response

        response = generate_response(model, {**form, "max_new_tokens": max_new_tokens}, ex)[0]
    ca = ctxmix.attribute_context(
        model,
        ex.context,
        query,
        sources=ex.sources,
        prompt=call_form(form),
        methods=methods,
        response=response,
        max_new_tokens=max_new_tokens,
        ablations={"n": masks},
        progress=False,
        share_trace=share_trace,
    )
    gold = list(ex.gold) or None
    ev = ca.evaluate(model, k=(1, 3), n_ablations=masks, gold=gold, progress=False).set_index("method")
    out = {}
    for m in methods:
        r = ev.loc[m]
        out[m] = {
            "lds": float(r["lds"]),
            "topk_drop@1": float(r["topk_drop@1"]),
            "topk_drop@3": float(r["topk_drop@3"]),
            "recall@1": float(r["recall@1"]) if gold else math.nan,
            "seconds": float(ca.cost[m]["seconds"]),
        }
    if at2_weights is not None:
        from ctxmix.methods.context.at2 import load_weights

        a, b = ca.evaluation["options"]["span_tokens"]
        measured = aggregate(np.asarray(ca.evaluation["logit_probs"])[:, a:b], False)
        for kind in load_weights(at2_weights)[0]:
            c = ctxmix.attribute_context(
                model,
                ex.context,
                query,
                sources=ex.sources,
                prompt=call_form(form),
                methods=["at2_exact"],
                response=ca.response,
                at2={"features": kind, "weights": at2_weights},
                progress=False,
            )
            if c.response_ids != ca.response_ids:  # the text re-tokenised otherwise: other rows than measured
                raise RuntimeError(f"{ex.id}: the response's ids differ between the calls; store the response")
            s = c.scores["at2_exact"]
            out[f"at2_exact/{kind}"] = {
                "lds": lds(s, ca.evaluation["masks"], measured),
                "topk_drop@1": math.nan,
                "topk_drop@3": math.nan,
                "recall@1": float(recall_at(s, gold, 1)) if gold else math.nan,
                "seconds": float(c.cost["at2_exact"]["seconds"]),
            }
    return {
        "id": ex.id,
        "kind": ex.kind,
        "task": task or ex.kind,
        "tokens": len(ca.prompt_ids),
        "T": len(ca.response_ids),
        "response": ca.response,
        "methods": out,
    }


def table(records: list[dict], methods: list[str]) -> str:
    """Markdown of `summary`: per method, LDS mean ± se over the examples, per kind, recall@1 over the needles,
    top-k drops, seconds and the time ratio to ContextCite (means; "-" where not measured)."""
    return markdown(summary(records, methods))


def markdown(means: dict) -> str:
    """The table of a `summary` (or of a shipped file's "methods", where null stands for not measured). The LDS
    columns of the documents and long tasks only where some row measured them (a table of needles and summaries
    keeps its first form)."""
    measured = lambda x: x is not None and not math.isnan(x)  # noqa: E731  # null in a shipped file, NaN in a summary
    extra = [t for t in TASKS[2:] if any(measured(r.get(f"lds_{t}")) for r in means.values())]
    head = (
        "| method | LDS (mean ± se) | LDS needles | LDS summaries | "
        + "".join(f"LDS {t} | " for t in extra)
        + "recall@1 needles | top-1 drop | top-3 drop | seconds | time vs contextcite |\n|"
        + "---|" * (9 + len(extra))
        + "\n"
    )

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None or math.isnan(x) else format(x, spec)

    lines = []
    for m, r in means.items():
        lines.append(
            f"| `{m}` | {f(r['lds'], '.3f')} ± {f(r['lds_se'], '.3f')} | {f(r['lds_needles'], '.3f')} | "
            f"{f(r['lds_summaries'], '.3f')} | "
            + "".join(f"{f(r.get(f'lds_{t}'), '.3f')} | " for t in extra)
            + f"{f(r['recall@1_needles'], '.2f')} | {f(r['topk_drop@1'], '.3f')} | "
            f"{f(r['topk_drop@3'], '.3f')} | {f(r['seconds'], '.1f')} | {f(r['time_vs_contextcite'], '.3f')} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--needles", type=int, default=10)
    p.add_argument("--summaries", type=int, default=10)
    p.add_argument("--documents", type=int, default=0, help="questions over five documents (the documents task's form)")
    p.add_argument("--long", type=int, default=0, help="contexts of 1,000-4,000 tokens (the long task's form)")
    p.add_argument("--masks", type=int, default=32, help="ContextCite's ablations and evaluate's held-out ones")
    p.add_argument("--min-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--report", action="store_true", help="print the table of the examples stored so far, run nothing")
    p.add_argument("--shared-trace", action="store_true", help="logit and attention share alti_logit's full trace")
    p.add_argument("--ship", action="store_true", help="write the table to ctxmix/benchmark/shipped/")
    p.add_argument(
        "--name",
        help="the shipped table's name (default onepass-validation[-MODEL]; a second table of a model, asked in "
        "another prompt form, needs its own)",
    )
    p.add_argument("--at2-weights", help="an at2_weights.npz: also a row at2_exact/<kind> per estimator in it")
    p.add_argument(
        "--prompt-from",
        metavar="CONFIG",
        help="a context config whose prompt form (template, query_suffix, stop) to ask with: a base model's",
    )
    a = p.parse_args(argv)
    import torch

    import ctxmix
    from ctxmix.benchmark.context.data import document_examples, long_examples, needle_examples, summary_examples

    if a.threads:
        torch.set_num_threads(a.threads)
    model = ctxmix.load_model(a.model)
    tok = model.tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    needles = needle_examples(a.needles, a.min_tokens, a.max_tokens, 0, count, split=SPLIT)
    summaries = summary_examples(a.summaries, a.min_tokens, a.max_tokens, 0, count, split=SPLIT)
    # alternating, so that a run stopped early has both kinds
    exs = [e for pair in zip(needles, summaries) for e in pair]
    exs += needles[len(summaries) :] + summaries[len(needles) :]
    tasks = {e.id: e.kind for e in exs}
    # the test tasks' other two forms at the benchmark config's sizes (configs/context.yaml: documents 40-120 tokens
    # each, five of them; long 1,000-4,000), after the short ones, so the records made before stay first
    for task, more in (
        ("documents", document_examples(a.documents, 5, 40, 120, 0, count, split=SPLIT) if a.documents else []),
        ("long", long_examples(a.long, 1000, 4000, 0, count, split=SPLIT) if a.long else []),
    ):
        exs += more
        tasks.update((e.id, task) for e in more)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "examples.jsonl"
    key = {"model": model.name, "methods": a.methods, "masks": a.masks, "max_new_tokens": a.max_new_tokens}
    key["share_trace"] = bool(a.shared_trace)
    prompt = {}
    if a.prompt_from:
        from ctxmix.benchmark.context.bench import load_context_config
        from ctxmix.benchmark.context.prompt_form import prompt_form

        prompt = prompt_form(load_context_config(a.prompt_from))
        key["prompt"] = prompt  # only when given: the records made before the option keep their key
    if a.at2_weights:  # the file's hash: other weights, other rows
        from ctxmix.benchmark.context.prompt_form import check_weights_form
        from ctxmix.errors import BadInput
        from ctxmix.methods.context.at2 import weights_file_sha16

        key["at2_weights_sha256"] = weights_file_sha16(model, a.at2_weights)
        try:
            check_weights_form(a.at2_weights, prompt)
        except BadInput as e:
            sys.exit(str(e))
    records = [json.loads(line) for line in store.read_text().splitlines()] if store.exists() else []
    for r in records:  # records from before the option shared the trace
        r.get("key", {}).setdefault("share_trace", True)
    records = [r for r in records if r.get("key") == key]
    done = {r["id"] for r in records}
    for ex in exs:
        if ex.id in done or a.report:
            continue
        t0 = time.perf_counter()
        rec = score_example(
            model, ex, a.methods, a.masks, a.max_new_tokens, a.shared_trace, a.at2_weights, prompt, tasks[ex.id]
        )
        rec["key"] = key
        rec["wall_seconds"] = time.perf_counter() - t0
        with store.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        records.append(rec)
        print(f"{ex.id}: {rec['tokens']} prompt tokens, T = {rec['T']}, {rec['wall_seconds']:.0f} s", flush=True)
    shown = list(dict.fromkeys([*a.methods, *(m for r in records for m in r["methods"])]))  # with at2_exact/<kind>
    md = table(records, shown)
    counts = ", ".join(f"{sum(_task(r) == t for r in records)} {t}" for t in TASKS)
    md += f"\n{len(records)} examples ({counts}), {SPLIT} split\n"
    print(md)
    (out / "onepass_eval.md").write_text(md)
    if a.ship:
        path = ship(records, key, shown, a.name)
        print(f"wrote {path}")
        from ctxmix.benchmark.context.defaults import write_defaults

        print(f"wrote {write_defaults()} (the defaults the methods layer reads, chosen anew on the shipped tables)")


def summary(records: list[dict], methods: list[str]) -> dict:
    """{method: {"lds", "lds_se", "lds_<task>" per task of `TASKS`, "recall@1_needles", "topk_drop@1", "topk_drop@3",
    "seconds", "time_vs_contextcite", "n"}}: means over the examples (NaN values left out; a task's mean NaN where
    it has no example)."""
    out = {}
    for m in methods:
        rows = [r["methods"][m] for r in records if m in r["methods"]]
        kinds = [_task(r) for r in records if m in r["methods"]]

        def mean(key, kind=None, rows=rows, kinds=kinds):
            v = np.array([x[key] for x, k in zip(rows, kinds) if kind in (None, k)], dtype=float)
            v = v[~np.isnan(v)]
            return (float(v.mean()) if len(v) else math.nan), v

        lds, v = mean("lds")
        out[m] = {
            "lds": lds,
            "lds_se": float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan,
            **{f"lds_{t}": mean("lds", t)[0] for t in TASKS},
            "recall@1_needles": mean("recall@1", "needles")[0],
            "topk_drop@1": mean("topk_drop@1")[0],
            "topk_drop@3": mean("topk_drop@3")[0],
            "seconds": mean("seconds")[0],
            # the mean over examples of the ratio on each (ContextCite's 32 ablations and LASSO on the same example)
            "time_vs_contextcite": _mean(
                [r["methods"][m]["seconds"] / r["methods"]["contextcite"]["seconds"] for r in records if _both(r, m)]
            ),
            "n": len(rows),
        }
    return out


def _task(record: dict) -> str:
    """The test task an example is shaped like (records from before --documents and --long: its kind)."""
    return record.get("task", record["kind"])


def _both(record: dict, m: str) -> bool:
    """Both m's and ContextCite's time measured on the example (the ratio's examples)."""
    if m not in record["methods"]:
        return False
    own, cc = record["methods"][m].get("seconds", math.nan), record["methods"].get("contextcite", {}).get("seconds", 0)
    return not math.isnan(own) and cc > 0


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def ship(records: list[dict], key: dict, methods: list[str], name: str | None = None) -> Path:
    """ctxmix/benchmark/shipped/<name>.json (default onepass-validation[-<model>]): the table and what made it."""
    import datetime
    import platform

    from ctxmix import __version__
    from ctxmix.benchmark.shipped import SHIPPED

    # smollm2's table keeps its first name (the page's test reads it); another model's is named after it
    default = "onepass-validation" if key["model"] == "smollm2" else f"onepass-validation-{key['model']}"
    name = name or default
    if not name.startswith("onepass-validation"):  # what at2.shipped_tables reads
        raise SystemExit(f"--name must start with onepass-validation, got {name!r}")
    meta = {
        "name": name,
        "kind": "onepass-validation",
        "split": SPLIT,
        "model": key["model"],
        "examples": len(records),
        "needles": sum(_task(r) == "needles" for r in records),
        "tasks": {t: sum(_task(r) == t for r in records) for t in TASKS},
        "masks": key["masks"],
        "max_new_tokens": key["max_new_tokens"],
        "share_trace": key["share_trace"],
        # the at2_exact/<kind> rows' weights (at2.weights_file_sha16): the shipped defaults match the file's rows by it
        "at2_weights_sha256": key.get("at2_weights_sha256"),
        "prompt": key.get("prompt", {}),
        "command": "python bench/onepass_eval.py " + " ".join(sys.argv[1:]),
        "ctxmix_version": __version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        # not measured (NaN: the at2_exact/<kind> rows' top-k drops) as null: strict JSON
        "methods": {
            m: {k: None if math.isnan(v) else v for k, v in r.items()} for m, r in summary(records, methods).items()
        },
    }
    path = SHIPPED / f"{name}.json"
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


if __name__ == "__main__":
    main()
