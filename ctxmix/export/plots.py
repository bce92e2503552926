"""Plotly figures shared by the dashboard, the command line and notebooks, and their export.
(Over 500 lines: every figure shares one style and one export path, PNG/SVG/PDF with provenance.)

Style: white background, Okabe-Ito colours (colour-blind safe), sequential "Blues" for
non-negative maps and diverging "RdBu" centred on zero for signed ones, token labels on the
axes (made unique, since plotly merges equal category labels).
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ctxmix.export.latex import dataframe_booktabs

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
FONT = dict(family="Arial, Helvetica, sans-serif", size=13, color="#222")
COMPONENT_COLOURS = {
    "+Ff": "#009E73",
    "+Res": "#0072B2",
    "+Ln": "#D55E00",
    "dyn:FF": "#009E73",
    "dyn:FF+RES": "#0072B2",
    "dyn:FF+RES+LN": "#D55E00",
}


def display_tokens(tokens: list[str]) -> list[str]:
    """Readable token labels: byte-level BPE's 'Ġ' becomes a leading space marker '·',
    'Ċ' a newline marker; empty labels get a placeholder."""
    out = []
    for t in tokens:
        t = t.replace("Ġ", "·").replace("▁", "·").replace("Ċ", "⏎")
        out.append(t if t.strip() else "␣")
    return out


MAX_TICK_LABELS = 24  # more labels than this overlap in a half-width map, even upright: show every k-th


def _axis(tokens: list[str], vertical: bool = False) -> dict:
    """Token tick labels, thinned to at most MAX_TICK_LABELS (every k-th, the first and last kept)
    so they never overlap; hovering still names every cell. The x axis turns its labels upright
    (-90°) past 8 tokens: upright labels need only one line height each; the y axis (`vertical`)
    keeps them horizontal."""
    labels = display_tokens(tokens)
    n = len(labels)
    step = max(1, -(-n // MAX_TICK_LABELS))
    keep = sorted(set(range(0, n, step)) | ({n - 1} if n else set()))
    if keep and len(keep) > 1 and keep[-1] - keep[-2] < step:  # the last label would crowd its neighbour
        keep.pop(-2)
    return dict(
        tickmode="array",
        tickvals=keep,
        ticktext=[labels[i] for i in keep],
        tickangle=0 if vertical or n <= 8 else -90,
        automargin=True,
    )


def toolbar_title(text: str) -> dict:
    """A figure title placed below the plotly toolbar (which takes the top ~34 px at the right)."""
    return dict(text=text, x=0.01, y=1, yref="container", yanchor="top", pad=dict(t=36))


def _layout(fig: go.Figure, title: str | None = None, height: int | None = None) -> go.Figure:
    # the plotly toolbar takes the top ~34 px at the right: titles start below it, and subplot
    # titles (annotations just above the plots) get the room a title would
    subtitles = any(a.yref == "paper" and (a.y or 0) >= 0.99 for a in fig.layout.annotations)
    top = 36 + (40 if title else 0) + (34 if subtitles else 0)
    fig.update_layout(
        template="simple_white",
        font=FONT,
        colorway=OKABE_ITO,
        margin=dict(l=60, r=20, t=top, b=60),
        title=toolbar_title(title or ""),
    )
    if height:
        fig.update_layout(height=height)
    return fig


def _signed(M: np.ndarray) -> bool:
    return bool(np.nanmin(M) < 0)


def color_range(maps: np.ndarray) -> float:
    """The largest |value| of a method's maps over all layers: one colour scale for all of them."""
    return float(np.nanmax(np.abs(np.asarray(maps, dtype=float)))) or 1.0


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


ROUTE_COLOURS = {  # the tool's ramps; the residual bypass around an FFN drawn as the residual stream
    "attention": ("#9eba66", "#556b2f"),
    "residual": ("#9eba66", "#556b2f"),
    "ffn": ("#da70d6", "#800080"),
}
ROUTE_BINS = (0.0, 0.1, 0.2, 0.35, 0.5)  # edge weights drawn alike within a bin (width and opacity)


def route_node_xy(node: str, parallel: bool = False) -> tuple[float, float]:
    """Where the routes figure draws a node: x the token, y = 2l + 1 for A<l>, 2l + 2 for I<l>, 0 for X0;
    the FFN square M<l> beside its token, between A and I (between I<l-1> and I<l> in a parallel layer)."""
    kind, layer, pos = node[0], *map(int, node[1:].split("_"))
    if kind == "X":
        return float(pos), 0.0
    if kind == "A":
        return float(pos), 2 * layer + 1.0
    if kind == "M":
        return pos + 0.35, 2 * layer + (1.0 if parallel else 1.5)
    return float(pos), 2 * layer + 2.0


