"""The Context attribution page's views of a `ContextAttribution`, as plain data and HTML (no Streamlit):
the response cut into pieces a user picks a span from, the shaded context with long low-score stretches
folded away (readable at thousands of tokens), and the ranked tables (one method, methods side by side).

Every score here comes from `ContextAttribution.scores_for` (stored contributions or ablations: no model).
"""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd

from ctxmix.errors import BadInput
from ctxmix.export.context.figure import COLLAPSE_BELOW, COLLAPSE_RUN, low_runs, span_scores  # noqa: F401 - the pages' too
from ctxmix.export.context.html import _scaled
from ctxmix.export.notebook import _cell_style

SPAN_UNITS = ("response", "sentence", "word")


def response_pieces(response: str, unit: str) -> list[tuple[int, int, str]]:
    """The response cut into pieces a span is picked from: (start, end, text) character spans of `response`.
    unit: "response" (one piece, all of it), "sentence" (the sources' offline splitter) or "word" (runs of
    non-space characters)."""
    if unit not in SPAN_UNITS:
        raise BadInput(f"unit must be one of {', '.join(SPAN_UNITS)}, got {unit!r}")
    if not response.strip():
        return []
    if unit == "response":
        return [(0, len(response), response)]
    if unit == "word":
        return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", response)]
    from ctxmix.methods.context.sources import sentence_spans

    return [(a, b, response[a:b]) for a, b in sentence_spans(response)]


def span_of(pieces: list[tuple[int, int, str]], chosen: list[int]) -> tuple[int, int] | None:
    """The character span covering the chosen pieces (indices into `pieces`, any order; they need not touch:
    the span runs from the first chosen piece's start to the last one's end). None: nothing chosen."""
    idx = sorted({int(i) for i in chosen if 0 <= int(i) < len(pieces)})
    if not idx:
        return None
    return pieces[idx[0]][0], pieces[idx[-1]][1]


def signed(scores: np.ndarray) -> bool:
    """Whether a diverging scale is needed: some score is negative."""
    return bool((np.asarray(scores) < 0).any())


def _source_span(ca, i: int, s: float, scaled: float) -> str:
    a, b = ca.source_spans[i]
    return (
        f'<span data-source="{i}" data-score="{float(s)!r}" title="source {i}: {s:.6g}" '
        f'style="{_cell_style(scaled)};border-radius:2px">{html.escape(ca.context[a:b])}</span>'
    )


def context_view_html(ca, scores, collapse: bool = True, below: float = COLLAPSE_BELOW, run: int = COLLAPSE_RUN) -> str:
    """The context with each source shaded by its score (d,) (`ctxmix.export.context.html`'s scale: blue
    raises, red lowers, scaled by the largest |score|), runs of low-score sources (`low_runs`) folded into a
    <details> element that opens on a click, so a 2,000-token context reads at a glance. HTML-escaped."""
    s = np.asarray(scores, dtype=np.float64)
    if s.shape != (ca.n_sources,):
        raise BadInput(f"scores must have one value per source ({ca.n_sources}), got shape {s.shape}")
    scaled = _scaled(s)
    folds = {i: j for i, j in low_runs(s, below, run)} if collapse else {}
    out, cur, i = [], 0, 0
    while i < ca.n_sources:
        a, _ = ca.source_spans[i]
        out.append(html.escape(ca.context[cur:a]))
        if i in folds:
            j = folds[i]
            inner = "".join(
                html.escape(ca.context[ca.source_spans[q - 1][1] : ca.source_spans[q][0]]) * (q > i)
                + _source_span(ca, q, s[q], scaled[q])
                for q in range(i, j)
            )
            out.append(
                f'<details style="display:inline" data-folded="{i}-{j - 1}"><summary style="display:inline;'
                f'cursor:pointer;color:#666;font-style:italic">[… {j - i} sources with |score| under '
                f"{below:.0%} of the largest …]</summary>{inner}</details>"
            )
            cur, i = ca.source_spans[j - 1][1], j
        else:
            out.append(_source_span(ca, i, s[i], scaled[i]))
            cur, i = ca.source_spans[i][1], i + 1
    out.append(html.escape(ca.context[cur:]))
    return (
        '<div class="ctxmix-context" style="white-space:pre-wrap;line-height:1.7;font-family:serif;'
        f'font-size:15px">{"".join(out)}</div>'
    )


BOX_MAX_PX = 600  # a longer context scrolls inside its box
_BOX_PADDING_PX = 40  # a bordered Streamlit container's padding (1 rem above and below) and borders, st.html's margin


