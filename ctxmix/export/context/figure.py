"""The shaded context of a context attribution as a figure a paper can print (PNG/SVG/PDF through
`files.figure_bytes`): one table row per source in context order, its text wrapped to the width asked
for and its cell shaded by the method's score (the explanation views' scale: white at 0, blue positive,
red negative, scaled by the largest |score|), the score in a narrow column beside it; long runs of
low-score sources fold into one grey row, as on the page (`low_runs`, which the page's HTML shares).

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
COLLAPSE_BELOW = 0.1  # a source whose |score| is under 10 % of the largest is "low"
COLLAPSE_RUN = 3  # fold runs of at least this many low sources


def span_scores(ca, method: str, span=None) -> np.ndarray:
    """(d,) `method`'s source scores for a character span of the response (None: all of it)."""
    return np.asarray(ca.scores[method] if span is None else ca.scores_for(method, span), dtype=np.float64)


def low_runs(scores, below: float = COLLAPSE_BELOW, run: int = COLLAPSE_RUN) -> list[tuple[int, int]]:
    """Runs [i, j) of at least `run` consecutive sources whose |score| is under `below` times the largest
    |score| (the stretches a long context folds away). NaN counts as low; all-zero scores: one run of all."""
    s = np.abs(np.asarray(scores, dtype=np.float64))
    top = float(np.nanmax(s)) if np.isfinite(s).any() else 0.0
    low = ~(s >= below * top) if top > 0 else np.ones(len(s), bool)
    out, i = [], 0
    while i < len(s):
        if low[i]:
            j = i
            while j < len(s) and low[j]:
                j += 1
            if j - i >= run:
                out.append((i, j))
            i = j
        else:
            i += 1
    return out


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
    s = span_scores(ca, method, span)
    finite = np.isfinite(s)
    top = float(np.abs(s[finite]).max()) if finite.any() else 0.0
    scaled = s / top if top > 0 else np.where(finite, 0.0, np.nan)  # context_html's scaling (no import: a cycle)
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
