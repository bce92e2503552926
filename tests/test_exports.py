"""Exports open: PNG, SVG and PDF through kaleido + Chromium, HTML always, CSV and LaTeX tables."""

import io
import json

import numpy as np
import pandas as pd
import pytest

from ctxmix.export import plots

TOKENS = ["[CLS]", "the", "keys", "the", "Ġtable", "[SEP]"]


def _fig():
    M = np.random.default_rng(0).random((6, 6))
    return plots.map_heatmap(TOKENS, M, "test")


def test_html_export_always_works():
    html = plots.figure_bytes(_fig(), "html").decode()
    assert "<html>" in html and "plotly" in html.lower()


@pytest.mark.slow
@pytest.mark.parametrize("fmt,magic", [("png", b"\x89PNG"), ("svg", b"<svg"), ("pdf", b"%PDF")])
def test_static_exports(fmt, magic, tmp_path):
    """One export per format (kaleido starts Chromium: seconds each): the bytes open as their format,
    have a real size and carry the provenance (PNG text chunk, SVG comment, PDF subject)."""
    import re

    if not plots.static_export_available():
        pytest.fail("kaleido + Chromium are required for static export (apt install chromium)")
    data = plots.figure_bytes(_fig(), fmt, provenance=PROV)
    assert magic in data[:200] and len(data) > 1000
    if fmt == "png":
        import struct

        from PIL import Image

        w, h = struct.unpack(">II", data[16:24])
        assert w > 100 and h > 100
        assert json.loads(Image.open(io.BytesIO(data)).text["ctxmix-provenance"].split(": ", 1)[1]) == PROV
    elif fmt == "svg":
        assert b"<!-- ctxmix provenance:" in data
    else:
        assert b"/Subject (ctxmix provenance:" in data and data.rstrip().endswith(b"%%EOF")
        last = data.rfind(b"startxref")
        off = int(data[last + 9 :].split()[0])
        assert data[off : off + 4] == b"xref"  # the incremental update's table is where the trailer says
        entry = int(re.search(rb"(\d{10}) 00000 n", data[off:]).group(1))
        assert re.match(rb"\d+ 0 obj", data[entry : entry + 12])


def test_save_figure_writes_the_format_of_its_suffix(tmp_path, monkeypatch):
    """save_figure picks the format from the suffix (each format's export is tested above)."""
    seen = []
    # patched where save_figure looks it up (plots.files; the package re-exports it)
    monkeypatch.setattr(plots.files, "figure_bytes", lambda fig, fmt, **kw: seen.append(fmt) or b"x" * 2000)
    for fmt in ("png", "svg", "pdf"):
        plots.save_figure(_fig(), str(tmp_path / f"f.{fmt}"))
        assert (tmp_path / f"f.{fmt}").stat().st_size == 2000
    assert seen == ["png", "svg", "pdf"]


def test_tables_csv_and_latex():
    df = pd.DataFrame({"method": ["alti", "glob_enc"], "spearman": [0.5, np.nan], "n": [3, 4]})
    back = pd.read_csv(io.BytesIO(plots.table_bytes(df, "csv")))
    assert list(back.columns) == ["method", "spearman", "n"] and back.spearman.iloc[0] == 0.5
    tex = plots.table_bytes(df, "tex", caption="a & b").decode()
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"glob\_enc" in tex and "--" in tex
    assert r"a \& b" in tex
    assert tex.count(r"\\") == 3  # header + two rows
    rec = json.loads(plots.table_bytes(df, "json"))
    assert rec[0]["method"] == "alti"


def test_unique_token_labels_and_readable_bpe():
    ax = plots._axis(TOKENS)
    assert ax["tickvals"] == list(range(6))  # positions, so repeated tokens ("the") stay separate
    assert plots.display_tokens(["Ġtable"]) == ["·table"]


def test_figure_data_json():
    d = json.loads(plots.figure_data_bytes({"tokens": TOKENS, "map": np.eye(2)}))
    assert d["map"] == [[1.0, 0.0], [0.0, 1.0]]


def test_crowded_tick_labels_are_thinned_and_rotated():
    toks = [f"t{i}" for i in range(100)]
    fig = plots.map_heatmap(toks, np.random.default_rng(0).random((100, 100)))
    ax = fig.layout.xaxis
    assert len(ax.tickvals) <= plots.MAX_TICK_LABELS and ax.tickvals[0] == 0 and ax.tickvals[-1] == 99
    assert ax.tickangle == -90 and list(ax.ticktext)[:2] == ["t0", "t5"]
    assert min(np.diff(ax.tickvals)) >= 5  # evenly spaced: the last label does not crowd its neighbour
    assert fig.layout.yaxis.tickangle == 0  # row labels stay horizontal
    few = plots.map_heatmap(toks[:8], np.ones((8, 8))).layout.xaxis
    assert list(few.tickvals) == list(range(8)) and few.tickangle == 0


