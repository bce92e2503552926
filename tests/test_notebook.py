"""An explanation in a notebook: `show` returns the dashboard's figure for each kind, `_repr_html_`
is a compact, escaped summary, and `to_frame` is every array as one long table (tiny random models)."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput

TEXT = "the keys to the cabinet are on the table ."
SCOPES = ["Atb", "AtbFf", "AtbFfRes", "AtbFfResLn"]  # tiny BERT is post-LN
# grad_x_input first: method=None must skip it for the map kinds
METHODS = ["grad_x_input", "attention", "norm", "alti", *SCOPES]


@pytest.fixture(scope="module")
def bert(tokenizer):
    return tiny_model("bert", tokenizer)


@pytest.fixture(scope="module")
def ex(bert):
    return ctxmix.explain(bert, TEXT, METHODS, target=1, per_head=True)


@pytest.fixture(scope="module")
def pair_ex(bert):
    return ctxmix.explain(bert, ("the cat sat on the mat", "a dog ran"), ["attention", "alti"])


@pytest.fixture(scope="module")
def s2s_ex(tokenizer):
    from test_seq2seq import SRC, TGT, tiny_seq2seq

    return ctxmix.explain(tiny_seq2seq("bart", tokenizer), SRC, ["alti"], decoder_text=TGT)


def heat(tokens, values, method="x"):
    return ctxmix.Explanation(tokens=tokens, input_ids=list(range(len(tokens))), methods=[method], saliency=values)


# ---------------------------------------------------------------- HTML summary and repr


def test_summary_names_model_methods_prediction_and_tokens(ex):
    page = ex._repr_html_()
    assert "tiny-bert" in page and f"{len(ex.tokens)} tokens" in page and "2 layers" in page
    for m in METHODS:
        assert f"<code>{m}</code>" in page
    assert f"<b>{ex.prediction['label']}</b>" in page
    assert f"{ex.prediction['probabilities'][ex.prediction['label']]:.1%}" in page
    assert "position 0 ([CLS])" in page and "target 1" in page and "foil" not in page
    # a heat row per method that has a saliency, a cell per token with the exact value on hover
    assert page.count("<tr>") == len(ex.saliency)
    assert page.count("<td") == len(ex.saliency) * len(ex.tokens)
    v = ex.saliency["alti"][2]
    assert f'title="alti · keys: {v:.6g}">keys</td>' in page


def test_summary_escapes_tokens_and_colours_by_sign():
    page = heat(["a", "<script>", 'b"c'], {"x": np.array([2.0, -1.0, 0.0])})._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page and "b&quot;c" in page
    backgrounds = re.findall(r"background:(rgb\([\d,]+\))", page)
    # scaled by the row's max |value|: 1 -> full blue, -0.5 -> half red, 0 -> white
    assert backgrounds == ["rgb(33,102,172)", "rgb(216,140,149)", "rgb(255,255,255)"]


def test_summary_caps_long_inputs():
    n = 600
    page = heat([f"t{i}" for i in range(n)], {"x": np.arange(n, dtype=float)})._repr_html_()
    assert page.count("<td") == 512 and "first 512 of 600 tokens shown" in page
    assert ">t511</td>" in page and ">t512</td>" not in page


def test_repr_is_short(ex):
    r = repr(ex)
    assert r.startswith("Explanation(model='tiny-bert'") and len(r) < 400 and "array" not in r, r


def test_display_stays_lazy():
    # the dataclass module must not pull plotly in (import ctxmix and saved files load it)
    code = "import sys, ctxmix.methods.explanation; print('plotly' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


# ---------------------------------------------------------------- show


def _z(fig, k=0):
    return np.asarray(fig.data[k].z, dtype=float)


def test_show_saliency(ex):
    fig = ex.show()
    assert isinstance(fig, go.Figure) and list(fig.data[0].y) == list(ex.saliency)
    np.testing.assert_array_equal(fig.data[0].customdata[1], ex.saliency[list(ex.saliency)[1]])
    one = ex.show("alti")
    assert list(one.data[0].y) == ["alti"]
    np.testing.assert_array_equal(one.data[0].customdata[0], ex.saliency["alti"])


def test_show_maps_side_by_side(ex):
    fig = ex.show(kind="maps")  # the first method with maps (grad_x_input has none), the last layer
    assert len(fig.data) == 2 and [a.text for a in fig.layout.annotations] == [
        "attention: layer 2",
        "attention: aggregated up to layer 2",
    ]
    np.testing.assert_array_equal(_z(fig, 0), ex.layer_maps["attention"][1])
    np.testing.assert_array_equal(_z(fig, 1), ex.global_maps["attention"][1])
    fig = ex.show("alti", kind="maps", layer=1)
    np.testing.assert_array_equal(_z(fig, 1), ex.global_maps["alti"][0])


@pytest.mark.parametrize("kind, attr", [("layer", "layer_maps"), ("global", "global_maps")])
def test_show_one_map(ex, kind, attr):
    fig = ex.show("norm", kind=kind, layer=1)
    assert len(fig.data) == 1 and fig.layout.title.text.startswith("norm: ")
    np.testing.assert_array_equal(_z(fig), getattr(ex, attr)["norm"][0])
    # one colour scale for all the method's layers, as the dashboard's default
    assert fig.data[0].zmax == pytest.approx(np.abs(getattr(ex, attr)["norm"]).max())
    assert ex.show("norm", kind=kind, layer=1, zmax=0.5).data[0].zmax == 0.5


def test_show_heads(ex):
    L, H = ex.head_maps["attention"].shape[:2]
    fig = ex.show(kind="heads")
    assert len(fig.data) == L * H
    np.testing.assert_array_equal(_z(fig, H + 2), ex.head_maps["attention"][1, 2])
    fig = ex.show("norm", kind="heads", layer=1, head=3)
    assert len(fig.data) == 1 and fig.layout.title.text == "norm: layer 1, head 3"
    np.testing.assert_array_equal(_z(fig), ex.head_maps["norm"][0, 2])


def test_show_scopes(ex):
    fig = ex.show(kind="scopes", layer=1)
    assert [a.text for a in fig.layout.annotations] == SCOPES and len(fig.data) == len(SCOPES)
    for k, s in enumerate(SCOPES):
        np.testing.assert_array_equal(_z(fig, k), ex.layer_maps[s][0])


def test_show_pair(pair_ex):
    fig = pair_ex.show(kind="pair")
    names = {t.name for t in fig.data}
    assert names == {"attention A→B", "attention B→A", "alti A→B", "alti B→A"}
    assert all(len(t.y) == 2 for t in fig.data)  # two layers
    only = pair_ex.show("alti", kind="pair")
    assert {t.name for t in only.data} == {"alti A→B", "alti B→A"}


def test_show_source(s2s_ex):
    fig = s2s_ex.show(kind="source")
    S = s2s_ex.segments.count(0)
    share = ctxmix.source_contribution(s2s_ex)
    assert len(fig.data) == 3  # one line per decoder layer
    assert len(fig.data[0].y) == len(s2s_ex.tokens) - S
    np.testing.assert_array_equal(np.asarray(fig.data[-1].y), share[-1])
    with pytest.raises(BadInput, match="kind='pair' needs a pair"):
        s2s_ex.show(kind="pair")  # an encoder-decoder's two segments are source and target


@pytest.mark.parametrize(
    "args, kw, match",
    [
        (
            (),
            {"kind": "movie"},
            "unknown kind 'movie'; kinds: saliency, maps, layer, global, heads, scopes, pair, source, prediction, "
            "layer_saliency",
        ),
        (("globenc",), {}, "'globenc' is not in this explanation; it has grad_x_input, attention"),
        (("attention",), {"kind": "maps", "layer": 3}, r"layer=3 is out of range: .* layers 1 to 2"),
        (("attention",), {"kind": "layer", "layer": 0}, "out of range"),
        (("attention",), {"kind": "layer", "layer": "2"}, "integer from 1 to 2"),
        (("attention",), {"kind": "heads", "layer": 1, "head": 5}, r"head=5 is out of range: .* heads 1 to 4"),
        (("alti",), {"kind": "heads"}, "methods that do: attention, norm"),
        (("grad_x_input",), {"kind": "maps"}, "has no data for it; methods that do: attention, norm, alti, Atb"),
        (("attention",), {"kind": "scopes"}, "methods that do: Atb, AtbFf"),
        ((), {"kind": "pair"}, r"kind='pair' needs a pair: .*can show kind= saliency, maps, layer, global, heads"),
        ((), {"kind": "source"}, "needs an encoder-decoder explained with decoder_text="),
        ((), {"layer": 1}, "layer= applies to kind= maps, layer, global, heads, scopes, image, clip, not 'saliency'"),
        ((), {"kind": "maps", "head": 1}, "head= applies to kind='heads' only"),
        ((), {"kind": "heads", "layer": 1}, "give head="),
        ((), {"kind": "maps", "colour": "red"}, "maps_grid takes no 'colour'; extra keywords it takes: title"),
    ],
)
def test_bad_input_names_the_choices(ex, args, kw, match):
    with pytest.raises(BadInput, match=match):
        ex.show(*args, **kw)


# ---------------------------------------------------------------- the prediction figures


@pytest.fixture(scope="module")
def lm_ex(tokenizer):
    # a causal LM: logit and alti_logit give layer_saliency and the target's and foil's logit rows
    return ctxmix.explain(tiny_model("gpt2", tokenizer), TEXT, ["logit", "alti_logit", "alti"], foil=1000)


@pytest.fixture(scope="module")
def dx_ex(bert):
    return ctxmix.explain(bert, TEXT, ["decompx", "attention"])


def _bars(fig):
    return [np.asarray(t.y, dtype=float) for t in fig.data]


def test_show_prediction_classifier(dx_ex):
    fig = dx_ex.show(kind="prediction")
    rows = dx_ex.logit_contributions["decompx"]
    labels = list(dx_ex.prediction["probabilities"])
    assert rows.shape == (len(labels), len(dx_ex.tokens)) and len(fig.data) == len(labels)
    # a bar chart per class, titled by the class, each bar a token's signed part of that logit
    assert [a.text for a in fig.layout.annotations] == labels
    for c, y in enumerate(_bars(fig)):
        np.testing.assert_array_equal(y, rows[c])
    assert fig.layout.title.text == "decompx: signed parts of each logit"
    assert dx_ex.show(kind="prediction", title="mine").layout.title.text == "mine"


def test_show_prediction_language_model(lm_ex):
    from ctxmix.export.notebook import logit_row_labels

    for m in ("logit", "alti_logit"):
        fig = lm_ex.show(m, kind="prediction")
        rows = lm_ex.logit_contributions[m]
        assert rows.shape == (2, len(lm_ex.tokens)) and len(fig.data) == 2  # the target's row and the foil's
        for k, y in enumerate(_bars(fig)):
            np.testing.assert_array_equal(y, rows[k])
        # the explained tokens by name, as the dashboard titles them
        names = [a.text for a in fig.layout.annotations]
        assert names == logit_row_labels(lm_ex, m)
        assert all(t.startswith("logit of ") and t != "logit of " for t in names)
    assert lm_ex.show(kind="prediction").layout.title.text.startswith("logit:")  # method=None: the first


def test_show_layer_saliency(lm_ex):
    for m in ("logit", "alti_logit"):
        fig = lm_ex.show(m, kind="layer_saliency")
        M = lm_ex.layer_saliency[m]
        np.testing.assert_array_equal(_z(fig, 0), M)
        # beside it, per layer, the parts no token gets (b_O, the MLP update, ...), on the same scale
        terms = {k: v for k, v in lm_ex.logit_terms[m].items() if isinstance(v, list) and len(v) == M.shape[0]}
        assert terms and list(fig.data[1].x) == list(terms)
        np.testing.assert_array_equal(_z(fig, 1), np.stack([np.asarray(v, dtype=float) for v in terms.values()], 1))
        top = max(np.abs(M).max(), np.abs(_z(fig, 1)).max())
        assert fig.data[0].zmax == pytest.approx(top) and fig.data[0].zmid == 0
        assert fig.layout.title.text == f"{m}: per layer and token"


def test_prediction_kinds_are_listed_only_with_their_data(ex, lm_ex, dx_ex):
    from ctxmix.export.notebook import available_kinds

    assert {"prediction", "layer_saliency"} <= set(available_kinds(lm_ex))
    assert "prediction" in available_kinds(dx_ex) and "layer_saliency" not in available_kinds(dx_ex)
    assert not {"prediction", "layer_saliency"} & set(available_kinds(ex))


@pytest.mark.parametrize(
    "kind, names",
    [("prediction", ["'decompx'", "'logit'", "'alti_logit'"]), ("layer_saliency", ["'logit'", "'alti_logit'"])],
)
def test_prediction_kinds_without_data_name_the_methods(ex, kind, names):
    # a mixing-only explanation: the message names the methods that give the figure
    with pytest.raises(BadInput, match=f"kind='{kind}' needs") as e:
        ex.show(kind=kind)
    assert all(n in str(e.value) for n in names) and "can show kind= saliency, maps" in str(e.value)


def test_prediction_kinds_refuse_other_methods(lm_ex, dx_ex):
    with pytest.raises(BadInput, match="method 'alti' has no data for it; methods that do: logit, alti_logit"):
        lm_ex.show("alti", kind="layer_saliency")
    with pytest.raises(BadInput, match="kind='layer_saliency' needs"):
        dx_ex.show(kind="layer_saliency")  # DecompX gives logit rows, no per-layer table
    with pytest.raises(BadInput, match="layer= applies to kind="):
        lm_ex.show(kind="layer_saliency", layer=1)


def test_no_heads_without_per_head(pair_ex):
    with pytest.raises(BadInput, match=r"kind='heads' needs explain\(\.\.\., per_head=True\)"):
        pair_ex.show(kind="heads")


# ---------------------------------------------------------------- to_frame

COLUMNS = ["kind", "method", "layer", "head", "class", "i", "j", "value"]


def test_frame_holds_every_cell(ex):
    df = ex.to_frame()
    assert list(df.columns) == COLUMNS
    sizes = sum(a.size for d in (ex.layer_maps, ex.global_maps, ex.head_maps, ex.saliency) for a in d.values())
    assert len(df) == sizes
    assert all(str(df[c].dtype) == "Int64" for c in ("layer", "head", "class", "i", "j"))
    counts = df.groupby("kind", observed=True).size()
    assert counts["head_map"] == sum(a.size for a in ex.head_maps.values())
    assert counts["saliency"] == sum(a.size for a in ex.saliency.values())
    assert df["value"].sum() == pytest.approx(
        sum(a.sum() for d in (ex.layer_maps, ex.global_maps, ex.head_maps, ex.saliency) for a in d.values())
    )


def test_frame_values_round_trip(ex):
    df = ex.to_frame()
    row = df.query("kind == 'layer_map' and method == 'alti' and layer == 2 and i == 1 and j == 3")
    assert len(row) == 1 and row["value"].item() == ex.layer_maps["alti"][1, 1, 3]
    assert row["head"].isna().all() and row["class"].isna().all()
    row = df.query("kind == 'global_map' and method == 'Atb' and layer == 1 and i == 4 and j == 0")
    assert row["value"].item() == ex.global_maps["Atb"][0, 4, 0]
    row = df.query("kind == 'head_map' and method == 'norm' and layer == 2 and head == 3 and i == 0 and j == 5")
    assert row["value"].item() == ex.head_maps["norm"][1, 2, 0, 5]
    sal = df.query("kind == 'saliency' and method == 'grad_x_input'")
    np.testing.assert_array_equal(sal["value"], ex.saliency["grad_x_input"])
    assert list(sal["j"]) == list(range(len(ex.tokens))) and sal[["layer", "i"]].isna().all().all()


def test_frame_takes_the_prediction_fields_once_they_exist():
    n = 3
    e = heat(["a", "b", "c"], {"m": np.ones(n)}, method="m")
    e.layer_saliency = {"m": np.arange(2 * n, dtype=float).reshape(2, n)}
    e.head_saliency = {"m": np.arange(2 * 4 * n, dtype=float).reshape(2, 4, n)}
    e.logit_contributions = {"m": -np.arange(2 * n, dtype=float).reshape(2, n)}
    df = e.to_frame()
    assert set(df["kind"]) == {"saliency", "layer_saliency", "head_saliency", "logit_contribution"}
    assert len(df) == n + 2 * n + 8 * n + 2 * n
    r = df.query("kind == 'head_saliency' and layer == 2 and head == 4 and j == 1")
    assert r["value"].item() == e.head_saliency["m"][1, 3, 1] and r["class"].isna().all()
    r = df.query("kind == 'logit_contribution' and `class` == 1 and j == 2")
    assert r["value"].item() == e.logit_contributions["m"][1, 2] and r["layer"].isna().all()


def test_empty_frame_has_the_columns():
    df = ctxmix.Explanation(tokens=["a"], input_ids=[0], methods=[]).to_frame()
    assert list(df.columns) == COLUMNS and len(df) == 0