def _mix(c0: str, c1: str, f: float) -> str:
    a = [int(c0[i : i + 2], 16) for i in (1, 3, 5)]
    b = [int(c1[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def routes_figure(r, title: str | None = None) -> go.Figure:
    """Information flow routes (a `ctxmix.methods.routes.Routes`) as the LM Transparency Tool draws them:
    tokens as columns, layers as rows (A after attention below I after the FFN), FFN squares beside;
    attention and residual edges green, FFN edges purple, darker and wider with weight (one trace per
    weight bin, so a long input stays fast). Hover names each edge's weight and heads."""
    parallel = r.nodes["type"].eq("after_attn").sum() == 0 and r.nodes["type"].eq("ffn").any()
    ge = r.graph_edges()
    fig = go.Figure()
    bins = list(ROUTE_BINS) + [np.inf]
    for kind, (c0, c1) in ROUTE_COLOURS.items():
        e = ge[ge["kind"] == kind] if len(ge) else ge
        for b in range(len(ROUTE_BINS)):
            sel = e[(e["weight"] > bins[b]) & (e["weight"] <= bins[b + 1])] if len(e) else e
            if sel.empty:
                continue
            xs: list = []
            ys: list = []
            for s, t in zip(sel["source"], sel["target"]):
                (x0, y0), (x1, y1) = route_node_xy(s, parallel), route_node_xy(t, parallel)
                xs += [x0, x1, None]
                ys += [y0, y1, None]
            f = min(1.0, ROUTE_BINS[b] / 0.5)
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines",
                    line=dict(color=_mix(c0, c1, f), width=1.2 + 2.3 * f),
                    opacity=0.45 + 0.55 * f,
                    hoverinfo="skip",
                    name=f"{kind} > {ROUTE_BINS[b]:g}",
                    showlegend=False,
                )
            )
    # edge midpoints carry the hover text (lines themselves hover poorly)
    if len(ge):
        mids = [
            tuple((a + b) / 2 for a, b in zip(route_node_xy(s, parallel), route_node_xy(t, parallel)))
            for s, t in zip(ge["source"], ge["target"])
        ]
        fig.add_trace(
            go.Scatter(
                x=[m[0] for m in mids],
                y=[m[1] for m in mids],
                mode="markers",
                marker=dict(size=6, opacity=0),
                text=[
                    f"{s} → {t}: {w:.3f} ({k})"
                    for s, t, w, k in zip(ge["source"], ge["target"], ge["weight"], ge["kind"])
                ],
                hovertemplate="%{text}<extra></extra>",
                showlegend=False,
            )
        )
    nd = r.nodes
    xy = [route_node_xy(s, parallel) for s in nd["node"]]
    fig.add_trace(
        go.Scatter(
            x=[p[0] for p in xy],
            y=[p[1] for p in xy],
            mode="markers",
            marker=dict(
                symbol=["square" if t == "ffn" else "circle" for t in nd["type"]],
                size=[9 if t == "ffn" else 8 for t in nd["type"]],
                color=[
                    "#800080" if t == "ffn" else ("#e69f00" if s == r.start else "#556b2f")
                    for t, s in zip(nd["type"], nd["node"])
                ],
                line=dict(width=0),
            ),
            text=[f"{s} ({t}): {display_tokens([tok])[0]}" for s, t, tok in zip(nd["node"], nd["type"], nd["token"])],
            hovertemplate="%{text}<extra></extra>",
            showlegend=False,
        )
    )
    L = r.n_layers
    fig.update_xaxes(**_axis(r.tokens), range=[-0.6, len(r.tokens) - 0.4], showgrid=False)
    fig.update_yaxes(
        tickmode="array",
        tickvals=[0] + [2 * l + 2 for l in range(L)],
        ticktext=["embeddings"] + [f"layer {l}" for l in range(L)],
        range=[-0.6, 2 * L + 0.6],
        showgrid=False,
        zeroline=False,
    )
    for l in range(0, L, 2):  # alternate layers banded, as the tool
        fig.add_hrect(y0=2 * l + 0.5, y1=2 * l + 2.5, fillcolor="#f2f2f2", line_width=0, layer="below")
    t = title or (
        f"Information flow routes to {display_tokens([r.tokens[r.position]])[0]!s} (position {r.position}); "
        f"τ = {r.threshold:g}, {r.mode.replace('_', ' ')}, L{r.p:g}"
    )
    return _layout(fig, t, height=min(2400, 180 + 34 * L))


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


def change_bars(df: pd.DataFrame, comparisons: list[str], title: str = "") -> go.Figure:
    """Per-layer bars of mean 1 - rho with std error bars, one panel per comparison (FF paper Fig. 3)."""
    fig = make_subplots(rows=1, cols=len(comparisons), subplot_titles=comparisons, shared_yaxes=True)
    for k, c in enumerate(comparisons):
        d = df[df["comparison"] == c]
        fig.add_trace(
            go.Bar(
                x=d["layer"],
                y=d["change"],
                error_y=dict(type="data", array=d["std"], thickness=1),
                marker_color=COMPONENT_COLOURS.get(c, OKABE_ITO[k]),
                name=c,
                showlegend=False,
            ),
            1,
            k + 1,
        )
        fig.update_xaxes(title="layer", dtick=1, row=1, col=k + 1)
    fig.update_yaxes(title="1 − Spearman ρ", row=1, col=1)
    return _layout(fig, title, height=340)


def grouped_bars(df: pd.DataFrame, comparisons: list[str], title: str = "") -> go.Figure:
    """Grouped per-layer bars (the FF paper's dynamics view, Fig. 6)."""
    fig = go.Figure()
    for k, c in enumerate(comparisons):
        d = df[df["comparison"] == c]
        fig.add_trace(
            go.Bar(
                x=d["layer"],
                y=d["change"],
                name=c.replace("dyn:", ""),
                error_y=dict(type="data", array=d["std"], thickness=1),
                marker_color=COMPONENT_COLOURS.get(c, OKABE_ITO[k]),
            )
        )
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


# ---------------------------------------------------------------- export


def chromium_path() -> str | None:
    """A Chrome/Chromium kaleido can drive (kaleido 1.x needs one on the machine)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def static_export_available() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return chromium_path() is not None


STATIC_HINT = (
    "PNG, SVG and PDF export needs Chrome or Chromium on the server "
    "(Debian/Ubuntu: `apt install chromium`; macOS: install Google Chrome). HTML works without it."
)


# Widths of paper columns and pages, in inches (ACL: 3.03 / 6.3; NeurIPS and ICLR: 5.5)
PAPER_PRESETS = {"acl-column": 3.03, "acl-page": 6.3, "neurips": 5.5, "iclr": 5.5}
PAPER_FONT_PT = 9  # between the 8-10 pt figures take in these templates


def paper_figure(fig: go.Figure, preset: str) -> go.Figure:
    """A copy of `fig` sized for a paper: the preset's width at 96 px per inch (how the static
    export maps pixels to inches), the height scaled with it (at most the width x 1.4), 9 pt text."""
    if preset not in PAPER_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PAPER_PRESETS)}")
    out = go.Figure(fig)
    width = int(round(PAPER_PRESETS[preset] * 96))
    w0 = fig.layout.width or 700
    h0 = fig.layout.height or 450
    height = int(min(width * 1.4, max(width * 0.5, h0 * width / w0)))
    px = PAPER_FONT_PT * 96 / 72
    subtitles = any(a.yref == "paper" and (a.y or 0) >= 0.99 for a in fig.layout.annotations)
    out.update_layout(
        width=width,
        height=height,
        font=dict(size=px),
        title_font=dict(size=px + 1),
        title_pad=dict(t=4),  # no toolbar on paper
        margin=dict(l=40, r=10, t=(24 if fig.layout.title.text else 6) + (16 if subtitles else 0), b=40),
    )
    out.update_annotations(font_size=px)
    return out


def provenance_line(provenance: dict | None) -> str:
    """What made a figure or table, as one line: "ctxmix provenance: {json}" ("" without one)."""
    if not provenance:
        return ""
    import json

    return "ctxmix provenance: " + json.dumps(provenance, sort_keys=True, default=str, ensure_ascii=False)


def _png_with_text(png: bytes, text: str) -> bytes:
    """A PNG with a tEXt chunk (key "ctxmix-provenance"), written with Pillow when it is there."""
    try:
        import io

        from PIL import Image, PngImagePlugin
    except ImportError:  # no Pillow: the sidecar download still carries it
        return png
    im = Image.open(io.BytesIO(png))
    info = PngImagePlugin.PngInfo()
    info.add_text("ctxmix-provenance", text)
    out = io.BytesIO()
    im.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def figure_bytes(
    fig: go.Figure, fmt: str, scale: float = 2.0, preset: str | None = None, provenance: dict | None = None
) -> bytes:
    """The figure as png, svg, pdf (kaleido + Chromium) or html (always works); `preset` sizes it
    for a paper (PAPER_PRESETS: "acl-column", "acl-page", "neurips", "iclr"). `provenance` goes into
    the file: an HTML or SVG comment, a PNG text chunk, the PDF's subject (its document information)."""
    if preset is not None:
        fig = paper_figure(fig, preset)
    line = provenance_line(provenance)
    fmt = fmt.lower()
    if fmt == "html":
        html = fig.to_html(include_plotlyjs="cdn", full_html=True)
        return (f"<!-- {line.replace('--', '- -')} -->\n" + html if line else html).encode()
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError("format must be png, svg, pdf or html")
    if not static_export_available():
        raise RuntimeError(STATIC_HINT)
    import os

    os.environ.setdefault("BROWSER_PATH", chromium_path() or "")
    data = fig.to_image(format=fmt, scale=scale if fmt == "png" else 1)
    if not line:
        return data
    if fmt == "svg":
        text = data.decode()
        i = text.find("<svg")
        return (text[:i] + f"<!-- {line.replace('--', '- -')} -->" + text[i:]).encode()
    if fmt == "png":
        return _png_with_text(data, line)
    return _pdf_with_subject(data, line)


