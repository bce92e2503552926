"""Faithfulness of context attribution (ContextCite's top-k log-probability drop and linear datamodeling
score, Cohen-Wang et al., NeurIPS 2024; docs/context.md, "Evaluation"): each metric a `Metric` with its
direction, the pure functions behind them, and `evaluate_context`, which measures them on one
`ContextAttribution` (`ContextAttribution.evaluate`).

- ``topk_drop@k`` (higher is better): log P(S | context) - log P(S | context without the k
  highest-scoring sources), natural log, S the response (or a span of it) teacher-forced after the
  unablated response prefix; the baseline is the unablated context, not a surrogate's prediction.
  Sources ranked by descending score, ties by the earlier source, NaN scores last (`top_order`). NaN for
  k >= d (removing every source says nothing about the ranking).
- ``lds`` (higher is better): Spearman (scipy, average ranks) over m held-out masks v_j ~
  Bernoulli(keep_prob)^d of the prediction <scores, v_j> (the sum of the kept sources' scores) against the
  measured logit P(S | context ablated by v_j) (stable aggregation, float64, the same target for every
  method).
  The held-out masks are ContextCite's generator (`RandomState(seed + j)`) at seeds disjoint from the
  attribution's own (s .. s + n_ablations - 1, s its `options["mask_seed"]`): by default from s + LDS_SEED
  (LDS_SEED = 10,000) under the per-example seeds, from LDS_SEED itself under the official ones, or from
  the first seed after ContextCite's when those reach it. Masks can still repeat a training mask by chance
  when d is small (2^d possible masks): disjoint seeds, not disjoint masks.
  NaN, with a note, where a method scores every source the same (the prediction is then a multiple of
  the number of kept sources: it ranks no source above another, so its Spearman would measure only how
  much context was kept: our departure from the bare formula), where a score is not finite, or where the
  measured target is constant over the masks (scipy's NaN).
- ``recall@k`` (higher is better), with gold sources G known: |top-k ∩ G| / |G|.

Every pass is one of ContextCite's removal ablations (`ctxmix.methods.context.ablation`: the source's
text and its separator removed, the prompt re-tokenised, the fixed response ids appended, batched, only
the response rows' logits formed), always with ctxmix's rebuild rule (the text outside the sources kept,
so the full mask rebuilds the prompt exactly; a compat=True attribution is evaluated the same way). The
distinct masks (the full context, each method's top-k removals, the held-out masks) run once each;
a mask the attribution's own ablations already measured (same rule) is read from `.ablations`, not rerun.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pandas as pd

from ctxmix.benchmark.metrics import Metric
from ctxmix.errors import BadInput
from ctxmix.methods.context.ablation import aggregate, check_n_ablations, contextcite_masks, log_probs, mask_seed

DEFAULT_K = (1, 3, 5)
RECALL_K = (1, 3)
LDS_SEED = 10_000  # held-out masks from seeds disjoint from ContextCite's 0..n-1
DEFAULT_HELDOUT = 100  # m = 100 held-out masks


def context_metric(name: str) -> Metric:
    """The `Metric` of `topk_drop@K`, `lds` or `recall@K` (any positive K)."""
    kind, _, k = name.partition("@")
    if kind == "lds" and not k:
        return Metric(
            "lds",
            "Linear datamodeling score",
            True,
            (-1.0, 1.0),
            "Spearman over held-out random ablations of the summed kept sources' scores against the measured "
            "logit P(response); NaN for a method scoring every source the same.",
            "context",
        )
    if kind in ("topk_drop", "recall") and k.isdigit() and int(k) >= 1:
        if kind == "topk_drop":
            return Metric(
                name,
                f"Top-{k} log-probability drop",
                True,
                (-math.inf, math.inf),
                f"log P(response | context) - log P(response | context without the top-{k} sources), natural log.",
                "context",
            )
        return Metric(
            name,
            f"Recall at {k}",
            True,
            (0.0, 1.0),
            f"Share of the gold sources among the top-{k} sources.",
            "context",
        )
    if name == "seconds":
        return Metric(
            "seconds",
            "Seconds",
            False,
            (0.0, math.inf),
            "The method's own wall-clock time for the example (its cost['seconds']: ContextCite's includes its "
            "ablation passes), one thread; as loaded as the machine was.",
            "context",
        )
    if name == "time_vs_contextcite":
        return Metric(
            "time_vs_contextcite",
            "Time / ContextCite's",
            False,
            (0.0, math.inf),
            "The method's seconds over ContextCite's on the same example and run (the moonshot asks at most 1/8).",
            "context",
        )
    raise BadInput(
        f"unknown context metric {name!r}; valid: topk_drop@K, lds, recall@K (K a positive whole number), seconds, "
        "time_vs_contextcite"
    )


CONTEXT_METRICS = {
    m.name: m for m in map(context_metric, [f"topk_drop@{k}" for k in DEFAULT_K] + ["lds"] + ["recall@1", "recall@3"])
}


# ---------------------------------------------------------------- pure functions


def top_order(scores) -> np.ndarray:
    """(d,) source indices, highest score first; ties keep the earlier source; NaN scores last."""
    # numpy sorts NaN after everything (even -(-inf)); stable: ties keep the earlier source, as `top` does
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


def without_top(scores, k: int) -> np.ndarray:
    """(d,) bool mask, True = kept: every source but the k highest-scoring."""
    keep = np.ones(len(scores), dtype=bool)
    keep[top_order(scores)[:k]] = False
    return keep


def topk_drop(full_log_prob: float, reduced_log_prob: float) -> float:
    """The top-k drop: log P(S | context) - log P(S | context without the top k)."""
    return float(full_log_prob) - float(reduced_log_prob)


def lds_reason(scores) -> str | None:
    """Why a method's LDS is undefined (NaN), or None."""
    s = np.asarray(scores, dtype=np.float64)
    if not np.all(np.isfinite(s)):
        return "a score is not finite"
    if np.ptp(s) == 0:
        return "every source has the same score (the prediction would only count the kept sources)"
    return None


