"""Corpus analyses: contextualization change per layer (FF paper Fig. 3), the dynamics' grouped bars,
cross-segment mixing, residual norms, LN gamma against FF outliers and their correlations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ctxmix.export.plots.style import COMPONENT_COLOURS, OKABE_ITO, _layout


def _change_bar(d: pd.DataFrame, comparison: str, k: int, **kw) -> go.Bar:
    """One comparison's per-layer bars of mean 1 - rho with std error bars, in its component's colour."""
    return go.Bar(
        x=d["layer"],
        y=d["change"],
        error_y=dict(type="data", array=d["std"], thickness=1),
        marker_color=COMPONENT_COLOURS.get(comparison, OKABE_ITO[k]),
        **kw,
    )


def change_bars(df: pd.DataFrame, comparisons: list[str], title: str = "") -> go.Figure:
    """Per-layer bars of mean 1 - rho with std error bars, one panel per comparison (FF paper Fig. 3)."""
    fig = make_subplots(rows=1, cols=len(comparisons), subplot_titles=comparisons, shared_yaxes=True)
    for k, c in enumerate(comparisons):
        d = df[df["comparison"] == c]
        fig.add_trace(_change_bar(d, c, k, name=c, showlegend=False), 1, k + 1)
        fig.update_xaxes(title="layer", dtick=1, row=1, col=k + 1)
    fig.update_yaxes(title="1 − Spearman ρ", row=1, col=1)
    return _layout(fig, title, height=340)


def grouped_bars(df: pd.DataFrame, comparisons: list[str], title: str = "") -> go.Figure:
    """Grouped per-layer bars (the FF paper's dynamics view, Fig. 6)."""
    fig = go.Figure()
    for k, c in enumerate(comparisons):
        d = df[df["comparison"] == c]
        fig.add_trace(_change_bar(d, c, k, name=c.replace("dyn:", "")))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="layer", dtick=1)
    fig.update_yaxes(title="1 − Spearman ρ vs the map before the FF")
    return _layout(fig, title, height=360)


def cross_mixing_figure(df: pd.DataFrame, title: str = "") -> go.Figure:
    """A sentence pair's A→B and B→A mixing (`ctxmix.analyses.pairs.cross_segment_mixing`): per layer, the
    share of a text's context that comes from the other text; one panel per map (each layer's own,
    aggregated), one colour per method, solid A→B, dotted B→A."""
    views = [v for v in ("layer", "aggregated") if v in set(df["map"])]
    fig = make_subplots(
        rows=1,
        cols=len(views),
        shared_yaxes=True,
        subplot_titles=[{"layer": "each layer's map", "aggregated": "aggregated up to the layer"}[v] for v in views],
    )
    for k, m in enumerate(dict.fromkeys(df["method"])):
        for c, v in enumerate(views):
            for d, dash in (("A→B", "solid"), ("B→A", "dot")):
                sel = df[(df["method"] == m) & (df["map"] == v) & (df["direction"] == d)]
                fig.add_trace(
                    go.Scatter(
                        x=sel["layer"],
                        y=sel["other"],
                        mode="lines+markers",
                        name=f"{m} {d}",
                        legendgroup=m,
                        showlegend=c == 0,
                        line=dict(color=OKABE_ITO[k % len(OKABE_ITO)], dash=dash),
                    ),
                    1,
                    c + 1,
                )
            fig.update_xaxes(title="layer", dtick=1, row=1, col=c + 1)
    fig.update_yaxes(title="share from the other text", rangemode="tozero", row=1, col=1)
    return _layout(fig, title, height=360)


def res2_figure(df: pd.DataFrame) -> go.Figure:
    """Mean norm of the FF output and of the vector RES2 bypasses, per layer (FF paper Fig. 7)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=df["layer"], y=df["ff_out_norm"], name="‖FF output‖", marker_color="#009E73"))
    fig.add_trace(go.Bar(x=df["layer"], y=df["bypass_norm"], name="‖bypassed vector‖", marker_color="#0072B2"))
    fig.add_trace(
        go.Scatter(x=df["layer"], y=df["ratio"], name="ratio", mode="lines+markers", line=dict(color="#D55E00")),
        secondary_y=True,
    )
    fig.add_hline(y=2, line_dash="dot", line_color="#D55E00", secondary_y=True, annotation_text="2×")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="layer", dtick=1)
    fig.update_yaxes(title="mean L2 norm", secondary_y=False)
    fig.update_yaxes(title="bypass / FF", secondary_y=True)
    return _layout(fig, height=360)


def outlier_figure(df_layer: pd.DataFrame, fraction: float = 0.01, title: str = "") -> go.Figure:
    """Per dimension: mean |FF input|, mean |FF output| (green) and gamma (red), with the
    lowest-gamma dimensions marked (FF paper Fig. 8)."""
    d = df_layer.sort_values("dim")
    k = max(1, int(np.floor(fraction * len(d))))
    low = d.nsmallest(k, "gamma")
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.05,
        subplot_titles=["mean |FF input|", "mean |FF output|", "γ of the next norm"],
    )
    fig.add_trace(
        go.Scatter(
            x=d["dim"], y=d["ff_in_mean_abs"], mode="lines", line=dict(color="#0072B2", width=1), name="|FF in|"
        ),
        1,
        1,
    )
    fig.add_trace(
        go.Scatter(
            x=d["dim"], y=d["ff_out_mean_abs"], mode="lines", line=dict(color="#009E73", width=1), name="|FF out|"
        ),
        2,
        1,
    )
    fig.add_trace(
        go.Scatter(x=d["dim"], y=d["gamma"], mode="lines", line=dict(color="#D55E00", width=1), name="γ"), 3, 1
    )
    for row, col in ((1, "ff_in_mean_abs"), (2, "ff_out_mean_abs"), (3, "gamma")):
        fig.add_trace(
            go.Scatter(
                x=low["dim"],
                y=low[col],
                mode="markers",
                marker=dict(color="#000", size=7, symbol="x"),
                name=f"lowest-γ {k}",
                showlegend=row == 1,
            ),
            row,
            1,
        )
    fig.update_xaxes(title="dimension", row=3, col=1)
    return _layout(fig, title, height=560)


def correlation_bars(corr: pd.DataFrame) -> go.Figure:
    """Per-layer Pearson and Spearman r between gamma and mean |FF output|."""
    fig = go.Figure(
        [
            go.Bar(x=corr["layer"], y=corr["pearson"], name="Pearson r", marker_color="#0072B2"),
            go.Bar(x=corr["layer"], y=corr["spearman"], name="Spearman ρ", marker_color="#E69F00"),
        ]
    )
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="layer", dtick=1)
    fig.update_yaxes(title="r(γ, mean |FF out|)", range=[-1, 1])
    return _layout(fig, height=320)
