"""Benchmark results that ship with ctxmix, so a fresh install shows tables at once.

`<name>.aggregates.csv` holds the runner's aggregates of `configs/<name>.yaml`, computed by
`bench/ship_results.py`; `<name>.json` says which ctxmix version, config (hash of its whole
content) and date made them; `<name>.check.csv` holds the per-example scores of a `--limit 2`
run, which the slow tests in tests/test_runner.py recompute, so the tests fail when a method or
metric changed since the results were made (`check_moves`: what may move between machines, and
how far). Published numbers are not here: they live in each config's `paper.values` and are
shown as quoted (`paper_values`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

SHIPPED = Path(__file__).resolve().parent


PACKAGE_DIR = SHIPPED.parent  # ctxmix/benchmark: a result's "config" path (configs/<name>.yaml) is relative to it
CHECK_LIMIT = 2  # examples per dataset in the check run
CHECK_KEYS = ["model", "dataset", "example_id", "method", "metric", "layer"]

# What moves when the check run is redone on another machine, and how far each score may.
# A score is judged against the scale of its (model, method, metric): the largest |shipped value| over the
# check examples, so a value that happens to lie near 0 (one example's lodds of -0.006 where the other's is
# -0.66) is not judged relative to itself, and a method whose numbers change by 1% still fails (at its
# largest value the change is 1e-2 x scale, above both tolerances below).
#
# Fixed weights (minilm: the embedded checkpoint; smollm2: the GGUF dequantised elementwise by numpy, the same
# bits on every machine): only the order of the float32 reductions moves with the CPU (ATen's kernel set,
# MKL's GEMM path, the thread count). A dot product of length K is within K u of exact (u = 2^-24), and a
# score is a few such products deep per layer: `float32_decomposition_bound(d_ff)` = 4 x 1536 u = 3.7e-4
# (d_ff = 1536 in both models). Measured between ATen's default, AVX2 (also with MKL capped at AVX2) and AVX-512
# kernels on an AMD EPYC, and the machine that shipped the scores: minilm at most 1.8e-5 of the scale (9.5e-5
# of the value itself), smollm2 1.3e-6 of the scale (4e-4 of a cue_dot of 6e-4).
FIXED_WEIGHTS_RTOL = 4 * 1536 * 2.0**-24
# Fine-tuned on first use (minilm-sentiment: 40 AdamW steps in float32 on whatever CPU runs it, so every step's
# rounding is carried into the weights; five builds: those kernel sets, 1 or 2 threads, and the shipping
# machine's): the key biases move by up to 0.9% (softmax ignores them, so their gradient is rounding noise,
# which AdamW normalises into steps of lr), every other weight by at most 7.7e-5 of its tensor's largest
# entry, and the scores by at most 3.2e-5 of the scale (3.5e-4 of the value; one rerun on another machine
# moved a value by 2.9e-4 of itself, which an rtol of 1e-4 of the value failed). Allowed: the fixed-weight bound
# for the scores' own float32 evaluation plus as much again for the weights' move (30x the worst move measured),
# which stays 10x below a 1% change.
FINE_TUNED_RTOL = 1e-3
FINE_TUNED_ON_FIRST_USE = frozenset({"minilm-sentiment"})


def config_sha256(path: str | Path) -> str:
    """Hash of a config's content (parsed YAML, so comments and layout do not count)."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if isinstance(raw, dict) and raw.get("kind") == "context":
        raw = _context_identity(raw)
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _context_identity(raw: dict) -> dict:
    """A context config less what names the computation it made before the key existed (mask_seeds: official;
    an offline task's split: test, the builders' default) and the `examples` record (counts and lengths of what
    the tasks build: derived, not chosen)."""
    from ctxmix.benchmark.context.data import OFFLINE_TASKS

    raw = {k: v for k, v in raw.items() if k != "examples" and not (k == "mask_seeds" and v == "official")}
    if isinstance(raw.get("tasks"), list):
        raw["tasks"] = [
            {k: v for k, v in t.items() if not (k == "split" and v == "test" and t.get("id") in OFFLINE_TASKS)}
            if isinstance(t, dict)
            else t
            for t in raw["tasks"]
        ]
    return raw


