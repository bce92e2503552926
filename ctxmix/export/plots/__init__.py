"""Plotly figures shared by the dashboard, the command line and notebooks, and their export.

One module per kind of figure, all in one style (`style`: white background, Okabe-Ito colours,
sequential "Blues" for non-negative maps and diverging "RdBu" centred on zero for signed ones, token
labels on the axes):

    style       colours, font, token labels, titles below the plotly toolbar
    maps        (n, n) context-mixing maps, scopes side by side, every head
    images      an image with one row's heat over its patches
    audio       a clip's spectrogram or waveform with one row's heat over its frames
    saliency    per-token saliency rows, ALTI+'s source share, rank agreement between methods
    prediction  signed logit parts per token, the layer-by-token table of ALTI-Logit / Logit
    routes      information-flow routes over tokens and layers
    corpus      contextualization change, dynamics, cross-segment mixing, residual norms, outliers
    files       PNG/SVG/PDF/HTML with provenance, figure data and tables as files, paper presets

Every figure is importable from here (`ctxmix.export.plots.map_heatmap`), as before the split; a context
attribution's paper figure lives with the rest of context attribution's views (`ctxmix.export.context.figure`)
and is forwarded on first use (it draws with `style`, so importing it here at the top would be a cycle).
"""

from ctxmix.export.plots.audio import clip_heat, explained_clip_heat
from ctxmix.export.plots.corpus import (
    change_bars,
    correlation_bars,
    cross_mixing_figure,
    grouped_bars,
    outlier_figure,
    res2_figure,
)
from ctxmix.export.plots.files import (
    PAPER_FONT_PT,
    PAPER_PRESETS,
    STATIC_HINT,
    chromium_path,
    figure_bytes,
    figure_data_bytes,
    paper_figure,
    provenance_line,
    save_figure,
    static_export_available,
    table_bytes,
)
from ctxmix.export.plots.images import explained_image_heat, image_heat
from ctxmix.export.plots.maps import head_grid, map_heatmap, maps_grid
from ctxmix.export.plots.prediction import NEGATIVE, POSITIVE, layer_saliency_figure, logit_contributions_figure
from ctxmix.export.plots.routes import ROUTE_BINS, ROUTE_COLOURS, route_node_xy, routes_figure
from ctxmix.export.plots.saliency import rank_correlation_table, saliency_figure, source_contribution_figure
from ctxmix.export.plots.style import (
    COMPONENT_COLOURS,
    FONT,
    MAX_TICK_LABELS,
    OKABE_ITO,
    _axis,  # noqa: F401 - the tick thinning, tested directly
    color_range,
    display_tokens,
    toolbar_title,
)

__all__ = [
    "COMPONENT_COLOURS",
    "FONT",
    "MAX_TICK_LABELS",
    "NEGATIVE",
    "OKABE_ITO",
    "PAPER_FONT_PT",
    "PAPER_PRESETS",
    "POSITIVE",
    "ROUTE_BINS",
    "ROUTE_COLOURS",
    "STATIC_HINT",
    "change_bars",
    "clip_heat",
    "chromium_path",
    "color_range",
    "context_figure",
    "correlation_bars",
    "cross_mixing_figure",
    "display_tokens",
    "explained_clip_heat",
    "explained_image_heat",
    "figure_bytes",
    "figure_data_bytes",
    "grouped_bars",
    "head_grid",
    "image_heat",
    "layer_saliency_figure",
    "logit_contributions_figure",
    "map_heatmap",
    "maps_grid",
    "outlier_figure",
    "paper_figure",
    "provenance_line",
    "rank_correlation_table",
    "res2_figure",
    "route_node_xy",
    "routes_figure",
    "saliency_figure",
    "save_figure",
    "source_contribution_figure",
    "static_export_available",
    "table_bytes",
    "toolbar_title",
]


def __getattr__(name: str):
    if name == "context_figure":
        from ctxmix.export.context.figure import context_figure

        return context_figure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