def lds(scores, masks, measured) -> float:
    """LDS: Spearman of masks (m, d) @ scores (d,) against measured (m,); NaN where `lds_reason` says, or
    where either side is constant over the masks."""
    from scipy import stats

    if lds_reason(scores) is not None:
        return math.nan
    pred = np.asarray(masks, dtype=np.float64) @ np.asarray(scores, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on a constant input; the NaN says it
        return float(stats.spearmanr(pred, np.asarray(measured, dtype=np.float64)).statistic)


def recall_at(scores, gold, k: int) -> float:
    """|top-k sources ∩ gold| / |gold| (gold: a non-empty collection of source indices)."""
    g = set(int(i) for i in gold)
    return len(g & set(top_order(scores)[:k].tolist())) / len(g)


# ---------------------------------------------------------------- one example


def _whole(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check(ca, model, k, gold, seed, n_ablations) -> tuple[tuple[int, ...], list[int] | None]:
    """Every argument checked before any pass (`ca` is a `ContextAttribution`: not imported, no cycle)."""
    from ctxmix.engine.fingerprint import weights_sha256

    if model.name != ca.model_name:
        raise BadInput(f"this attribution was made with {ca.model_name}; evaluate it with that model, not {model.name}")
    want = ca.provenance.get("weights_sha256")
    if want and weights_sha256(model) != want:
        raise BadInput(f"{model.name}'s weights differ from those this attribution was made with (weights_sha256)")
    ks = (k,) if _whole(k) else tuple(k) if isinstance(k, (list, tuple)) else ()
    if not ks or not all(_whole(x) and x >= 1 for x in ks):
        raise BadInput(f"k must be a positive whole number or a list of them, got {k!r}")
    check_n_ablations(n_ablations)
    d = ca.n_sources
    if gold is not None:
        g = [gold] if _whole(gold) else list(gold) if isinstance(gold, (list, tuple, set)) else [None]
        if not g or not all(_whole(i) and 0 <= i < d for i in g):
            raise BadInput(f"gold must be a source index from 0 to {d - 1} or a non-empty list of them, got {gold!r}")
        gold = sorted(set(int(i) for i in g))
    if seed is not None and (not _whole(seed) or seed < 0):
        raise BadInput(f"seed must be a non-negative whole number or None, got {seed!r}")
    return tuple(dict.fromkeys(int(x) for x in ks)), gold


def _heldout_seed(ca, seed: int | None, n: int) -> int:
    """The first held-out seed: disjoint from ContextCite's seeds s0 .. s0 + n0 - 1. By default LDS_SEED past
    the example's own first mask seed under the "example" scheme (each example its own held-out masks), else
    LDS_SEED (the official scheme, and attributions saved before the schemes)."""
    s0 = mask_seed(ca.options)
    n0 = len(ca.ablations["contextcite"]["masks"]) if "contextcite" in ca.ablations else 0
    if seed is None:
        if ca.options.get("seeds") == "example":
            return s0 + LDS_SEED  # s0 < 2^31: the held-out seeds stay below RandomState's 2^32
        if not n0:
            s0 = 0
        return max(LDS_SEED, s0 + n0) if s0 < LDS_SEED + n else LDS_SEED
    if seed < s0 + n0 and s0 < seed + n:
        raise BadInput(
            f"held-out seeds {seed}..{seed + n - 1} overlap ContextCite's {s0}..{s0 + n0 - 1}: LDS would test on "
            f"the training masks; use seed >= {s0 + n0} (or None)"
        )
    return seed


def evaluate_context(
    ca,
    model,
    k=DEFAULT_K,
    n_ablations: int = DEFAULT_HELDOUT,
    gold=None,
    span=None,
    seed: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> pd.DataFrame:
    """One row per method of `ca`: `topk_drop@k` per k, `lds`, and `recall@1` / `recall@3` with `gold`.
    `table.attrs`: directions {metric: "higher"}, options (ks, held-out seeds, keep_prob, span's tokens,
    rule, log P(S | context)), cost (forward passes run, reused, seconds), notes (why a value is NaN).
    Also kept in `ca.evaluation` with the held-out masks (m, d) and logit-probabilities (m, T)."""
    from ctxmix.methods.context.ablation import response_logit_probs
    from ctxmix.methods.context.prompt import rebuild_prompt
    from ctxmix.progress import progress_bar

    ks, gold = _check(ca, model, k, gold, seed, n_ablations)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BadInput(f"batch_size must be a positive whole number, got {batch_size!r}")
    a, b = ca.token_range(span)
    d = ca.n_sources
    t0 = time.perf_counter()
    src, builder = rebuild_prompt(ca, model)
    rule = "official" if builder.compat else "ctxmix"  # the attribution's own prompts
    if builder.ids(src.rebuild(np.ones(d, bool), rule)) != list(ca.prompt_ids):
        raise BadInput(f"{model.name}'s tokenizer or template does not rebuild this attribution's prompt")
    first = _heldout_seed(ca, seed, n_ablations)
    keep_prob = float(ca.options.get("keep_prob", 0.5))
    heldout = contextcite_masks(n_ablations, d, first, keep_prob)
    from ctxmix.methods.context.keymask import whole_response_only

    # key-mask methods store the whole response's derivatives only: for a part of it they get NaN rows, not an error
    whole_only = whole_response_only(ca.methods, a, b, len(ca.response_ids))
    scored = [m for m in ca.methods if m not in whole_only]
    scores = {m: (ca.scores[m] if span is None else ca.scores_for(m, span)) for m in scored}

    # every distinct mask once: the full context, each method's top-k removals, the held-out masks
    masks = [np.ones(d, bool)] + [without_top(scores[m], kk) for m in scored for kk in ks if kk < d]
    masks += list(heldout)
    index: dict[bytes, int] = {}
    for m in masks:
        index.setdefault(m.tobytes(), len(index))
    unique = np.zeros((len(index), d), bool)
    for key, i in index.items():
        unique[i] = np.frombuffer(key, dtype=bool)
    T = len(ca.response_ids)
    lp = np.full((len(unique), T), np.nan)
    measured_before = list(ca.ablations.values()) if ca.options.get("rebuild") == "ctxmix" else []
    if ca.evaluation:  # a previous evaluation's held-out passes (always ctxmix's rule, the whole response)
        measured_before.append(ca.evaluation)
    for ab in measured_before:  # the attribution's own passes, same rule: read, not rerun
        for mask, row in zip(ab["masks"], ab["logit_probs"]):
            i = index.get(np.asarray(mask, bool).tobytes())
            if i is not None:
                lp[i] = row
    todo = np.nonzero(np.isnan(lp).any(1))[0]
    prompts = [builder.ids(src.rebuild(unique[i], rule)) for i in todo]
    with progress_bar(len(prompts), "evaluate", enabled=bool(progress), unit="pass") as bar:
        if prompts:
            lp[todo] = response_logit_probs(
                model, prompts, ca.response_ids, batch_size, lambda n: bar.update(n - bar.n)
            )

    span_lp = lp[:, a:b]
    logp = log_probs(span_lp)  # (u,) log P(S | ablated context)
    full = float(logp[index[np.ones(d, bool).tobytes()]])
    measured = aggregate(span_lp[[index[m.tobytes()] for m in heldout]])  # (m,) logit P(S), stable, float64
    rows, notes = [], []
    if np.ptp(measured) == 0:
        notes.append("lds: the measured target is the same under every held-out ablation; every LDS is NaN")
    for m in whole_only:
        notes.append(f"{m} scores the whole response only: no values for a part of it")
    for m in ca.methods:
        if m in whole_only:
            rows.append({"method": m})  # every metric NaN (the frame fills the columns)
            continue
        s = scores[m]
        row: dict = {"method": m}
        for kk in ks:
            row[f"topk_drop@{kk}"] = topk_drop(full, logp[index[without_top(s, kk).tobytes()]]) if kk < d else math.nan
        row["lds"] = lds(s, heldout, measured)
        why = lds_reason(s)
        if why:
            notes.append(f"lds of {m} is NaN: {why}")
        if gold is not None:
            for kk in RECALL_K:
                row[f"recall@{kk}"] = recall_at(s, gold, kk)
        rows.append(row)
    skipped = [kk for kk in ks if kk >= d]
    if skipped:
        notes.append(f"topk_drop@{skipped} are NaN: k is not below the {d} sources")
    columns = ["method", *(f"topk_drop@{kk}" for kk in ks), "lds"]
    columns += [f"recall@{kk}" for kk in RECALL_K] if gold is not None else []
    table = pd.DataFrame(rows, columns=columns)  # the columns even where every row is a whole-response method's
    directions = {c: context_metric(c).direction for c in table.columns if c != "method"}
    options = {
        "k": list(ks),
        "n_ablations": n_ablations,
        "heldout_seeds": [first, first + n_ablations - 1],
        "keep_prob": keep_prob,
        "span_tokens": [a, b],
        "span": None if span is None else [int(span[0]), int(span[1])],
        "seed": seed,  # the caller's (None: the default held-out seeds)
        "rule": "ctxmix",
        "ablation": "remove",
        "log_prob_full": full,
        "gold": gold,
    }
    cost = {
        "forward": len(prompts),
        "reused": len(unique) - len(prompts),
        "distinct_masks": len(unique),  # forward + reused
        "backward": 0,
        "seconds": time.perf_counter() - t0,
    }
    table.attrs.update(directions=directions, options=options, cost=cost, notes=notes)
    ca.evaluation = {
        "table": table,
        "masks": heldout,
        "logit_probs": lp[[index[m.tobytes()] for m in heldout]],
        "directions": directions,
        "options": options,
        "cost": cost,
        "notes": notes,
    }
    return table