def _kind(json_path: Path) -> str | None:
    return json.loads(json_path.read_text(encoding="utf-8")).get("kind")


def shipped_names(kind: str | None = None) -> list[str]:
    """Names of the shipped results of the runner's configs (kind None), or of `kind` ("context")."""
    return sorted(
        p.name[: -len(".json")]
        for p in SHIPPED.glob("*.json")
        if (SHIPPED / p.name.replace(".json", ".aggregates.csv")).exists() and _kind(p) == kind
    )


def load_context_shipped(name: str = "context") -> tuple[pd.DataFrame, dict] | None:
    """(aggregates: task, method, metric, mean, std, n, nan, higher_is_better; metadata) of a shipped context
    benchmark result (`bench/ship_results.py --context`), None when it is not shipped."""
    if name not in shipped_names("context"):
        return None
    meta = json.loads((SHIPPED / f"{name}.json").read_text(encoding="utf-8"))
    return pd.read_csv(SHIPPED / f"{name}.aggregates.csv"), meta


def load_context_check(name: str = "context") -> pd.DataFrame:
    return pd.read_csv(SHIPPED / f"{name}.check.csv", dtype={"example": str})


def load_shipped(name: str = "embedded") -> tuple[pd.DataFrame, dict]:
    """(aggregates as `tables.load_aggregates` gives them, metadata) of a shipped result."""
    meta = json.loads((SHIPPED / f"{name}.json").read_text(encoding="utf-8"))
    agg = pd.read_csv(SHIPPED / f"{name}.aggregates.csv")
    agg.insert(0, "run_id", meta["name"])
    return agg, meta


def load_check(name: str = "embedded") -> pd.DataFrame:
    return pd.read_csv(SHIPPED / f"{name}.check.csv", dtype={"example_id": str})


def check_moves(now: pd.DataFrame, shipped: pd.DataFrame) -> pd.DataFrame:
    """The check scores recomputed now (`now`, rows of `CHECK_KEYS` + "value") against the shipped ones
    (`load_check`): one row per score beyond its tolerance (columns CHECK_KEYS, "shipped", "now",
    "scale", "allowed"), empty when every score holds. A score present on one side only counts too
    (NaN on the other); NaN on both sides holds. Tolerance: `FINE_TUNED_RTOL` or `FIXED_WEIGHTS_RTOL`
    times the largest |shipped value| of the score's (model, method, metric)."""
    key = CHECK_KEYS

    def keyed(df: pd.DataFrame, name: str) -> pd.Series:
        df = df.assign(example_id=df["example_id"].astype(str), layer=df["layer"].fillna(-1).astype(int))
        return df.set_index(key)["value"].rename(name)

    j = pd.concat([keyed(shipped, "shipped"), keyed(now, "now")], axis=1, join="outer").reset_index()
    j["scale"] = j["shipped"].abs().groupby([j["model"], j["method"], j["metric"]]).transform("max")
    fine = j["model"].isin(FINE_TUNED_ON_FIRST_USE)
    j["allowed"] = j["scale"].fillna(0.0) * fine.map({True: FINE_TUNED_RTOL, False: FIXED_WEIGHTS_RTOL})
    both_nan = j["shipped"].isna() & j["now"].isna()
    bad = ~both_nan & ~((j["now"] - j["shipped"]).abs() <= j["allowed"])  # NaN on one side: not <=, so bad
    return j.loc[bad, key + ["shipped", "now", "scale", "allowed"]].reset_index(drop=True)