def test_scope_grid_titles_clear_the_toolbar():
    fig = plots.maps_grid(["a", "b"], {"Atb": np.ones((2, 2)), "AtbFf": np.ones((2, 2))})
    assert fig.layout.margin.t >= 70


@pytest.mark.parametrize("preset, inches", [("acl-column", 3.03), ("acl-page", 6.3), ("neurips", 5.5)])
def test_paper_presets(preset, inches):
    fig = plots.map_heatmap(["a", "b", "c"], np.ones((3, 3)), "title")
    out = plots.paper_figure(fig, preset)
    assert out.layout.width == round(inches * 96) and out.layout.font.size == pytest.approx(12.0)
    assert fig.layout.width is None  # the screen figure is untouched
    with pytest.raises(ValueError, match="preset"):
        plots.paper_figure(fig, "a4")


@pytest.mark.slow
def test_a_paper_preset_pdf_has_the_column_width():
    import re

    if not plots.static_export_available():
        pytest.skip("no Chromium for kaleido")
    pdf = plots.figure_bytes(plots.map_heatmap(["a", "b"], np.ones((2, 2)), "t"), "pdf", preset="acl-column")
    width = float(re.search(rb"/MediaBox \[\s*[\d.]+\s+[\d.]+\s+([\d.]+)", pdf).group(1))
    assert width / 72 == pytest.approx(3.03, abs=0.01)  # inches


def test_one_colour_scale_across_layers():
    maps = np.stack([np.full((2, 2), 0.5), np.full((2, 2), 2.0)])
    z = plots.color_range(maps)
    assert z == 2.0
    fig = plots.map_heatmap(["a", "b"], maps[0], zmax=z)
    assert fig.data[0].zmax == 2.0 and fig.data[0].zmin == 0
    signed = plots.map_heatmap(["a", "b"], -maps[0], zmax=z)
    assert signed.data[0].zmin == -2.0 and signed.data[0].zmax == 2.0


PROV = {"model": "minilm", "ctxmix_version": "0.1.0", "text": "a (b) -- c"}


def test_tables_carry_their_provenance():
    df = pd.DataFrame({"layer": [1, 2], "change": [0.25, 0.5]})
    csv = plots.table_bytes(df, "csv", provenance=PROV).decode()
    assert csv.startswith("# ctxmix provenance: {") and '"model": "minilm"' in csv.splitlines()[0]
    pd.testing.assert_frame_equal(pd.read_csv(io.StringIO(csv), comment="#"), df)
    tex = plots.table_bytes(df, "tex", "cap", PROV).decode()
    assert tex.startswith("% ctxmix provenance:") and "\\toprule" in tex
    js = json.loads(plots.table_bytes(df, "json", provenance=PROV))
    assert js["provenance"] == PROV and len(js["rows"]) == 2
    assert json.loads(plots.figure_data_bytes({"map": np.ones(2)}, "json", PROV))["provenance"] == PROV
    assert plots.table_bytes(df, "csv").decode().startswith("layer")  # none asked for, none written


def test_html_figures_carry_their_provenance():
    html = plots.figure_bytes(_fig(), "html", provenance=PROV).decode()
    assert html.startswith("<!-- ctxmix provenance:") and "- -" in html.splitlines()[0]  # no "--" inside a comment


@pytest.mark.slow
def test_an_image_and_a_clip_figure_export_as_pictures():
    """The Images page's heat over a photograph (a layout image under a heatmap) and the Speech page's heat under a
    spectrogram with word bands export as PNGs that open, at their size, with the heat drawn (many colours)."""
    from PIL import Image

    if not plots.static_export_available():
        pytest.fail("kaleido + Chromium are required for static export (apt install chromium)")
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    times = np.arange(150) * 0.02
    words = [{"text": "the", "start": 0.2, "end": 0.5}, {"text": "keys", "start": 0.5, "end": 1.1}]
    figures = {
        "image": plots.image_heat(rgb, rng.random((2, 3)), title="alti, row [CLS]"),
        "clip": plots.clip_heat(
            times, rng.random(150), spectrogram=rng.random((80, 300)), words=words, padding_from=2.0, title="alti"
        ),
    }
    for name, fig in figures.items():
        png = Image.open(io.BytesIO(plots.figure_bytes(fig, "png")))
        assert png.size[0] > 300 and png.size[1] > 200, name
        assert len(set(png.convert("RGB").getdata())) > 200, name  # the heat and the picture, not a blank page
        assert plots.figure_bytes(fig, "pdf").startswith(b"%PDF"), name
