"""Per-token saliency: every method's row over the tokens, the source share of an encoder-decoder's
target tokens, and the rank agreement between methods on one example."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ctxmix.export.plots.style import _axis, _layout, _signed, display_tokens


def saliency_figure(tokens: list[str], saliency: dict[str, np.ndarray], normalise: bool = True) -> go.Figure:
    """Tokens coloured by each method's saliency, one row per method (as in the papers' figures).
    Rows are scaled by their maximum |value| so methods on different scales compare by colour;
    signed methods (CAT, AttCAT, blank-out) keep their sign on a diverging scale."""
    names = list(saliency)
    Z = np.array([np.asarray(saliency[m], dtype=float) for m in names])
    raw = Z.copy()
    if normalise:
        Z = Z / np.clip(np.abs(Z).max(1, keepdims=True), 1e-30, None)
    signed = _signed(Z)
    labels = display_tokens(tokens)
    fig = go.Figure(
        go.Heatmap(
            z=Z,
            x=list(range(len(tokens))),
            y=names,
            customdata=raw,
            colorscale="RdBu" if signed else "Blues",
            zmid=0 if signed else None,
            zmin=-1 if signed else 0,
            zmax=1,
            showscale=True,
            colorbar=dict(title="scaled" if normalise else "score"),
            text=[labels] * len(names),
            texttemplate="%{text}",
            textfont=dict(size=12),
            hovertemplate="%{y} · %{text}: %{customdata:.4g}<extra></extra>",
        )
    )
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, height=90 + 40 * len(names))


def source_contribution_figure(tokens: list[str], share: np.ndarray) -> go.Figure:
    """ALTI+: each target token's total source contribution (L, T), one line per decoder layer
    (after that layer, rolled out); the rest of each row is the target prefix's share."""
    share = np.asarray(share, dtype=float)
    labels = display_tokens(tokens)
    fig = go.Figure()
    for l, row in enumerate(share, 1):
        fig.add_trace(
            go.Scatter(
                x=list(range(len(labels))),
                y=row,
                mode="lines+markers",
                name=f"layer {l}",
                line=dict(width=3 if l == len(share) else 1.5),
                hovertemplate="%{text}: %{y:.3f}<extra>layer " + str(l) + "</extra>",
                text=labels,
            )
        )
    fig.update_yaxes(range=[0, 1], title="source contribution")
    fig.update_xaxes(title="target token (decoder input)", **_axis(tokens))
    return _layout(fig, height=360)


def rank_correlation_table(saliency: dict[str, np.ndarray]) -> pd.DataFrame:
    """Spearman rho between every pair of methods' saliencies on one example."""
    from scipy import stats

    names = list(saliency)
    R = np.eye(len(names))
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            x, y = saliency[names[a]], saliency[names[b]]
            r = stats.spearmanr(x, y).statistic if np.ptp(x) > 0 and np.ptp(y) > 0 else np.nan
            R[a, b] = R[b, a] = r
    return pd.DataFrame(R, index=names, columns=names)