def _pdf_with_subject(pdf: bytes, text: str) -> bytes:
    """The PDF with `text` appended as an incremental update of its document information
    (/Subject): readers show it under the document's properties; the pages are untouched."""
    import re

    m = re.search(rb"/Info\s+(\d+)\s+0\s+R", pdf)
    start = pdf.rfind(b"startxref")
    root = re.search(rb"/Root\s+(\d+\s+0\s+R)", pdf)
    size = re.search(rb"/Size\s+(\d+)", pdf)
    if start < 0 or root is None or size is None:
        return pdf
    prev = int(pdf[start + 9 :].split()[0])
    n = int(size.group(1))
    esc = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1", "replace")
    obj = n if m is None else int(m.group(1))
    body = f"{obj} 0 obj\n<< /Producer (ctxmix) /Subject (".encode() + esc + b") >>\nendobj\n"
    offset = len(pdf) + 1
    xref = f"xref\n{obj} 1\n{offset:010d} 00000 n \n".encode()
    trailer = (
        f"trailer\n<< /Size {max(n, obj + 1)} /Root {root.group(1).decode()} /Info {obj} 0 R /Prev {prev} >>\n"
        f"startxref\n{offset + len(body)}\n%%EOF\n"
    ).encode()
    return pdf + b"\n" + body + xref + trailer


