"""The one style every figure shares: Okabe-Ito colours, one font, token labels on the axes
(made unique, since plotly merges equal category labels, and thinned so they never overlap), titles
below the plotly toolbar."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

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
