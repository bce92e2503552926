"""Context-mixing maps: one (n, n) map, several side by side (the FF paper's scopes), every head of
a method. Non-negative maps on sequential "Blues", signed ones on diverging "RdBu" centred on zero."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ctxmix.export.plots.style import _axis, _layout, _signed, color_range, display_tokens


def map_heatmap(
    tokens: list[str], M: np.ndarray, title: str = "", colorbar: str = "contribution", zmax: float | None = None
) -> go.Figure:
    """One (n, n) map: rows = output tokens (top to bottom), columns = input tokens. `zmax` fixes
    the colour scale (e.g. `color_range` of all layers, so layers compare by colour)."""
    M = np.asarray(M, dtype=float)
    if _signed(M):
        kw = dict(colorscale="RdBu", zmid=0) if zmax is None else dict(colorscale="RdBu", zmin=-zmax, zmax=zmax)
    else:
        kw = dict(colorscale="Blues", zmin=0) if zmax is None else dict(colorscale="Blues", zmin=0, zmax=zmax)
    fig = go.Figure(
        go.Heatmap(
            z=M, colorbar=dict(title=colorbar), hovertemplate="out %{y} ← in %{x}: %{z:.4g}<extra></extra>", **kw
        )
    )
    fig.update_xaxes(title="input token j", **_axis(tokens))
    fig.update_yaxes(title="output token i", autorange="reversed", **_axis(tokens, vertical=True))
    return _layout(fig, title, height=max(350, 28 * len(tokens) + 120))


def maps_grid(tokens: list[str], maps: dict[str, np.ndarray], title: str = "", shared_scale: bool = False) -> go.Figure:
    """Several (n, n) maps side by side (e.g. the FF paper's scopes of one layer)."""
    names = list(maps)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.04)
    zmax = max(float(np.max(m)) for m in maps.values()) if shared_scale else None
    for k, name in enumerate(names):
        M = np.asarray(maps[name], dtype=float)
        signed = _signed(M)
        fig.add_trace(
            go.Heatmap(
                z=M,
                colorscale="RdBu" if signed else "Blues",
                zmid=0 if signed else None,
                zmin=None if signed else 0,
                zmax=zmax,
                showscale=False,
                hovertemplate=f"{name}: out %{{y}} ← in %{{x}}: %{{z:.4g}}<extra></extra>",
            ),
            1,
            k + 1,
        )
        fig.update_xaxes(**_axis(tokens), row=1, col=k + 1)
        fig.update_yaxes(
            autorange="reversed",
            **(_axis(tokens, vertical=True) if k == 0 else dict(showticklabels=False)),
            row=1,
            col=k + 1,
        )
    side = max(260, 22 * len(tokens) + 80)
    fig.update_layout(width=None, height=side + 60)
    return _layout(fig, title)


def head_grid(tokens: list[str], head_maps: np.ndarray, title: str = "", zmax: float | None = None) -> go.Figure:
    """Every head of every layer as a small map (bertviz's model view, for any per-head method):
    rows = layers (1 at the top), columns = heads, one colour scale for all (`zmax`, else the
    largest |value|). head_maps: (L, H, n, n). Hover names layer, head and tokens."""
    A = np.asarray(head_maps, dtype=float)
    L, H = A.shape[:2]
    zmax = zmax or color_range(A)
    signed = _signed(A)
    fig = make_subplots(
        rows=L,
        cols=H,
        horizontal_spacing=0.008,
        vertical_spacing=0.012,
        column_titles=[f"head {h + 1}" for h in range(H)],
        row_titles=[f"layer {l + 1}" for l in range(L)],
    )
    toks = display_tokens(tokens)
    for l in range(L):
        for h in range(H):
            fig.add_trace(
                go.Heatmap(
                    z=A[l, h],
                    x=list(range(len(toks))),
                    y=list(range(len(toks))),
                    customdata=np.array(
                        [[f"{toks[i]} ← {toks[j]}" for j in range(len(toks))] for i in range(len(toks))]
                    ),
                    colorscale="RdBu" if signed else "Blues",
                    zmin=-zmax if signed else 0,
                    zmax=zmax,
                    showscale=False,
                    hovertemplate=f"layer {l + 1}, head {h + 1}: %{{customdata}}: %{{z:.3g}}<extra></extra>",
                ),
                l + 1,
                h + 1,
            )
    fig.update_xaxes(showticklabels=False, ticks="", showline=False)
    fig.update_yaxes(showticklabels=False, ticks="", showline=False, autorange="reversed")
    fig.update_annotations(font_size=10)
    cell = 58 if H <= 12 else 40
    fig = _layout(fig, title, height=cell * L + 130)
    fig.update_layout(margin=dict(l=10, r=60, b=10))
    return fig
