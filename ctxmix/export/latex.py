"""The one LaTeX writer: booktabs tables, written directly (no jinja2), for every export."""

from __future__ import annotations

import numpy as np
import pandas as pd

_ESCAPES = (
    ("\\", r"\textbackslash{}"),
    ("&", r"\&"),
    ("%", r"\%"),
    ("$", r"\$"),
    ("#", r"\#"),
    ("_", r"\_"),
    ("{", r"\{"),
    ("}", r"\}"),
    ("~", r"\textasciitilde{}"),
    ("^", r"\textasciicircum{}"),
    ("±", r"$\pm$"),
    ("↑", r"$\uparrow$"),
    ("↓", r"$\downarrow$"),
    ("–", "--"),
)


def tex_escape(s) -> str:
    """Text as LaTeX source: special characters escaped, ±/↑/↓ as math, en dash as --."""
    s = str(s)
    for a, b in _ESCAPES:
        s = s.replace(a, b)
    return s


def booktabs(
    header: list[str],
    rows: list[list[str]],
    align: str,
    caption: str | None = None,
    label: str | None = None,
    small: bool = False,
) -> str:
    """A table environment with a booktabs tabular. `header` is plain text (escaped here); `rows`
    are cells already in LaTeX (the caller escapes text and may add \\textbf); `align` one letter
    per column."""
    lines = (
        [r"\begin{table}[t]", r"\centering"]
        + ([r"\small"] if small else [])
        + [
            rf"\begin{{tabular}}{{{align}}}",
            r"\toprule",
            " & ".join(tex_escape(h) for h in header) + r" \\",
            r"\midrule",
        ]
    )
    lines += [" & ".join(r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(rf"\caption{{{tex_escape(caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def dataframe_booktabs(df: pd.DataFrame, caption: str | None = None, float_fmt: str = "{:.3f}") -> str:
    """Any DataFrame as a booktabs table (the index included when it is not a plain range;
    numbers right-aligned, NaN as --)."""
    show_index = not isinstance(df.index, pd.RangeIndex)
    header = ([df.index.name or ""] if show_index else []) + [str(c) for c in df.columns]
    align = "l" * show_index + "".join("r" if pd.api.types.is_numeric_dtype(df[c]) else "l" for c in df.columns)
    rows = []
    for idx, row in df.iterrows():
        cells = [tex_escape(idx)] if show_index else []
        for v in row:
            if isinstance(v, (float, np.floating)):
                cells.append("--" if np.isnan(v) else float_fmt.format(v))
            else:
                cells.append(tex_escape(v))
        rows.append(cells)
    return booktabs(header, rows, align, caption)