def stale_reasons(name: str, root: str | Path = PACKAGE_DIR) -> list[str]:
    """Why a shipped result may no longer be what its config computes (empty: none known).
    The numbers themselves are checked by the tests (`load_check`)."""
    from ctxmix import __version__

    _, meta = load_shipped(name)
    why = []
    cfg = Path(root) / meta["config"]
    if not cfg.exists():
        why.append(f"{meta['config']} is gone")
    elif config_sha256(cfg) != meta["config_sha256"]:
        why.append(f"{meta['config']} changed since these results were made")
    if meta.get("ctxmix_version") != __version__:
        why.append(f"made by ctxmix {meta.get('ctxmix_version')}, this is {__version__}")
    if "at2_weights_sha256" in meta and cfg.exists():  # context results: at2_exact's weights file
        from ctxmix.benchmark.context.bench import at2_weights_sha256, load_context_config
        from ctxmix.errors import BadInput

        try:
            now = at2_weights_sha256(load_context_config(cfg))
        except BadInput as e:  # a config edited into an invalid one: say so, do not stop the page
            why.append(f"{meta['config']} no longer loads ({e})")
        else:
            if now != meta["at2_weights_sha256"]:
                why.append("at2_exact's weights file changed since these results were made")
    return why


def paper_values(cfg: dict) -> pd.DataFrame:
    """A config's published numbers (`paper.values`), quoted, one row per value."""
    rows = [
        {
            "model": v.get("model", ""),
            "dataset": v.get("dataset", ""),
            "paper row": v.get("row", v.get("method")),
            "method": v.get("method"),
            "metric": v.get("metric"),
            "layer": v.get("layer", ""),
            "mean": v.get("mean"),
            "std": v.get("std"),
        }
        for v in ((cfg or {}).get("paper") or {}).get("values", [])
        if isinstance(v, dict)
    ]
    df = pd.DataFrame(rows, columns=["model", "dataset", "paper row", "method", "metric", "layer", "mean", "std"])
    return df.dropna(axis=1, how="all").loc[:, lambda d: [c for c in d.columns if (d[c].astype(str) != "").any()]]


def paper_table(cfg: dict) -> pd.DataFrame:
    """A config's published means as a table: one row per paper row (method), one column per
    (model, dataset, metric, layer) that varies; NaN where the paper prints none."""
    df = paper_values(cfg)
    if df.empty:
        return df
    keys = [c for c in ("model", "dataset", "metric", "layer") if c in df.columns and df[c].astype(str).nunique() > 1]
    if not keys:
        keys = ["metric"]
    df = df.assign(column=df[keys].astype(str).agg(" · ".join, axis=1))
    out = df.pivot_table(index="paper row", columns="column", values="mean", sort=False, aggfunc="first")
    out.columns.name = None
    return out


# ------------------------------------------------------------------------------------------------------------
# context attribution (configs/context.yaml: ctxmix.benchmark.context.bench.check_rows)

CONTEXT_CHECK_KEYS = ["task", "example", "method", "metric", "index"]
# What a float32 forward (or backward) pass measures: within FIXED_WEIGHTS_RTOL of its group's scale (smollm2's
# weights are the same bits everywhere; see above).
CONTEXT_MEASURED = ("log_prob_full", "heldout", "cc_target")
RANK_METRICS = ("topk_drop@", "recall@", "lds")
LASSO_TOL = 1e-4  # sklearn's Lasso default, which the official solver (and ctxmix's) keeps


def lasso_bound(masks, y, y_move: float) -> float:
    """How far two runs of `ctxmix.methods.context.ablation.lasso_fit` (StandardScaler -> sklearn Lasso, tol
    LASSO_TOL, weights rescaled) can put any weight apart, when their targets y (n,) differ by at most `y_move`
    each (masks (n, d) bool, the same seeded masks on both sides). inf where the bound does not exist.

    Derivation. sklearn's coordinate descent minimises F(c) = 1/2 |Y - X c|^2 + n alpha |c|_1 (X the standardised
    masks, Y = y / T centred) and stops when the duality gap is below tol |Y|^2, so F(c) - F(c*) <= tol |Y|^2;
    F is 1-strongly convex along X c, so |X (c - c*)|^2 <= 2 tol |Y|^2, and X^T X = n C (C the masks' correlation
    matrix, smallest eigenvalue lam): |c - c*| <= sqrt(2 tol / lam) std(Y). The optimum's fitted values
    Y - proj_K(Y) are 1-Lipschitz in Y (K = {u: |X^T u|_inf <= n alpha} is convex), so two targets move the
    optimum by |c* - c*'| <= |dY| / sqrt(n lam) <= rms(dY) / sqrt(lam). A weight is c_i T / sigma_i (sigma_i the
    mask column's std), so T cancels: bound = (2 sqrt(2 tol / lam) std(y) + y_move / sqrt(lam)) / min sigma."""
    import numpy as np

    X = np.asarray(masks, dtype=np.float64)
    sigma = X.std(0)
    if len(X) < 2 or (sigma == 0).any():
        return float("inf")
    Z = (X - X.mean(0)) / sigma
    lam = float(np.linalg.eigvalsh(Z.T @ Z / len(X))[0])
    if lam <= 1e-12:  # collinear masks (or more sources than masks): the LASSO's weights are not unique
        return float("inf")
    std_y = float(np.std(np.asarray(y, dtype=np.float64)))
    return (2.0 * np.sqrt(2.0 * LASSO_TOL / lam) * std_y + y_move / np.sqrt(lam)) / float(sigma.min())


