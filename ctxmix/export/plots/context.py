"""The shaded context of a context attribution as a figure a paper can print (PNG/SVG/PDF through
`files.figure_bytes`): one table row per source in context order, its text wrapped to the width asked
for and its cell shaded by the method's score (the explanation views' scale: white at 0, blue positive,
red negative, scaled by the largest |score|), the score in a narrow column beside it; long runs of
low-score sources fold into one grey row, as on the page (`ctxmix.export.context_view.low_runs`).

The figure sizes itself: the width is the caller's (a paper's column: 3.03 in = 291 px at 96 px per inch)
and the height follows the wrapped lines, so the static export never clips a row (`paper_figure`'s
height cap is not applied: pass `preset=None` to `figure_bytes`).
"""

from __future__ import annotations

import textwrap

import numpy as np
import plotly.graph_objects as go

from ctxmix.export.plots.style import FONT, toolbar_title

CHAR_WIDTH = 0.55  # Arial's mean character width in em, rounded up so wrapped lines never overflow
LINE_HEIGHT = 1.35  # em per text line in a cell
PAD = 8  # px above and below a cell's text
SCORE_PX = 58  # the score column


def _rgb(v: float) -> tuple[str, str]:
    """(fill, text colour) for a score scaled to [-1, 1] (`ctxmix.export.notebook._cell_style`'s scale)."""
    if not np.isfinite(v):
        return "rgb(221,221,221)", "#222"
    end = (33, 102, 172) if v >= 0 else (178, 24, 43)
    a = min(1.0, abs(float(v)))
    r, g, b = (round(255 + (e - 255) * a) for e in end)
    return f"rgb({r},{g},{b})", "#fff" if a > 0.6 else "#222"


def context_figure(
    ca,
    method: str,
    span=None,
    width_px: int = 700,
    font_px: float = 12.0,
    collapse: bool = True,
    title: str | None = None,
) -> go.Figure:
    """`method`'s scores (for a character span of the response, or all of it) over the context's sources:
    one row per source (text wrapped to fit width_px), shaded by score, runs of low sources folded. Returns
    a figure whose height fits every row."""
    from ctxmix.export.context_html import _scaled
    from ctxmix.export.context_view import low_runs, span_scores

    s = span_scores(ca, method, span)
    scaled = _scaled(s)
    folds = dict(low_runs(s)) if collapse else {}
    text_px = max(80, int(width_px) - SCORE_PX - 20)
    per_line = max(12, int(text_px / (CHAR_WIDTH * font_px)) - 2)
    scores_col, texts, fills, colours, lines = [], [], [], [], []
    i = 0
    while i < ca.n_sources:
        if i in folds:
            j = folds[i]
            scores_col.append("")
            texts.append(f"<i>[… sources {i}-{j - 1}: |score| under 10% of the largest …]</i>")
            fills.append("rgb(245,245,245)")
            colours.append("#666")
            lines.append(max(1, len(textwrap.wrap(f"[… sources {i}-{j - 1}: |score| under 10% …]", per_line))))
            i = j
            continue
        wrapped = textwrap.wrap(" ".join(ca.sources[i].split()), per_line) or [""]
        fill, colour = _rgb(scaled[i])
        scores_col.append(f"{s[i]:.3g}")
        texts.append("<br>".join(w.replace("<", "&lt;").replace(">", "&gt;") for w in wrapped))
        fills.append(fill)
        colours.append(colour)
        lines.append(len(wrapped))
        i += 1
    line_px = font_px * LINE_HEIGHT
    heights = [n * line_px + 2 * PAD for n in lines]
    what = "the response" if span is None else f"response characters {int(span[0])}-{int(span[1])}"
    head = title if title is not None else f"{method}: sources of {what}"
    top = 44  # the title, below the toolbar
    fig = go.Figure(
        go.Table(
            columnwidth=[SCORE_PX, text_px],
            header=dict(
                values=["<b>score</b>", "<b>source (context order)</b>"],
                align=["right", "left"],
                fill_color="white",
                line_color="#ccc",
                font=dict(size=font_px, color="#222"),
                height=line_px + 2 * PAD,
            ),
            cells=dict(
                values=[scores_col, texts],
                align=["right", "left"],
                fill_color=[fills, fills],
                font=dict(size=font_px, color=[colours, colours]),
                line_color="#eee",
                height=line_px + 2 * PAD,
            ),
        )
    )
    height = int(top + (line_px + 2 * PAD) + sum(heights) + 16)
    fig.update_layout(
        width=int(width_px),
        height=height,
        margin=dict(l=8, r=8, t=top, b=8),
        font={**FONT, "size": font_px},
        paper_bgcolor="white",
        title={**toolbar_title(head), "font": {"size": font_px + 1}},
    )
    return fig
