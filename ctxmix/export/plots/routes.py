"""Information-flow routes (Ferrando & Voita 2024): the graph of a `Routes` drawn over tokens
(x) and layers (y), edges binned by weight."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ctxmix.export.plots.style import _axis, _layout, display_tokens

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
