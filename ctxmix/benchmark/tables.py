"""Benchmark result tables: pandas DataFrames, CSV and LaTeX (booktabs), plotly figures.

The runner's SQLite store holds one score per example; these functions aggregate them and
lay them out as *methods x metrics* tables (mean and population std over examples), mark the
best value of each column by the metric's own direction (`ctxmix.benchmark.metrics.Metric`), rank the
methods by their mean rank over the metrics that have a direction, and put the papers'
published numbers next to ctxmix's where a config carries them.

    from ctxmix import tables
    agg = tables.load_aggregates("results/embedded.sqlite", "embedded")
    t = tables.method_table(agg, "minilm-sentiment", "pang_lee")
    print(tables.format_table(t)); tables.to_latex(t); tables.table_figure(t).show()

No Streamlit here: the dashboard and the command line use the same functions.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from scipy import stats

from ctxmix.benchmark.metrics import Metric, get_metric

if TYPE_CHECKING:  # plotly is imported by the figure functions only: aggregating needs no plotly
    import plotly.graph_objects as go
from ctxmix.export.latex import booktabs, tex_escape

GLOBAL = -1  # the layer value of whole-model scores


def _metric(name: str) -> Metric:
    if name.startswith("agree:"):
        return Metric(
            name, f"Agreement with {name[6:]}", True, (-1.0, 1.0), "mean Spearman between saliencies", "agreement"
        )
    if name.startswith("model_agree:"):
        return Metric(
            name,
            f"Agreement with model {name[12:]}",
            True,
            (-1.0, 1.0),
            "mean Spearman between two models' saliencies of the same method",
            "agreement",
        )
    return get_metric(name)


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------


def aggregate_scores(scores: pd.DataFrame) -> pd.DataFrame:
    """Long scores (model, dataset, example_id, method, metric, layer, value) -> mean, std
    (population, NaN left out), n (finite values) and n_nan per model x dataset x method x metric x layer."""
    cols = ["model", "dataset", "method", "metric", "layer"]
    if scores is None or not len(scores):
        return pd.DataFrame(columns=cols + ["mean", "std", "n", "n_nan"])
    v = pd.to_numeric(scores["value"], errors="coerce")
    df = scores.assign(value=v, finite=np.isfinite(v))
    g = df.groupby(cols, sort=False)
    out = g["value"].agg(mean="mean", std=lambda x: float(np.std(x.dropna())) if x.notna().any() else np.nan)
    out["n"] = g["finite"].sum().astype(int)
    out["n_nan"] = g["finite"].size().astype(int) - out["n"]
    return out.reset_index()


def _rank_corr(V: np.ndarray) -> np.ndarray:
    """Spearman between the rows of V (methods x n); NaN for constant rows."""
    R = stats.rankdata(V, axis=1)
    R = R - R.mean(1, keepdims=True)
    norm = np.sqrt((R * R).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        C = (R @ R.T) / np.outer(norm, norm)
    C[norm == 0, :] = np.nan
    C[:, norm == 0] = np.nan
    return C


def agreement_long(saliency: pd.DataFrame) -> pd.DataFrame:
    """Per example, Spearman between every pair of methods' saliency vectors, as long scores
    with metric ``agree:<other method>``. `saliency` has model, dataset, example_id, method,
    values_json (and tokens_json)."""
    rows = []
    if saliency is None or not len(saliency):
        return pd.DataFrame(columns=["model", "dataset", "example_id", "method", "metric", "layer", "value"])
    for (model, ds, ex), g in saliency.groupby(["model", "dataset", "example_id"], sort=False):
        vecs = [np.asarray(json.loads(v), dtype=float) for v in g["values_json"]]
        names = list(g["method"])
        keep = [i for i, v in enumerate(vecs) if len(v) == len(vecs[0]) and np.isfinite(v).all()]
        if len(keep) < 2:
            continue
        C = _rank_corr(np.stack([vecs[i] for i in keep]))
        for a, i in enumerate(keep):
            for b, j in enumerate(keep):
                if i != j:
                    rows.append((model, ds, ex, names[i], f"agree:{names[j]}", GLOBAL, C[a, b]))
    return pd.DataFrame(rows, columns=["model", "dataset", "example_id", "method", "metric", "layer", "value"])


def model_agreement_long(saliency: pd.DataFrame) -> pd.DataFrame:
    """Per example and method, Spearman between two models' saliency (only where both saw the
    same tokens), metric ``model_agree:<other model>``."""
    rows = []
    if saliency is None or not len(saliency) or saliency["model"].nunique() < 2:
        return pd.DataFrame(columns=["model", "dataset", "example_id", "method", "metric", "layer", "value"])
    for (ds, ex, meth), g in saliency.groupby(["dataset", "example_id", "method"], sort=False):
        if len(g) < 2:
            continue
        recs = list(g.itertuples())
        for a in recs:
            for b in recs:
                if a.model == b.model or a.tokens_json != b.tokens_json:
                    continue
                va, vb = np.asarray(json.loads(a.values_json)), np.asarray(json.loads(b.values_json))
                rows.append(
                    (a.model, ds, ex, meth, f"model_agree:{b.model}", GLOBAL, _rank_corr(np.stack([va, vb]))[0, 1])
                )
    return pd.DataFrame(rows, columns=["model", "dataset", "example_id", "method", "metric", "layer", "value"])


def load_aggregates(db: str | Path, run: str | None = None) -> pd.DataFrame:
    """The aggregates table of a results file (one run, or all)."""
    with sqlite3.connect(str(db)) as c:
        q = "SELECT * FROM aggregates" + (" WHERE run_id=?" if run else "")
        return pd.read_sql_query(q, c, params=(run,) if run else ())


def load_scores(db: str | Path, run: str | None = None) -> pd.DataFrame:
    """Every per-example score of a results file (one run, or all)."""
    with sqlite3.connect(str(db)) as c:
        q = "SELECT * FROM scores" + (" WHERE run_id=?" if run else "")
        return pd.read_sql_query(q, c, params=(run,) if run else ())


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def method_table(
    agg: pd.DataFrame,
    model: str | None = None,
    dataset: str | None = None,
    metrics: Iterable[str] | None = None,
    layer: int = GLOBAL,
) -> pd.DataFrame:
    """Methods x metrics: column ``<metric>`` is the mean, ``<metric> std`` the std, ``n`` the
    examples; ``mean rank`` averages each method's rank (1 = best) over the metrics with a
    direction; rows sorted by it. ``table.attrs``: metrics, best {metric: method}, model, dataset."""
    df = agg
    if model is not None:
        df = df[df["model"] == model]
    if dataset is not None:
        df = df[df["dataset"] == dataset]
    df = df[df["layer"] == layer]
    if metrics is None:
        metrics = [m for m in dict.fromkeys(df["metric"]) if not str(m).startswith(("agree:", "model_agree:"))]
    metrics = [m for m in metrics if m in set(df["metric"])]
    methods = list(dict.fromkeys(df["method"]))
    t = pd.DataFrame(index=pd.Index(methods, name="method"))
    for m in metrics:
        sub = df[df["metric"] == m].set_index("method")
        t[m] = sub["mean"].reindex(methods).astype(float)
        t[f"{m} std"] = sub["std"].reindex(methods).astype(float)
    if metrics:
        t["n"] = df[df["metric"].isin(metrics)].groupby("method")["n"].max().reindex(methods)
    best, ranks = {}, []
    for m in metrics:
        hib = _metric(m).higher_is_better
        col = t[m]
        if hib is None or col.notna().sum() == 0:
            continue
        best[m] = col.idxmax() if hib else col.idxmin()
        ranks.append(col.rank(ascending=not hib, method="average"))
    if ranks:
        t["mean rank"] = pd.concat(ranks, axis=1).mean(axis=1, skipna=True)
        t = t.sort_values("mean rank", kind="stable")
    t.attrs.update({"metrics": metrics, "best": best, "model": model, "dataset": dataset})
    return t


def layer_table(agg: pd.DataFrame, metric: str, model: str | None = None, dataset: str | None = None) -> pd.DataFrame:
    """Layers x methods of a per-layer metric (cue alignment, contextualization change): means."""
    df = agg[(agg["metric"] == metric) & (agg["layer"] != GLOBAL)]
    if model is not None:
        df = df[df["model"] == model]
    if dataset is not None:
        df = df[df["dataset"] == dataset]
    t = df.pivot_table(index="layer", columns="method", values="mean", sort=False)
    t.attrs.update({"metric": metric, "model": model, "dataset": dataset})
    return t.sort_index()


def agreement_matrix(agg: pd.DataFrame, model: str | None = None, dataset: str | None = None) -> pd.DataFrame:
    """Methods x methods mean Spearman between their saliency (from ``agree:`` aggregates)."""
    df = agg[agg["metric"].astype(str).str.startswith("agree:")]
    if model is not None:
        df = df[df["model"] == model]
    if dataset is not None:
        df = df[df["dataset"] == dataset]
    df = df.assign(other=df["metric"].str[len("agree:") :])
    M = df.pivot_table(index="method", columns="other", values="mean", sort=False)
    names = list(dict.fromkeys(list(M.index) + list(M.columns)))
    M = M.reindex(index=names, columns=names)
    for n in names:
        M.loc[n, n] = 1.0
    return M


def paper_comparison(
    table: pd.DataFrame, paper: dict, model: str | None = None, dataset: str | None = None
) -> pd.DataFrame:
    """Paper vs ctxmix, one row per (method, metric) the config's ``paper.values`` give for
    this model and dataset: paper mean/std, ctxmix mean/std, difference."""
    rows = []
    for v in (paper or {}).get("values", []):
        if model is not None and v.get("model") not in (None, model):
            continue
        if dataset is not None and v.get("dataset") not in (None, dataset):
            continue
        meth, met = v.get("method"), v.get("metric")
        ours = table[met].get(meth, np.nan) if met in table.columns else np.nan
        ours_sd = table[f"{met} std"].get(meth, np.nan) if f"{met} std" in table.columns else np.nan
        rows.append(
            {
                "method": meth,
                "paper row": v.get("row", meth),
                "metric": met,
                "paper": v.get("mean"),
                "paper std": v.get("std", np.nan),
                "ctxmix": ours,
                "ctxmix std": ours_sd,
                "difference": (ours - v["mean"]) if v.get("mean") is not None and pd.notna(ours) else np.nan,
            }
        )
    return pd.DataFrame(
        rows, columns=["method", "paper row", "metric", "paper", "paper std", "ctxmix", "ctxmix std", "difference"]
    )


def format_table(table: pd.DataFrame, digits: int = 3, marker: str = "*") -> pd.DataFrame:
    """Strings "mean ± std" per metric, the best of each column followed by `marker`."""
    metrics = table.attrs.get("metrics", [])
    best = table.attrs.get("best", {})
    out = pd.DataFrame(index=table.index)
    for m in metrics:
        cells = []
        for meth in table.index:
            mu, sd = table.at[meth, m], table.at[meth, f"{m} std"]
            if pd.isna(mu):
                cells.append("–")
                continue
            s = f"{mu:.{digits}f} ± {sd:.{digits}f}" if pd.notna(sd) else f"{mu:.{digits}f}"
            cells.append(s + (marker if best.get(m) == meth else ""))
        out[f"{m} {_metric(m).arrow}".strip()] = cells
    for c in ("n", "mean rank"):
        if c in table.columns:
            out[c] = [("–" if pd.isna(x) else (f"{int(x)}" if c == "n" else f"{x:.2f}")) for x in table[c]]
    return out


def to_csv(table: pd.DataFrame, path: str | Path | None = None) -> str:
    """The table as CSV (means and stds in their own columns); written to `path` if given."""
    s = table.to_csv(float_format="%.6g")
    if path:
        Path(path).write_text(s)
    return s


def to_latex(table: pd.DataFrame, caption: str | None = None, label: str | None = None, digits: int = 3) -> str:
    """A booktabs table: methods x metrics, "mean $\\pm$ std", the best of each column in bold
    (written directly: no jinja2 needed)."""
    metrics = table.attrs.get("metrics", [])
    best = table.attrs.get("best", {})
    extra = [c for c in ("n", "mean rank") if c in table.columns]
    head = ["method"] + [f"{m} {_metric(m).arrow}".strip() for m in metrics] + extra
    rows = []
    for meth in table.index:
        cells = [tex_escape(meth)]
        for m in metrics:
            mu, sd = table.at[meth, m], table.at[meth, f"{m} std"]
            if pd.isna(mu):
                cells.append("--")
                continue
            s = f"{mu:.{digits}f}" + (rf" $\pm$ {sd:.{digits}f}" if pd.notna(sd) else "")
            cells.append(rf"\textbf{{{s}}}" if best.get(m) == meth else s)
        for c in extra:
            x = table.at[meth, c]
            cells.append("--" if pd.isna(x) else (f"{int(x)}" if c == "n" else f"{x:.2f}"))
        rows.append(cells)
    return booktabs(head, rows, "l" + "r" * (len(head) - 1), caption, label, small=True)


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------


def table_figure(table: pd.DataFrame, title: str | None = None, columns: int = 3) -> go.Figure:
    """One panel per metric, `columns` panels a row: a horizontal bar per method (names stay
    readable however many methods), its std as error bar, the best bar outlined; methods in the
    table's order (best mean rank at the top)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ctxmix.export.plots import toolbar_title

    metrics = table.attrs.get("metrics", [])
    best = table.attrs.get("best", {})
    cols = max(1, min(columns, len(metrics)))
    rows = max(1, -(-len(metrics) // cols))
    methods = [str(m) for m in table.index]
    fig = make_subplots(
        rows=rows,
        cols=cols,
        shared_yaxes=True,
        horizontal_spacing=0.03,
        vertical_spacing=0.25 / rows if rows > 1 else 0.0,
        subplot_titles=[f"{m} {_metric(m).arrow}" for m in metrics],
    )
    for k, m in enumerate(metrics):
        r, c = divmod(k, cols)
        fig.add_trace(
            go.Bar(
                y=methods,
                x=table[m],
                orientation="h",
                name=m,
                showlegend=False,
                error_x=dict(type="data", array=table[f"{m} std"].fillna(0).tolist(), visible=True, thickness=1),
                marker_line_width=[2.5 if best.get(m) == meth else 0 for meth in table.index],
                marker_line_color="black",
                marker_color="#0072B2",
            ),
            row=r + 1,
            col=c + 1,
        )
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=10))
    fig.update_xaxes(tickfont=dict(size=10))
    fig.update_annotations(font_size=12)
    fig.update_layout(
        title=toolbar_title(title or f"{table.attrs.get('model') or ''} on {table.attrs.get('dataset') or ''}"),
        height=rows * max(220, 17 * len(methods) + 60) + 90,
        margin=dict(t=100, b=30, l=10, r=10),
        template="simple_white",
    )
    return fig