def context_box_height(view_html: str, width_px: int, max_px: int = BOX_MAX_PX, font_px: int = 15) -> int:
    """The height in pixels of a bordered box that shows `context_view_html`'s output (`view_html`) at
    `width_px` without empty space or a scroll bar, capped at `max_px` (a longer context scrolls): the
    visible text (a folded run counts as its one-line summary) wrapped at 0.9 width_px / (0.5 font_px)
    characters per line (serif text averages under half an em a character; 0.9: words wrap whole), each
    text line (newlines kept: pre-wrap) at least one line of font_px x 1.7 (the view's line height)."""
    visible = re.sub(r"<details[^>]*><summary[^>]*>(.*?)</summary>.*?</details>", r"\1", view_html, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", visible))
    per_line = max(1, int(0.9 * width_px / (0.5 * font_px)))
    lines = sum(max(1, -(-len(line) // per_line)) for line in text.split("\n"))
    return int(min(max_px, round(lines * font_px * 1.7) + _BOX_PADDING_PX))


def span_methods(ca, methods: list[str], span) -> tuple[list[str], list[str]]:
    """(the methods that can score `span`, those that score the whole response only): a method whose record says it
    stores the whole response's derivatives only (`ContextMethod.whole_response`) is left out of a sub-span."""
    from ctxmix.methods.context.keymask import whole_response_only

    only = whole_response_only(methods, *ca.token_range(span), len(ca.response_ids))
    return [m for m in methods if m not in only], only


def span_scoring_methods() -> list[str]:
    """The context methods that score any span of the response (not the whole response only)."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    return [m for m, r in CONTEXT_METHODS.items() if not r.whole_response]


def methods_help() -> str:
    """The Methods box's help, from the records: which run at once, which behind the button, what each is."""
    from ctxmix.methods.registry import CONTEXT_METHODS, context_methods

    at_once = [m for m, r in CONTEXT_METHODS.items() if r.cost != "ablation"]
    whole = [m for m, r in CONTEXT_METHODS.items() if r.whole_response]
    ablation = context_methods("ablation")
    return (
        f"Methods without ablations ({', '.join(at_once)}) run at once"
        + (f" ({' and '.join(whole)} score the whole response only)" if whole else "")
        + f"; {' and '.join(ablation)} make one forward pass per ablation and run when you click their button. "
        + "; ".join(f"{m}: {r.title} ({r.passes})" for m, r in CONTEXT_METHODS.items())
    )


def passes_label(methods: list[str], n_ablations: int) -> str:
    """The forward passes the methods' records say they make, n_ablations filled in ("32 forward + d + 1 forward")."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    parts = [CONTEXT_METHODS[m].passes.replace("n_ablations", str(int(n_ablations))) for m in methods]
    return " + ".join(p.replace("d + 1", "one per source + 1") for p in parts) + " passes"


def stage_label(stage: str) -> str:
    """A progress stage's words: a method's title (its ablations), else the stage's name."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    r = CONTEXT_METHODS.get(stage)
    return f"{r.title} ablations" if r is not None and r.cost == "ablation" else stage


def colour_key(scores) -> str:
    """What the shading means, for a caption."""
    if signed(scores):
        return "blue raises the response, red lowers it, white 0 (diverging, scaled by the largest |score|)"
    return "darker blue: higher score (all scores are non-negative; scaled by the largest)"


def top_table(ca, method: str, k: int = 10, span=None) -> pd.DataFrame:
    """The k best sources of `method` for the span: rank (1 = best), source (index), score, text."""
    s = span_scores(ca, method, span)
    order = np.argsort(-s, kind="stable")[: max(1, int(k))]  # ties: the earlier source (as `top`)
    return pd.DataFrame(
        {
            "rank": np.arange(1, len(order) + 1),
            "source": order.astype(int),
            "score": s[order],
            "text": [ca.sources[i] for i in order],
        }
    )


def side_by_side(ca, methods: list[str], k: int = 10, span=None) -> pd.DataFrame:
    """The top-k of each method next to each other: one row per rank, per method its source and score."""
    cols = {}
    for m in methods:
        t = top_table(ca, m, k, span)
        cols[f"{m} source"] = t["source"].tolist()
        cols[f"{m} score"] = t["score"].tolist()
        cols[f"{m} text"] = t["text"].tolist()
    n = max((len(v) for v in cols.values()), default=0)
    return pd.DataFrame({"rank": np.arange(1, n + 1), **cols})


def rank_agreement(ca, methods: list[str], span=None) -> float:
    """Spearman between two methods' source scores for the span (NaN when either is constant)."""
    import warnings

    from scipy import stats

    a, b = (span_scores(ca, m, span) for m in methods[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(stats.spearmanr(a, b).statistic)


def context_html_bytes(ca, method: str, span=None, provenance: dict | None = None, collapse: bool = False) -> bytes:
    """The shaded context as a standalone HTML file (UTF-8): the method, the span explained, the colour key,
    the context, and the provenance as a comment line (as every export of the dashboard carries it)."""
    from ctxmix.export.plots.files import provenance_line

    s = span_scores(ca, method, span)
    e = html.escape
    what = ca.response if span is None else ca.response[int(span[0]) : int(span[1])]
    prov = provenance_line(provenance) if provenance else ""
    doc = (
        "<!DOCTYPE html>\n"
        + (f"<!-- {prov.replace('--', '- -')} -->\n" if prov else "")
        + '<html><head><meta charset="utf-8"><title>ctxmix context attribution</title></head><body>'
        + f"<p><b>{e(method)}</b> ({e(colour_key(s))})</p>"
        + f"<p><em>Explained:</em> <code style='white-space:pre-wrap'>{e(what)}</code></p>"
        + context_view_html(ca, s, collapse=collapse)
        + "</body></html>\n"
    )
    return doc.encode("utf-8")


def unique_labels(texts: list[str]) -> list[str]:
    """Labels for clickable pieces that look like the texts but are all different: Streamlit's pills keep a
    selection by its label, so two pieces reading "the" would be one; a repeat gets zero-width spaces."""
    seen: dict[str, int] = {}
    out = []
    for t in texts:
        n = seen.get(t, 0)
        seen[t] = n + 1
        out.append(t + "\u200b" * n)
    return out
