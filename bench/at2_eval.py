"""Held-out comparison of at2_exact's feature kinds, untrained and trained (docs/context.md, "`at2_exact`").

    python bench/at2_eval.py --model smollm2 --weights out/at2/at2_weights.npz --out out/at2_eval \
        --needles 10 --summaries 10 --masks 32 --threads 1

Examples: the needles and summaries of the validation split (`ctxmix.benchmark.context.data`, "Splits": Lee
background news texts and needle facts that the benchmark's test examples never use, disjoint from the Wikipedia
training set too), 200-400 tokens, responses generated greedily. This table is where at2_exact chooses between
trained and uniform weights per feature kind (`ctxmix.methods.context.at2.resolve_weights`; the default kind is
chosen on bench/onepass_eval.py's table of the four test tasks' shapes, this one only for a file no shipped table
scored), so it is built on validation and never on the benchmark's test split. Per example
(`at2_train.build_example`, one file each, resumable): every feature kind from one traced pass, the whole
response as the target unit, and `--masks` held-out removal ablations drawn with ContextCite's generator at
seeds from LDS_SEED = 10,000 (disjoint from the training masks' 0..31). For each kind x {untrained (1/(L H)),
trained (the weights file)}: a source's score is w . f(response, source) (AT2's estimator); LDS is
`context_metrics.lds` (Spearman of masks @ scores against the measured logit P(response)), averaged over
examples; recall@1 on the needles; top-1 and top-3 log-probability drops (removal, natural log, higher is
better). untrained "attn" is the `attention` method; untrained "logit" ranks sources
as the `logit` method does (the same scores up to the factor L H T: its embedding column is never a source).
Prints the table (markdown) and writes it to OUT/at2_eval.json.
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

SPLIT = "validation"  # where a default is chosen: never the benchmark's test split


def table(examples: list[dict], weights: dict[str, np.ndarray]) -> list[dict]:
    from ctxmix.benchmark.context.metrics import lds, recall_at
    from ctxmix.methods.context.ablation import aggregate

    rows = []
    for kind, trained in _estimators(weights):
        w = _weights(weights, kind, trained)
        ld = {"needles": [], "summaries": []}
        rec = []
        for e in examples:
            s = _features(e, kind)[0] @ w  # (d,)
            measured = aggregate(e["logit_probs"])
            v = lds(s, e["masks"], measured)
            ld[e["meta"]["kind"]].append(v)
            if e["meta"]["gold"]:
                rec.append(recall_at(s, e["meta"]["gold"], 1))
        allv = [x for v in ld.values() for x in v if not math.isnan(x)]
        se = float(np.std(allv, ddof=1) / math.sqrt(len(allv))) if len(allv) > 1 else math.nan
        rows.append(
            {
                "features": kind,
                "weights": "trained" if trained else "untrained",
                "lds": float(np.mean(allv)) if allv else math.nan,
                "lds_se": se,
                "lds_needles": float(np.nanmean(ld["needles"])) if ld["needles"] else math.nan,
                "lds_summaries": float(np.nanmean(ld["summaries"])) if ld["summaries"] else math.nan,
                "recall@1_needles": float(np.mean(rec)) if rec else math.nan,
                "n": len(allv),
            }
        )
    return rows


def _weights(weights: dict[str, np.ndarray], kind: str, trained: bool) -> np.ndarray:
    K = len(weights[kind])
    return weights[kind] if trained else np.full(K, 1.0 / K)


def _estimators(weights: dict[str, np.ndarray]) -> list[tuple[str, bool]]:
    """(kind, trained) rows: every single kind untrained and trained, each combination trained only (it has no
    untrained form) where the weights file holds it."""
    from ctxmix.methods.context.at2 import COMBINATIONS, KINDS

    rows = [(k, t) for k in KINDS for t in (False, True)]
    return rows + [(c, True) for c in COMBINATIONS if c in weights]


def _features(e: dict, kind: str) -> np.ndarray:
    """(U, d, K) float64: an example's unit features for an estimator (a combination's kinds stacked)."""
    from ctxmix.methods.context.at2 import estimator_kinds, stacked_features

    return stacked_features({k: e[f"features_{k}"] for k in estimator_kinds(kind)}, kind).astype(np.float64)


def topk_drops(
    model, exs, examples: list[dict], weights: dict[str, np.ndarray], ks=(1, 3), prompt: dict | None = None
) -> dict:
    """{(kind, "trained"/"untrained"): {k: mean over examples of log P(response | context) - log P(response |
    context without the top-k sources)}}: removal ablations (`context_ablation.response_logit_probs`), each
    distinct mask of an example once; prompt: the examples' prompt form (`ctxmix.benchmark.context.prompt_form`)."""
    from ctxmix.benchmark.context.metrics import topk_drop, without_top
    from ctxmix.benchmark.context.prompt_form import example_query
    from ctxmix.methods.context.ablation import log_probs, response_logit_probs
    from ctxmix.methods.context.prompt import PromptBuilder
    from ctxmix.methods.context.sources import make_sources

    rows = [(k, "trained" if t else "untrained") for k, t in _estimators(weights)]
    out: dict = {row: {kk: [] for kk in ks} for row in rows}
    for ex, e in zip(exs, examples):
        src = make_sources(ex.context, ex.sources)
        form = prompt or {}
        builder = PromptBuilder(model, example_query(form, ex), form.get("template"))
        d = len(src)
        masks = {np.ones(d, bool).tobytes(): np.ones(d, bool)}
        want = {}
        for kind, t in rows:
            s = _features(e, kind)[0] @ _weights(weights, kind, t == "trained")
            for kk in ks:
                if kk < d:
                    mk = without_top(s, kk)
                    masks.setdefault(mk.tobytes(), mk)
                    want[(kind, t, kk)] = mk.tobytes()
        keys = list(masks)
        lp = response_logit_probs(model, [builder.ids(src.rebuild(masks[k])) for k in keys], list(e["response_ids"]))
        logp = dict(zip(keys, log_probs(lp)))
        full = logp[np.ones(d, bool).tobytes()]
        for (kind, t, kk), key in want.items():
            out[(kind, t)][kk].append(topk_drop(full, logp[key]))
    return {key: {kk: float(np.mean(v)) for kk, v in d_.items()} for key, d_ in out.items()}