def spearman_bound(pred, f, pred_tol: float, f_tol: float, masks) -> float:
    """How far Spearman(pred, f) (m values each) can move when every pred moves by less than pred_tol / 2 and
    every f by less than f_tol / 2 (so a pair can swap only if its gap is within pred_tol or f_tol). Rows of
    identical masks (m, d) are the same measurement on both sides and never swap. inf when two distinct masks
    tie exactly (average ranks: the formula below is for distinct ranks).

    With distinct ranks rho = 1 - 6 sum(D_i^2) / (m (m^2 - 1)), D_i = rank(pred)_i - rank(f)_i. Item i's rank
    can change by at most the number of its near partners (c_i in pred, e_i in f), so |dD_i| <= c_i + e_i = q_i
    and |d rho| <= 6 sum(2 |D_i| q_i + q_i^2) / (m (m^2 - 1))."""
    import numpy as np
    from scipy.stats import rankdata

    pred, f = np.asarray(pred, dtype=np.float64), np.asarray(f, dtype=np.float64)
    m = len(pred)
    same = (masks[:, None, :] == masks[None, :, :]).all(-1)
    dp, df = np.abs(pred[:, None] - pred[None, :]), np.abs(f[:, None] - f[None, :])
    if ((dp == 0) & ~same).any() or ((df == 0) & ~same).any() or m < 3:
        return float("inf")
    q = ((dp <= pred_tol) & ~same).sum(1) + ((df <= f_tol) & ~same).sum(1)
    D = rankdata(pred) - rankdata(f)
    return float(6 * np.sum(2 * np.abs(D) * q + q**2) / (m * (m * m - 1)))


def _kth_gap(scores, k: int) -> float:
    """The gap between the k-th and (k+1)-th largest scores (inf when k >= d): the top-k set cannot change
    while every score moves by less than half of it."""
    import numpy as np

    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    return float("inf") if k >= len(s) else float(s[k - 1] - s[k])


