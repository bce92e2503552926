"""Held-out comparison of at2_exact's feature kinds, untrained and trained (issue 27, note §6.2).

    python bench/at2_eval.py --model smollm2 --weights out/at2/at2_weights.npz --out out/at2_eval \
        --needles 10 --summaries 10 --masks 32 --threads 1

Examples: the benchmark's needles and summaries (`ctxmix.benchmark.context_data`, gensim's Lee background news:
texts disjoint from the Wikipedia training set), 200-400 tokens, responses generated greedily. Per example
(`at2_train.build_example`, one file each, resumable): every feature kind from one traced pass, the whole
response as the target unit, and `--masks` held-out removal ablations drawn with ContextCite's generator at
seeds from LDS_SEED = 10,000 (disjoint from the training masks' 0..31). For each kind x {untrained (1/(L H)),
trained (the weights file)}: a source's score is w . f(response, source) (AT2's (A1)-(A2)); LDS is
`context_metrics.lds` (Spearman of masks @ scores against the measured logit P(response)), averaged over
examples; recall@1 on the needles. untrained "attn" is the `attention` method; untrained "logit" ranks sources
as the `logit` method does (the same scores up to the factor L H T: its embedding column is never a source).
Prints the table (markdown) and writes it to OUT/at2_eval.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def table(examples: list[dict], weights: dict[str, np.ndarray]) -> list[dict]:
    from ctxmix.benchmark.context_metrics import lds, recall_at
    from ctxmix.methods.context_ablation import aggregate
    from ctxmix.methods.context_at2 import KINDS

    rows = []
    K = len(next(iter(weights.values())))
    for kind in KINDS:
        for trained in (False, True):
            w = weights[kind] if trained else np.full(K, 1.0 / K)
            ld = {"needles": [], "summaries": []}
            rec = []
            for e in examples:
                s = e[f"features_{kind}"][0].astype(np.float64) @ w  # (d,)
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


def markdown(rows: list[dict]) -> str:
    head = "| features | weights | LDS (mean ± se) | LDS needles | LDS summaries | recall@1 needles |\n"
    head += "|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['features']} | {r['weights']} | {r['lds']:.3f} ± {r['lds_se']:.3f} | {r['lds_needles']:.3f} | "
        f"{r['lds_summaries']:.3f} | {r['recall@1_needles']:.2f} |\n"
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
    a = p.parse_args(argv)
    import torch

    import ctxmix
    from ctxmix.benchmark.at2_train import build_set, load_set
    from ctxmix.benchmark.context_data import needle_examples, summary_examples
    from ctxmix.benchmark.context_metrics import LDS_SEED
    from ctxmix.methods.context_at2 import load_weights, shipped_weights_path

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = ctxmix.load_model(a.model)
    tok = model.tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    exs = needle_examples(a.needles, a.min_tokens, a.max_tokens, 0, count)
    exs += summary_examples(a.summaries, a.min_tokens, a.max_tokens, 0, count)
    paths = build_set(model, exs, Path(a.out) / "examples", a.masks, LDS_SEED, "response")
    data = load_set(paths)
    wpath = a.weights or shipped_weights_path(model.name)
    weights, _, meta = load_weights(wpath)
    rows = table(data, weights)
    md = markdown(rows)
    print(md)
    info = {
        "model": model.name,
        "weights": str(wpath),
        "examples": {"needles": a.needles, "summaries": a.summaries},
        "texts": "gensim Lee background news (context_data), disjoint from the Wikipedia training texts",
        "context_tokens": [a.min_tokens, a.max_tokens],
        "heldout_masks": a.masks,
        "heldout_seeds": [LDS_SEED, LDS_SEED + a.masks - 1],
        "unit": "the whole response (EOS dropped)",
        "ablation": "remove",
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "training": {k: meta.get(k) for k in ("examples", "units", "masks", "training_loss", "steps")},
    }
    (Path(a.out) / "at2_eval.json").write_text(json.dumps(info, indent=2) + "\n")
    (Path(a.out) / "at2_eval.md").write_text(md)


if __name__ == "__main__":
    main()