def markdown(rows: list[dict]) -> str:
    head = "| features | weights | LDS (mean ± se) | LDS needles | LDS summaries | recall@1 needles | "
    head += "top-1 drop | top-3 drop |\n"
    head += "|---|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['features']} | {r['weights']} | {r['lds']:.3f} ± {r['lds_se']:.3f} | {r['lds_needles']:.3f} | "
        f"{r['lds_summaries']:.3f} | {r['recall@1_needles']:.2f} | {r.get('topk_drop@1', float('nan')):.3f} | "
        f"{r.get('topk_drop@3', float('nan')):.3f} |\n"
        for r in rows
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default=None, help="an at2_weights.npz (default: the shipped weights)")
    p.add_argument("--out", required=True)
    p.add_argument("--needles", type=int, default=10)
    p.add_argument("--summaries", type=int, default=10)
    p.add_argument("--masks", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--ship", action="store_true", help="copy the weights, with this table in their provenance, into the package"
    )
    a = p.parse_args(argv)
    import torch

    import ctxmix
    from ctxmix.benchmark.context.at2_train import build_set, load_set
    from ctxmix.benchmark.context.data import contains_answer, needle_examples, summary_examples
    from ctxmix.benchmark.context.metrics import LDS_SEED
    from ctxmix.methods.context.at2 import load_weights, shipped_weights_path

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = ctxmix.load_model(a.model)
    tok = model.tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    exs = needle_examples(a.needles, a.min_tokens, a.max_tokens, 0, count, split=SPLIT)
    exs += summary_examples(a.summaries, a.min_tokens, a.max_tokens, 0, count, split=SPLIT)
    wpath = a.weights or shipped_weights_path(model.name)
    weights, _, meta = load_weights(wpath)
    prompt = meta.get("prompt", {})  # validated on the prompt form the weights were trained on
    paths = build_set(model, exs, Path(a.out) / "examples", a.masks, LDS_SEED, "response", prompt=prompt)
    data = load_set(paths)
    rows = table(data, weights)
    t1 = time.perf_counter()
    drops = topk_drops(model, exs, data, weights, prompt=prompt)
    for r in rows:
        for kk, v in drops[(r["features"], r["weights"])].items():
            r[f"topk_drop@{kk}"] = v
    topk_seconds = time.perf_counter() - t1
    md = markdown(rows)
    print(md)
    info = {
        "model": model.name,
        "weights": str(wpath),
        "examples": {"needles": a.needles, "summaries": a.summaries},
        "split": SPLIT,
        "texts": "gensim Lee background news, the validation split of ctxmix.benchmark.context.data (disjoint by "
        "source text from the benchmark's test split and from the Wikipedia training texts)",
        "context_tokens": [a.min_tokens, a.max_tokens],
        "heldout_masks": a.masks,
        "heldout_seeds": [LDS_SEED, LDS_SEED + a.masks - 1],
        "unit": "the whole response (EOS dropped)",
        "prompt": prompt,
        "needles_answered": sum(
            contains_answer(e["meta"]["response"], e["meta"]["answer"]) for e in data if e["meta"]["answer"]
        ),
        "ablation": "remove",
        "seconds": time.perf_counter() - t0,
        "topk_seconds": topk_seconds,
        "rows": rows,
        "training": {k: meta.get(k) for k in ("examples", "units", "masks", "training_loss", "steps")},
    }
    (Path(a.out) / "at2_eval.json").write_text(json.dumps(info, indent=2) + "\n")
    (Path(a.out) / "at2_eval.md").write_text(md)
    if a.ship:
        ship(wpath, info)


def ship(wpath, info: dict) -> None:
    """ctxmix/methods/context/at2_weights/<model>.npz and .json: the trained weights, their provenance and the held-out
    table, with the split it was built on (package data: pyproject's [tool.setuptools.package-data])."""
    from ctxmix.methods.context.at2 import load_weights, save_weights

    weights, (L, H), meta = load_weights(wpath)
    meta["heldout"] = {k: v for k, v in info.items() if k not in ("training", "weights")}
    folder = Path(__file__).resolve().parents[1] / "ctxmix" / "methods" / "context" / "at2_weights"
    save_weights(folder / f"{info['model']}.npz", weights, L, H, meta)
    (folder / f"{info['model']}.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