def layer_figure(layers: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Per-layer curves, one line per method (cue alignment; contextualization change)."""
    import plotly.graph_objects as go

    from ctxmix.export.plots import toolbar_title

    fig = go.Figure()
    for meth in layers.columns:
        fig.add_trace(go.Scatter(x=list(layers.index), y=layers[meth], mode="lines+markers", name=str(meth)))
    m = layers.attrs.get("metric", "")
    fig.update_layout(
        title=toolbar_title(title or f"{m} per layer"),
        margin=dict(t=80),
        xaxis_title="layer",
        yaxis_title=m,
        height=420,
        template="simple_white",
    )
    return fig


def agreement_figure(M: pd.DataFrame, title: str = "Agreement between methods (mean Spearman)") -> go.Figure:
    import plotly.graph_objects as go

    from ctxmix.export.plots import toolbar_title

    fig = go.Figure(
        go.Heatmap(
            z=M.values, x=list(M.columns), y=list(M.index), zmin=-1, zmax=1, colorscale="RdBu", reversescale=True
        )
    )
    n = len(M.index)
    # upright method names: each needs one line height, so they never overlap
    fig.update_xaxes(tickangle=-90, automargin=True, tickfont=dict(size=10))
    fig.update_yaxes(automargin=True, tickfont=dict(size=10))
    fig.update_layout(
        title=toolbar_title(title),
        height=max(420, 20 * n + 240),
        yaxis_autorange="reversed",
        margin=dict(t=80),
        template="simple_white",
    )
    return fig


# ---------------------------------------------------------------------------------------------
# a report of one run (what `python -m ctxmix bench` prints and writes)
# ---------------------------------------------------------------------------------------------


def report(db: str | Path, plan, out_dir: str | Path | None = None, figures: bool = False) -> str:
    """Text of every table of a run; CSV and LaTeX (and HTML figures) written to `out_dir`."""
    with sqlite3.connect(str(db)) as c:
        agg = pd.read_sql_query("SELECT * FROM aggregates WHERE run_id=?", c, params=(plan.run_id,))
        counts = dict(
            c.execute("SELECT status, COUNT(*) FROM units WHERE run_id=? GROUP BY status", (plan.run_id,)).fetchall()
        )
        secs = c.execute("SELECT COALESCE(SUM(seconds),0) FROM units WHERE run_id=?", (plan.run_id,)).fetchone()[0]
        empty = c.execute("SELECT COALESCE(SUM(n_empty),0) FROM datasets WHERE run_id=?", (plan.run_id,)).fetchone()[0]
        skips = pd.read_sql_query(
            "SELECT model, dataset, reason, COUNT(*) AS n FROM skips WHERE run_id=? AND "
            "example_id != '*' GROUP BY model, dataset, reason",
            c,
            params=(plan.run_id,),
        )
        errors = c.execute("SELECT COUNT(*) FROM errors WHERE run_id=?", (plan.run_id,)).fetchone()[0]
    out = Path(out_dir) if out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"run {plan.run_id}: units {', '.join(f'{k} {v}' for k, v in sorted(counts.items())) or 'none'}; "
        f"compute {secs:.0f} s; empty rows skipped {empty}; errors {errors}"
    ]
    for r in skips.itertuples():
        lines.append(f"  skipped on {r.model} / {r.dataset}: {r.n} x {r.reason}")
    for model, ds in plan.runs:
        t = method_table(agg, model, ds, [m for m in plan.metrics])
        if not len(t.index):
            continue
        stem = f"{model}__{ds}".replace("/", "_")
        lines += [
            "",
            f"== {model} on {ds} ==" + (f"  ({plan.paper.get('source')})" if plan.paper.get("source") else ""),
            format_table(t).to_string(),
        ]
        if out:
            to_csv(t, out / f"{stem}.csv")
            (out / f"{stem}.tex").write_text(to_latex(t, caption=f"{model} on {ds}"))
            if figures:
                table_figure(t).write_html(out / f"{stem}.html", include_plotlyjs="cdn")
        cmp_ = paper_comparison(t, plan.paper, model, ds)
        if len(cmp_):
            lines += ["", "paper vs ctxmix:", cmp_.to_string(index=False, float_format=lambda x: f"{x:.3f}")]
            if out:
                cmp_.to_csv(out / f"{stem}__paper.csv", index=False)
        for m in plan.metrics:
            if _metric(m).per_layer:
                lt = layer_table(agg, m, model, ds)
                if len(lt):
                    lines += ["", f"{m} per layer:", lt.to_string(float_format=lambda x: f"{x:.3f}")]
                    if out:
                        lt.to_csv(out / f"{stem}__{m}_layers.csv")
                        if figures:
                            layer_figure(lt, f"{m} per layer, {model} on {ds}").write_html(
                                out / f"{stem}__{m}_layers.html", include_plotlyjs="cdn"
                            )
        A = agreement_matrix(agg, model, ds)
        if len(A) > 1 and out:
            A.to_csv(out / f"{stem}__agreement.csv")
            if figures:
                agreement_figure(A).write_html(out / f"{stem}__agreement.html", include_plotlyjs="cdn")
    if out:
        lines.append(f"\ntables written to {out}/")
    return "\n".join(lines)


__all__ = [
    "aggregate_scores",
    "agreement_long",
    "model_agreement_long",
    "load_aggregates",
    "load_scores",
    "method_table",
    "layer_table",
    "agreement_matrix",
    "paper_comparison",
    "format_table",
    "to_csv",
    "to_latex",
    "table_figure",
    "layer_figure",
    "agreement_figure",
    "report",
]
