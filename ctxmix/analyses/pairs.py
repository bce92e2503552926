"""Sentence pairs: how much of each text's context comes from the other text.

For an explanation of a pair (text A, text B), `cross_segment_mixing` reads every mixing
method's maps (row i = output token, column j = input token), normalises each row to sum to one
over tokens, and averages, over the output tokens of one text, the share of the row that comes
from the other text, from the same text and from the special tokens ([CLS], [SEP], ...), which
belong to neither text and are reported apart. "A→B" is the mixing from A into B: the rows of B's
tokens, their share from A; "B→A" the rows of A's tokens, their share from B.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ctxmix.errors import BadInput

DIRECTIONS = {"A→B": (1, 0), "B→A": (0, 1)}  # direction: (segment of the rows, segment of the other text)


def segment_shares(M: np.ndarray, segments: list[int]) -> dict[str, dict[str, float]]:
    """Shares of one map M (n, n): {direction: {"other", "own", "special"}}, each the mean over the
    rows of the receiving text of that row's share (|M| normalised to sum to one per row). The
    three shares of a direction sum to one. A row of zeros counts as no row."""
    seg = np.asarray(segments)
    if M.shape != (len(seg), len(seg)):
        raise BadInput(f"a map of shape {M.shape} for {len(seg)} segments")
    A = np.abs(np.asarray(M, dtype=np.float64))
    tot = A.sum(-1)
    out = {}
    for d, (rows_seg, other_seg) in DIRECTIONS.items():
        rows = np.flatnonzero((seg == rows_seg) & (tot > 0))
        if len(rows) == 0:
            out[d] = {"other": np.nan, "own": np.nan, "special": np.nan}
            continue
        R = A[rows] / tot[rows, None]
        out[d] = {
            "other": float(R[:, seg == other_seg].sum(-1).mean()),
            "own": float(R[:, seg == rows_seg].sum(-1).mean()),
            "special": float(R[:, seg == -1].sum(-1).mean()),
        }
    return out


def cross_segment_mixing(ex, methods: list[str] | None = None) -> pd.DataFrame:
    """A→B and B→A mixing of a pair's explanation, per method, map ("layer": each layer's own map;
    "aggregated": rolled out up to that layer) and layer (1-based). Columns: method, map, layer,
    direction, other (share from the other text), own (from the same text), special (from special
    tokens); other + own + special = 1 per row."""
    segs = getattr(ex, "segments", None)
    if segs is None or not ({0, 1} <= set(segs)):
        raise BadInput("this explanation is not of a sentence pair: explain(model, (text_a, text_b), ...) gives one")
    methods = [m for m in (methods or ex.methods) if m in ex.layer_maps]
    rows = []
    for m in methods:
        for view, maps in (("layer", ex.layer_maps[m]), ("aggregated", ex.global_maps[m])):
            for l, M in enumerate(maps):
                for d, sh in segment_shares(M, segs).items():
                    rows.append({"method": m, "map": view, "layer": l + 1, "direction": d, **sh})
    return pd.DataFrame(rows, columns=["method", "map", "layer", "direction", "other", "own", "special"])