def context_check_moves(
    now: pd.DataFrame, shipped: pd.DataFrame, n_ablations: int, seed: int, keep_prob: float = 0.5
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The context benchmark's check rows recomputed now against the shipped ones (columns CONTEXT_CHECK_KEYS +
    "value"). Returns (bad: rows beyond their tolerance, with "shipped", "now", "allowed"; skipped: rank
    metrics not compared because a near-tie could flip them, with "why"). n_ablations, seed, keep_prob:
    ContextCite's (its masks are `contextcite_masks(n_ablations, d, seed)`, seed the example's "mask_seed" row
    where the run recorded one: per-example seeds).

    Tolerances (what moves between CPUs is the order of float32 reductions, as above):
    - measured quantities (log P(response | context), held-out and ContextCite targets logit P) and the
      scores of every method but contextcite: FIXED_WEIGHTS_RTOL x the largest |shipped value| of their
      (task, method, metric);
    - contextcite's scores: `lasso_bound` of each example, its targets' move being the bound above;
    - topk_drop@k and recall@k: compared only where the method's k-th and (k+1)-th shipped scores are more
      than twice their score tolerance apart (else skipped: a near-tie may select other sources on another
      CPU, a real difference, not an error); then recall exactly and topk_drop within twice the log P bound
      (a difference of two measured log-probabilities);
    - lds: within `spearman_bound` (held-out predictions, sums of d kept scores, move by at most d x the score
      tolerance; the measured targets by their bound): 0 when no pair is that close; skipped where two distinct
      masks tie exactly.
    A row present on one side only, or NaN on one side, is bad."""
    import numpy as np

    from ctxmix.methods.context.ablation import contextcite_masks

    key = CONTEXT_CHECK_KEYS
    j = pd.concat(
        [shipped.set_index(key)["value"].rename("shipped"), now.set_index(key)["value"].rename("now")],
        axis=1,
        join="outer",
    ).reset_index()
    j["scale"] = j["shipped"].abs().groupby([j["task"], j["method"], j["metric"]]).transform("max").fillna(0.0)
    j["allowed"] = FIXED_WEIGHTS_RTOL * j["scale"]
    j["compare"] = True
    j["why"] = ""
    sh = shipped.set_index(key)["value"]
    for (task, ex), rows in j.groupby(["task", "example"]):
        idx = rows.index

        def rows_of(method, metric, _rows=rows):
            r = _rows[(_rows["method"] == method) & (_rows["metric"] == metric)].sort_values("index")
            return r

        lp_tol = float(rows_of("-", "log_prob_full")["allowed"].max())
        score_tol: dict[str, float] = {}
        scores: dict[str, np.ndarray] = {}
        for m in rows.loc[rows["metric"] == "score", "method"].unique():
            r = rows_of(m, "score")
            scores[m] = r["shipped"].to_numpy(dtype=np.float64)
            score_tol[m] = float(r["allowed"].max())
        d = len(next(iter(scores.values()))) if scores else 0
        if "contextcite" in scores:
            y = rows_of("contextcite", "cc_target")
            first = int(sh.get((task, ex, "-", "mask_seed", -1), seed))  # per-example seeds record theirs
            masks = contextcite_masks(n_ablations, d, first, keep_prob)
            b = lasso_bound(masks, y["shipped"].to_numpy(), float(y["allowed"].max()))
            score_tol["contextcite"] = b
            j.loc[rows_of("contextcite", "score").index, "allowed"] = b
        held = rows_of("-", "heldout")
        first = int(sh.get((task, ex, "-", "heldout_seed", -1), -1))
        hmasks = contextcite_masks(len(held), d, first, keep_prob) if first >= 0 and d else None
        for i in idx[rows.loc[idx, "metric"].str.startswith(RANK_METRICS)]:
            m, metric = j.at[i, "method"], j.at[i, "metric"]
            s, tol = scores.get(m), score_tol.get(m, float("inf"))
            why = ""
            if s is None:
                why = "no shipped scores"
            elif metric.startswith(("topk_drop@", "recall@")):
                k = int(metric.split("@")[1])
                if not _kth_gap(s, k) > 2 * tol:
                    why = f"scores {k} and {k + 1} are within twice their tolerance {tol:.3g}"
                j.at[i, "allowed"] = 2 * lp_tol if metric.startswith("topk") else 0.0
            elif hmasks is None:
                why = "no held-out masks"
            else:
                pred = hmasks.astype(np.float64) @ s
                f = held["shipped"].to_numpy(dtype=np.float64)
                bound = spearman_bound(pred, f, 2 * d * tol, 2 * float(held["allowed"].max()), hmasks)
                if not np.isfinite(bound):
                    why = "two held-out predictions or targets tie exactly (distinct masks)"
                j.at[i, "allowed"] = bound + 1e-9  # + float64 rounding of the Spearman itself
            if why:
                j.at[i, "compare"], j.at[i, "why"] = False, why
    j.loc[j["metric"].isin(["heldout_seed", "mask_seed"]), "allowed"] = 0.0  # a seed is compared exactly
    both_nan = j["shipped"].isna() & j["now"].isna()
    bad = j["compare"] & ~both_nan & ~((j["now"] - j["shipped"]).abs() <= j["allowed"])
    cols = key + ["shipped", "now", "allowed"]
    return j.loc[bad, cols].reset_index(drop=True), j.loc[~j["compare"], key + ["why"]].reset_index(drop=True)
