"""The Prediction section: the signed parts of each logit per token, and ALTI-Logit's (or Logit's)
layer-by-token table with the parts no token gets beside it."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ctxmix.export.plots.style import OKABE_ITO, _axis, _layout, display_tokens

POSITIVE, NEGATIVE = OKABE_ITO[0], OKABE_ITO[3]  # blue for, vermillion against (colour-blind safe)


def logit_contributions_figure(tokens: list[str], rows: np.ndarray, labels: list[str], title: str = "") -> go.Figure:
    """A prediction method's signed parts (C, n): one bar chart per class (or per explained token of a
    language model), a bar per input token, blue where it pushes that logit up, vermillion down; every
    row on one y scale, so classes compare by height."""
    rows = np.asarray(rows, dtype=float)
    toks = display_tokens(tokens)
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, subplot_titles=[str(x) for x in labels])
    top = float(np.nanmax(np.abs(rows))) if rows.size else 1.0
    for c, row in enumerate(rows, 1):
        fig.add_trace(
            go.Bar(
                x=list(range(len(toks))),
                y=row,
                marker_color=[POSITIVE if v >= 0 else NEGATIVE for v in row],
                text=toks,
                textposition="none",  # the axis names the tokens; the text is for the hover
                hovertemplate="%{text}: %{y:.4g}<extra>" + str(labels[c - 1]) + "</extra>",
                showlegend=False,
            ),
            row=c,
            col=1,
        )
        fig.update_yaxes(range=[-1.05 * top, 1.05 * top], title="logit part", row=c, col=1)
    fig.update_xaxes(**_axis(tokens), row=len(rows), col=1)
    return _layout(fig, title, height=140 + 170 * len(rows))


def layer_saliency_figure(
    tokens: list[str], layer_saliency: np.ndarray, terms: dict | None = None, title: str = ""
) -> go.Figure:
    """ALTI-Logit's (or Logit's) table as a heat map: layers (rows, top = first) by input tokens, each
    cell layer l's signed contribution of token j to the explained logit (difference), on a diverging
    scale centred on zero; beside it, per layer, the parts no token gets (`logit_terms` lists: b_O, the
    MLP update, ALTI's untraced share), on the same scale."""
    M = np.asarray(layer_saliency, dtype=float)
    L = M.shape[0]
    per_layer = {k: np.asarray(v, dtype=float) for k, v in (terms or {}).items() if isinstance(v, list) and len(v) == L}
    T = np.stack(list(per_layer.values()), 1) if per_layer else np.zeros((L, 0))
    top = float(np.nanmax(np.abs(np.concatenate([M.ravel(), T.ravel()])))) or 1.0
    ylab = [f"layer {l}" for l in range(1, L + 1)]
    cols = 2 if per_layer else 1
    fig = make_subplots(
        rows=1,
        cols=cols,
        shared_yaxes=True,
        column_widths=[0.8, 0.2][:cols],
        horizontal_spacing=0.03,
        subplot_titles=["tokens", "no token's"][:cols],
    )
    kw = dict(colorscale="RdBu", zmid=0, zmin=-top, zmax=top)
    fig.add_trace(
        go.Heatmap(
            z=M,
            y=ylab,
            colorbar=dict(title="logit part"),
            hovertemplate="%{y}, token %{x}: %{z:.4g}<extra></extra>",
            **kw,
        ),
        row=1,
        col=1,
    )
    if per_layer:
        fig.add_trace(
            go.Heatmap(
                z=T,
                y=ylab,
                x=list(per_layer),
                showscale=False,
                hovertemplate="%{y}, %{x}: %{z:.4g}<extra></extra>",
                **kw,
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(**_axis(tokens), row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, height=max(320, 22 * L + 160))