def table_bytes(df: pd.DataFrame, fmt: str, caption: str | None = None, provenance: dict | None = None) -> bytes:
    """A table as csv, json or LaTeX (booktabs, written directly: no jinja2 needed). `provenance`
    goes in as a first comment line ("# ..." in CSV: pandas reads it with comment="#"; "% ..." in
    LaTeX) or, in JSON, as {"provenance": ..., "rows": [...]}."""
    line = provenance_line(provenance)
    if fmt == "csv":
        body = df.to_csv(index=df.index.name is not None or not isinstance(df.index, pd.RangeIndex))
        return ((f"# {line}\n" if line else "") + body).encode()
    if fmt == "json":
        if not line:
            return df.reset_index().to_json(orient="records", indent=1).encode()
        import json

        rows = json.loads(df.reset_index().to_json(orient="records"))
        return json.dumps({"provenance": provenance, "rows": rows}, indent=1, default=str).encode()
    if fmt == "tex":
        return ((f"% {line}\n" if line else "") + dataframe_booktabs(df, caption)).encode()
    raise ValueError("format must be csv, json or tex")


def figure_data_bytes(data: dict | pd.DataFrame, fmt: str = "json", provenance: dict | None = None) -> bytes:
    """The data behind a figure: a DataFrame as csv/json, or a dict of arrays as json (with a
    "provenance" entry when given)."""
    if isinstance(data, pd.DataFrame):
        return table_bytes(data, fmt, provenance=provenance)
    import json

    if provenance:
        data = {"provenance": provenance, **data}

    def conv(v):
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return json.dumps(conv(data), indent=1).encode()


def save_figure(fig: go.Figure, path: str) -> None:
    """Write a figure; the format comes from the extension (png, svg, pdf, html)."""
    from pathlib import Path

    p = Path(path)
    p.write_bytes(figure_bytes(fig, p.suffix.lstrip(".")))


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("io", "shutil", "np", "pd", "go", "make_subplots")]
