"""Every page renders with the embedded model (Streamlit's AppTest) and shows what it must."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_results(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def _run(path: str, **params) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    if path != "app.py":
        at.switch_page(path)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def _charts(at) -> int:
    return len(at.get("plotly_chart"))


def test_explain_page_default_sentence():
    at = _run("app.py")
    assert at.title[0].value == "Explain one example"
    assert [s.value for s in at.subheader][:3] == [
        "Saliency",
        "Rank correlation between methods (this example)",
        "Token-to-token maps",
    ]
    assert _charts(at) >= 5  # saliency, layer map, aggregated map, scopes, FF-amp
    assert at.query_params["model"] in ("minilm", ["minilm"])
    # the picker offers every embedded model, gemma3 (an optional package) included
    assert at.selectbox(key="model_select").options[:4] == ["minilm", "minilm-sentiment", "smollm2", "gemma3"]


def test_explain_page_from_a_shared_link():
    """The URL's query parameters pick the model, text, methods and layer."""
    at = _run("app.py", model="minilm", text="A dog barked .", method=["alti", "norm"], map="alti", layer="2")
    assert at.text_area(key="text").value == "A dog barked ."
    assert at.multiselect(key="methods").value == ["alti", "norm"]
    assert at.slider(key="layer").value == 2


def test_explain_page_bad_model_is_a_message():
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.query_params["model"] = "./no/such/folder"
    at.run()
    assert not at.exception
    assert any("no such folder" in e.value for e in at.error)


@pytest.mark.slow
def test_change_page():
    at = _run("pages/1_Contextualization_change.py", corpus="pang_lee", n="3")
    assert _charts(at) >= 3
    assert any("FF amplifies" in s.value for s in at.subheader)


@pytest.mark.slow
def test_outliers_page():
    at = _run("pages/2_LN_gamma_vs_FF_outliers.py", corpus="pang_lee", n="3")
    assert _charts(at) >= 2
    assert len(at.dataframe) >= 1


def test_images_page_explains_a_bundled_photograph():
    """dinov2-small on scikit-image's coffee: the class token's heat over the image, then a patch's row, then
    another photograph and method."""
    at = _run("pages/5_Images.py")
    assert _charts(at) == 2  # the aggregated row and the last layer's, both over the image
    assert any("coffee" in m.value and "257 positions" in m.value for m in at.markdown)
    at.radio(key="image_row").set_value("A patch").run()
    assert not at.exception and not at.error
    assert any("r8c8" in h.value for h in at.subheader)
    at.selectbox(key="photo").set_value("chelsea").run()
    at.multiselect(key="image_methods").set_value(["value_zeroing"]).run()
    assert not at.exception and not at.error and _charts(at) == 2
    assert any("value_zeroing" in h.value for h in at.subheader)
    at.button(key="change_photographs").click().run()  # 1 - rho per layer over the three bundled photographs
    assert not at.exception and not at.error and _charts(at) == 3
    at.radio(key="set_photographs").set_value("Your own photographs").run()  # a set of the user's files instead
    assert not at.exception and _charts(at) == 2
    assert any("Upload two or more photographs" in i.value for i in at.info)


def test_images_page_offers_a_classifiers_gradients(monkeypatch):
    """A ViT classifier (tiny, random): the gradient methods are offered; one is a score per patch for the predicted
    class, with no row to choose and no layer chart."""
    from test_vision import vision_model

    from ctxmix_dashboard.ui import common

    vit = vision_model("vit-classifier")
    monkeypatch.setattr(common, "allowed_image_models", lambda: ["tiny-vit-classifier"])
    monkeypatch.setattr(common, "load_or_stop", lambda name: vit)
    at = _run("pages/5_Images.py")
    assert {"grad", "integrated_gradients"} <= set(at.multiselect(key="image_methods").options)
    at.multiselect(key="image_methods").set_value(["alti", "grad_x_input"]).run()
    at.selectbox(key="image_map").set_value("grad_x_input").run()
    assert not at.exception and not at.error
    assert _charts(at) == 1 and "image_row" not in [r.key for r in at.radio]
    assert any("scores the predicted class, LABEL_" in c.value for c in at.caption)
    assert any("the class's score per patch" in h.value for h in at.subheader)


def test_images_page_refuses_an_image_over_the_hosted_caps(monkeypatch):
    from ctxmix.service import limits

    monkeypatch.setattr(limits, "LOCAL", limits.replace(limits.LOCAL, max_image_positions=100))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.switch_page("pages/5_Images.py")
    at.run()
    assert not at.exception
    assert any("max_image_positions" in e.value for e in at.error) and _charts(at) == 0


def test_speech_page_explains_a_bundled_sentence():
    """whisper-tiny-en on a bundled flite sentence: the transcript's last row over the spectrogram with its words,
    the word shares, then the encoder's frames with two methods."""
    at = _run("pages/6_Speech.py")
    assert any("Please call Stella" in m.value for m in at.markdown)  # the transcript
    assert any("142 of 1500 positions" in m.value or "of 1500 positions hold the clip" in m.value for m in at.markdown)
    assert _charts(at) == 2 and len(at.dataframe) == 1  # aggregated row, one layer's row; the words' shares
    words = at.dataframe[0].value
    assert list(words.columns) == ["word", "start", "end", "share"] and "Stella" in " ".join(words["word"])
    at.radio(key="speech_view").set_value("The encoder's frames").run()
    assert not at.exception and not at.error and _charts(at) == 2
    assert any("0.000s" in h.value for h in at.subheader)
    at.selectbox(key="clip").set_value("keys").run()
    assert not at.exception and not at.error
    assert any("2.84 s" in m.value for m in at.markdown)


def test_speech_page_refuses_a_clip_over_the_cap(monkeypatch):
    from ctxmix.service import limits

    monkeypatch.setattr(limits, "LOCAL", limits.replace(limits.LOCAL, max_audio_seconds=2.0))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.switch_page("pages/6_Speech.py")
    at.run()
    assert not at.exception
    assert any("max_audio_seconds" in e.value for e in at.error) and _charts(at) == 0


def test_benchmarks_page_without_results(tmp_path, monkeypatch):
    """A fresh install (no results store, no run started) shows the shipped method x metric tables,
    says they were shipped (not computed here), and quotes each paper config's published numbers."""
    monkeypatch.setenv("CTXMIX_BENCH_DIR", str(tmp_path))
    at = _run("pages/3_Benchmarks.py")
    assert not at.exception
    assert at.selectbox(key="results_source").value == "shipped with ctxmix: embedded"
    assert any("Shipped results: computed by" in i.value for i in at.info)
    assert not at.warning, [w.value for w in at.warning]  # not stale
    assert at.subheader[0].value == "minilm-sentiment on pang_lee"
    table = at.dataframe[0].value
    assert {"alti", "globenc", "value_zeroing", "integrated_gradients"} <= set(table.index)
    assert {"aopc ↑", "comprehensiveness ↑", "spearman:grad_x_input ↑"} <= set(table.columns)
    assert any("Published numbers (quoted" in h.value for h in at.subheader)
    at.selectbox(key="paper_config").set_value("globenc-table1")
    at.run()
    quoted = next(d.value for d in at.dataframe if "sst2" in getattr(d.value, "columns", []))
    assert quoted.at["N", "sst2"] == 0.44  # GlobEnc Table 1, as printed
    at.selectbox(key="paper_config").set_value("decompx-table1")
    at.run()
    quoted = next(d.value for d in at.dataframe if "sst2 · aopc_mask" in getattr(d.value, "columns", []))
    assert quoted.at["DecompX", "sst2 · aopc_mask"] == 0.627 and quoted.at["ALTI", "mnli · accuracy_mask"] == 0.4589
    assert not at.exception


@pytest.mark.parametrize("with_context", [True, False])
def test_benchmarks_page_shows_shipped_context_results(tmp_path, monkeypatch, with_context):
    """The Benchmarks page's context-attribution section: a method x metric table per task from a small fake
    shipped result (each metric's direction in its header), one result per model to pick from, or, without one,
    how to make it."""
    import json
    import shutil

    import pandas as pd

    from ctxmix.benchmark import shipped

    folder = tmp_path / "shipped"
    folder.mkdir()
    for f in shipped.SHIPPED.glob("embedded*"):  # the runner's shipped results stay, so the page runs as usual
        shutil.copy(f, folder)
    if with_context:
        rows = [
            ("needles", m, k, mean, 1)
            for m, mean in (("logit", 0.5), ("contextcite", 0.7))
            for k in ("topk_drop@1", "lds", "recall@1")
        ] + [("summaries", "logit", "lds", 0.25, 1)]
        agg = pd.DataFrame(rows, columns=["task", "method", "metric", "mean", "higher_is_better"])
        agg = agg.assign(std=0.1, n=3, nan=0)
        for name, shift in (("context", 0.0), ("context-gemma3", 0.1)):
            agg.assign(mean=agg["mean"] + shift).to_csv(folder / f"{name}.aggregates.csv", index=False)
            meta = {
                "name": name,
                "kind": "context",
                "config": f"configs/{name}.yaml",
                "model": "smollm2" if shift == 0 else "gemma3",
                "ctxmix_version": "0.0.0-fake",
                "config_sha256": "0",
                "date": "2026-01-01T00:00:00+00:00",
                "command": f"python -m ctxmix bench --config configs/{name}.yaml --threads 1",
                "counts": "examples kept per task: needles 3 (1 dropped).",
            }
            (folder / f"{name}.json").write_text(json.dumps(meta))
    monkeypatch.setattr(shipped, "SHIPPED", folder)
    monkeypatch.setenv("CTXMIX_BENCH_DIR", str(tmp_path))
    at = _run("pages/3_Benchmarks.py")
    assert any(h.value == "Context attribution (configs/context*.yaml)" for h in at.subheader)
    if not with_context:
        assert any("python bench/ship_results.py --context" in i.value for i in at.info)
        assert not any("needles" in m.value for m in at.markdown)
        return
    assert [m.value for m in at.markdown if m.value in ("**needles**", "**summaries**")] == [
        "**needles**",
        "**summaries**",
    ]
    tables = [d.value for d in at.dataframe if "lds ↑" in getattr(d.value, "columns", [])]
    tables = [t.data if hasattr(t, "data") else t for t in tables]
    summary, needles = tables[0], tables[1]
    # means over tasks first: logit ran on both tasks, contextcite on needles only (so 1 task, and no verdict)
    assert summary.at["logit", "lds ↑"] == pytest.approx(0.375) and summary.at["contextcite", "tasks"] == 1
    assert summary.at["logit", "gap to contextcite ↓"] == pytest.approx(0.2)  # over needles, where both ran
    assert any(c.value.startswith("Moonshot (") for c in at.caption)
    assert list(needles.columns) == ["topk_drop@1 ↑", "lds ↑", "recall@1 ↑", "n"]
    assert needles.at["contextcite", "lds ↑"] == 0.7 and needles.at["logit", "n"] == 3
    assert any("configs/context.yaml changed" in w.value or "made by ctxmix 0.0.0-fake" in w.value for w in at.warning)
    # the other model's result, picked by name
    at.radio(key="context_results").set_value("context-gemma3")
    at.run()
    assert not at.exception
    tables = [d.value for d in at.dataframe if "lds ↑" in getattr(d.value, "columns", [])]
    needles = tables[1].data if hasattr(tables[1], "data") else tables[1]
    assert needles.at["contextcite", "lds ↑"] == pytest.approx(0.8, abs=1e-12)


def test_hosted_mode_asks_for_a_password(monkeypatch):
    monkeypatch.setenv("CTXMIX_HOSTED", "1")
    monkeypatch.setenv("CTXMIX_PASSWORD", "s3cret")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception
    assert not at.get("plotly_chart")
    import ctxmix_dashboard.ui.throttle as throttle

    now = [1000.0]
    monkeypatch.setattr(throttle.THROTTLE, "clock", lambda: now[0])
    throttle.THROTTLE.succeeded("local")
    at.text_input[0].input("wrong")
    at.button[0].click()
    at.run()
    assert any("Wrong password" in e.value for e in at.error)
    at.text_input[0].input("s3cret")  # right at once: refused, the delay is not over
    at.button[0].click()
    at.run()
    assert any("try again in" in e.value for e in at.error)
    now[0] += 1.5
    at.text_input[0].input("s3cret")
    at.button[0].click()
    at.run()
    assert at.title[0].value == "Explain one example"
    # the allow-list hides arbitrary hub ids
    assert "other (Hugging Face id or local folder)" not in at.selectbox(key="model_select").options


def test_benchmarks_page_reads_a_results_store(tmp_path, monkeypatch):
    from ctxmix.benchmark.command import run_bench
    from ctxmix.benchmark.config import validate_config

    plan = validate_config(
        {
            "name": "tiny",
            "models": ["minilm"],
            "methods": ["alti", "attention", "globenc"],
            "datasets": [{"id": "agreement", "source": "agreement", "per_phenomenon": 1, "seed": 0}],
            "metrics": ["cue_dot", "cue_ap"],
        }
    )
    run_bench(plan, db=tmp_path / "tiny.sqlite", quiet=True, threads=1)
    monkeypatch.setenv("CTXMIX_BENCH_DIR", str(tmp_path))
    at = _run("pages/3_Benchmarks.py")
    assert at.selectbox(key="results_source").value == "computed here: tiny.sqlite"
    assert at.subheader[0].value == "minilm on agreement"
    assert len(at.dataframe) >= 1 and _charts(at) >= 2
    shown = at.dataframe[0].value
    assert {"alti", "attention", "globenc"} <= set(shown.index)


@pytest.mark.parametrize(
    "params", [{"layer": "abc"}, {"layer": "99"}, {"slayer": "-5"}, {"layer": "1e9"}, {"text": "word " * 5000}]
)
def test_bad_url_parameters_fall_back_with_a_notice(params):
    """A mistyped or hostile link shows the default view and says so: no traceback, no raw error."""
    at = _run("app.py", **params)
    assert any("link" in w.value for w in at.warning), [w.value for w in at.warning]


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"n": "abc"}, {"n": "-4"}, {"n": "10000000"}, {"layer": "x"}])
def test_bad_url_parameters_on_a_corpus_page(params):
    at = _run("pages/2_LN_gamma_vs_FF_outliers.py", corpus="pang_lee", **({"n": "3"} | params))
    assert any("link" in w.value for w in at.warning)


def test_login_delays_grow_per_client_up_to_a_ceiling():
    from ctxmix_dashboard.ui.throttle import LoginThrottle

    now = [0.0]
    t = LoginThrottle(base=1.0, ceiling=8.0, clock=lambda: now[0])
    assert [t.failed("a") for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert t.wait("a") == 8 and t.wait("b") == 0  # another address is not held up
    now[0] += 8
    assert t.wait("a") == 0
    t.succeeded("a")
    assert t.failed("a") == 1  # a success starts over


def test_hosted_error_messages_hide_server_paths(monkeypatch):
    from ctxmix_dashboard.ui import common

    monkeypatch.setenv("CTXMIX_HOSTED", "1")
    assert common.public_message("cannot read /srv/ctxmix/cache/x.npz now") == "cannot read (path) now"
    monkeypatch.delenv("CTXMIX_HOSTED")
    assert "/srv/ctxmix" in common.public_message("cannot read /srv/ctxmix/cache/x.npz now")


def test_a_full_server_answers_busy(monkeypatch):
    """When the server already runs its cap of corpus jobs, a new one gets a polite notice."""
    import ctxmix_dashboard.ui.common as ui_common
    from ctxmix.service.limits import LOCAL

    monkeypatch.setattr(ui_common, "_JOBS", [LOCAL.max_concurrent_jobs])
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/2_LN_gamma_vs_FF_outliers.py")
    at.query_params["corpus"] = "pang_lee"
    at.query_params["n"] = "2"
    at.run()
    assert not at.exception
    assert any("busy" in i.value for i in at.info), [i.value for i in at.info]


UPLOADS = {  # name -> (file name, bytes)
    "over the size cap": ("big.txt", b"word " * (6 * 2**20 // 5)),
    "not UTF-8": ("bin.txt", bytes(range(256)) * 10),
    "a malformed JSON line": ("bad.jsonl", b'{"text": "fine"}\n{"text": \n'),
    "a JSON line without the field": ("nofield.jsonl", b'{"body": "x"}\n'),
    "a text that is a number": ("num.jsonl", b'{"text": 5}\n'),
    "an empty file": ("empty.txt", b""),
    "blank lines only": ("blank.txt", b"\n   \n\t\n"),
}


@pytest.mark.parametrize("case", list(UPLOADS))
def test_hostile_uploads_are_messages(case, tmp_path):
    """Uploads on a corpus page: each bad file gets one message that names the upload, never a
    traceback or the server's temporary path."""
    name, data = UPLOADS[case]
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/2_LN_gamma_vs_FF_outliers.py")
    at.query_params["corpus"] = "upload"
    at.query_params["n"] = "3"
    at.run()
    at.file_uploader[0].set_value((name, data, "text/plain"))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors, case
    import tempfile

    assert not any(tempfile.gettempdir() in e for e in errors), errors


def test_saved_explanation_page_shows_a_file_without_a_model(tmp_path):
    """A saved explanation opens on its own page with every view of the Explain page."""
    import ctxmix
    from ctxmix.export.saved import explanation_bytes

    m = ctxmix.load_model("minilm", device="cpu")
    ex = ctxmix.explain(m, "The keys to the cabinet are on the table .", ["attention", "alti", "norm"], per_head=True)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/4_Saved_explanation.py")
    at.run()
    assert any("Upload a saved explanation" in i.value for i in at.info)
    at.file_uploader[0].set_value(("keys.npz", explanation_bytes(ex), "application/octet-stream"))
    at.query_params["map"] = "norm"
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert [s.value for s in at.subheader][:3] == [
        "Saliency",
        "Rank correlation between methods (this example)",
        "Token-to-token maps",
    ]
    assert _charts(at) >= 4  # saliency, layer map, aggregated map, one head
    assert any("Made by ctxmix" in c.value for c in at.caption)
    at.selectbox(key="head").set_value(3)
    at.run()
    assert any("head 3" in str(c.proto) for c in at.get("plotly_chart"))
    at.file_uploader[0].set_value(("bad.npz", b"not a zip", "application/octet-stream"))
    at.run()
    assert not at.exception and any("not an .npz" in e.value for e in at.error)


def test_saved_pair_shows_its_cross_text_mixing():
    import ctxmix
    from ctxmix.export.saved import explanation_bytes

    m = ctxmix.load_model("minilm", device="cpu")
    ex = ctxmix.explain(m, ("A man eats .", "Someone is eating food ."), ["alti"])
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/4_Saved_explanation.py")
    at.run()
    at.file_uploader[0].set_value(("pair.npz", explanation_bytes(ex), "application/octet-stream"))
    at.run()
    assert not at.exception and any("Sentence pair" in h.value for h in at.subheader)


def test_explain_page_offers_the_saved_explanation():
    at = _run("app.py")
    assert any(b.label.startswith("Download this explanation") for b in at.get("download_button"))


def test_explain_page_per_head_toggle():
    """The toggle adds a head selector under the maps, and the view link carries it."""
    at = _run("app.py", method=["attention", "norm"], map="norm")
    assert not at.get("selectbox") or "head" not in [s.key for s in at.selectbox]
    at.toggle(key="heads").set_value(True)
    at.run()
    assert not at.exception and not at.error
    assert at.selectbox(key="head").options[:2] == ["1", "2"]
    assert at.query_params["heads"] in ("1", ["1"])
    grid = [c for c in at.get("plotly_chart") if "norm: every head" in str(c.proto)]
    assert grid and str(grid[0].proto).count("layer 6, head 12") >= 1  # the 6 x 12 grid of MiniLM's heads


def test_target_foil_and_position_pickers(tmp_path, tokenizer):  # noqa: D103
    """On a classifier the Explain page picks the target class, a foil class and the position; the
    saliency caption says what was explained and the link carries the choices."""
    import torch
    from conftest import tiny_model

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    d = tmp_path / "clf"
    m.hf.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    at = _run("app.py", model=str(d), method=["grad", "attention"], target="LABEL_1", foil="LABEL_0", position="2")
    assert at.selectbox(key="target").value == "LABEL_1" and at.selectbox(key="foil").value == "LABEL_0"
    assert at.number_input(key="position").value == 2
    assert any("explain output 1 minus output 0" in c.value for c in at.caption), [c.value for c in at.caption]
    at.selectbox(key="foil").set_value("LABEL_1")  # the foil is the target: a message, not a crash
    at.run()
    assert not at.exception and any("the foil is the target" in e.value for e in at.error)


def test_colour_scale_toggle():
    at = _run("app.py", method=["alti"], layer="1")
    heat = [c for c in at.get("plotly_chart") if "alti: layer 1" in str(c.proto)]
    assert heat and '"zmax"' in heat[0].proto.spec
    at.checkbox(key="same_scale").uncheck()
    at.run()
    assert not at.exception and at.query_params["scale"] in ("own", ["own"])


def test_cite_and_reproduce_box_gives_a_working_command():
    import shlex

    from ctxmix.cli import build_parser

    at = _run("app.py", method=["alti", "norm"], text="A dog barked .", position="1")
    codes = [c.value for c in at.code]
    cmd = next(c for c in codes if "ctxmix explain" in c)
    args = build_parser().parse_args(shlex.split(cmd)[3:])
    assert args.text == "A dog barked ." and args.method == ["alti", "norm"] and args.position == 1
    assert args.out == "explanation.npz"


def test_second_text_box_makes_a_pair():
    """A second text turns the example into a sentence pair: the A→B / B→A section appears, its
    table's shares come from the pair's explanation, and the link and the CLI call carry the pair."""
    import shlex

    from ctxmix.cli import build_parser

    at = _run("app.py", method=["alti"], text="A man eats .")
    assert not any("Sentence pair" in h.value for h in at.subheader)
    at.text_input(key="pair").set_value("Someone is eating food .")
    at.run()
    assert not at.exception
    assert any("Sentence pair" in h.value for h in at.subheader)
    assert at.query_params["pair"] in ("Someone is eating food .", ["Someone is eating food ."])
    table = at.dataframe[-1].value
    assert {"A→B other", "B→A other", "A→B special"} <= set(table.columns)
    assert ((table["A→B other"] > 0) & (table["A→B other"] < 1)).all()
    cmd = next(c.value for c in at.code if "ctxmix explain" in c.value)
    args = build_parser().parse_args(shlex.split(cmd)[3:])
    assert args.text == "A man eats ." and args.pair == "Someone is eating food ."


def test_prediction_section_decompx_on_the_classifier():
    at = _run(
        "app.py", model="minilm-sentiment", method=["decompx", "alti"], text="a moving and wonderfully acted film ."
    )
    subs = [s.value for s in at.subheader]
    assert "How the context builds the prediction" in subs
    assert any("Explained: logit(" in c.value for c in at.caption)
    # the signed per-class bars (two classes) are one of the figures, the parts table sums to the logit
    assert _charts(at) >= 4
    table = at.dataframe[-1].value
    assert "input tokens (sum)" in set(table["part"])


@pytest.mark.slow
def test_prediction_section_alti_logit_with_a_foil_on_smollm2():
    at = _run(
        "app.py",
        model="smollm2",
        method=["alti_logit", "logit"],
        text="The keys to the cabinet",
        target=" are",
        foil=" is",
    )
    assert "How the context builds the prediction" in [s.value for s in at.subheader]
    explained = next(c.value for c in at.caption if c.value.startswith("Explained:"))
    assert "logit(" in explained and " - logit(" in explained
    assert _charts(at) >= 3


def test_maps_view_shows_a_method_with_global_maps_only():
    """decompx's maps are aggregated by the method: the maps view shows them alone, without a layer map."""
    at = _run("app.py", model="minilm", method=["decompx", "attention_flow"], map="decompx", layer="3")
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("decompx: after layer 3" in t for t in titles)
    assert not any("decompx: layer 3" in t for t in titles)


@pytest.mark.slow
def test_generate_click_a_token_and_see_its_routes_on_smollm2():
    """A language model's page: Generate, the continuation as tokens, the last one explained at its row
    t - 1 with the runner-up as foil, its routes graph with a node's incoming parts; the link (cont, tok)
    reopens another generated token, and a link made for another prompt is not applied."""
    at = _run("app.py", model="smollm2", method=["alti_logit", "alti"], text="The keys to the cabinet")
    at.button(key="generate").click().run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    cont = at.query_params["cont"]
    cont = cont[0] if isinstance(cont, list) else cont
    new = [int(x) for x in cont.split(",")]
    assert len(new) == 10
    tok = int(at.query_params["tok"][0] if isinstance(at.query_params["tok"], list) else at.query_params["tok"])
    assert any(c.value.startswith(f"Explaining generated token {tok}") for c in at.caption)
    assert "Information flow routes (Ferrando & Voita 2024)" in [s.value for s in at.subheader]
    assert "How the context builds the prediction" in [s.value for s in at.subheader]
    assert any(c.value.startswith("Explained: logit(") and " - logit(" in c.value for c in at.caption)
    detail = at.dataframe[-1].value
    assert {"node", "source", "kind", "head", "importance", "weight"} <= set(detail.columns)
    assert at.selectbox(key="routes_node").value.startswith("I29_")
    # the link reopens the same continuation with another token chosen
    params = {k: at.query_params[k] for k in ("cont", "gen_for")}
    first = tok - len(new) + 1
    again = _run(
        "app.py", model="smollm2", method=["alti"], text="The keys to the cabinet", tok=str(first), tau="0.5", **params
    )
    assert any(c.value.startswith(f"Explaining generated token {first}") for c in again.caption)
    assert again.slider(key="tau").value == pytest.approx(0.10)  # a link's tau outside the slider is clamped
    other = _run("app.py", model="smollm2", method=["alti"], text="Another prompt", tok=str(first), **params)
    assert not any(c.value.startswith("Explaining generated token") for c in other.caption)


# ---------------------------------------------------------------- hosted caps before any model call

PROMPT_440 = " ".join(["the keys to the cabinet"] * 87 + ["are on the"])  # 438 words + [CLS], [SEP]


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama folder (window 512, the tokenizer's) for the hosted allow-list: no real text
    behaviour is needed, only a language model the page offers Generate for."""
    import torch
    from conftest import tiny_variant

    m = tiny_variant("llama", tokenizer, name="tiny-llama-long", max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("hosted") / "lm"
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.to(torch.float32).save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return str(d)


class _ForwardCalls:
    """Every forward call of any torch module in this process while it is open (the page's model included)."""

    def __enter__(self):
        import torch

        self.calls: list[str] = []
        self._h = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda mod, args: self.calls.append(type(mod).__name__)
        )
        return self.calls

    def __exit__(self, *exc):
        self._h.remove()


def _hosted(monkeypatch, model_dir: str, **params) -> AppTest:
    """The Explain page in hosted mode (logged in) with a 128-token cap and the tiny model allow-listed."""
    monkeypatch.setenv("CTXMIX_HOSTED", "1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.secrets["password"] = "s3cret"
    at.secrets["max_tokens"] = 128
    at.secrets["allowed_models"] = [model_dir]
    at.session_state["authenticated"] = True
    for k, v in {"model": model_dir, "routes": "0", "scopes": "0", "method": ["attention"], **params}.items():
        at.query_params[k] = v
    return at


def test_hosted_over_cap_prompt_runs_no_model(monkeypatch, tiny_lm_dir):
    """Hosted, 128-token cap: a 440-token prompt is refused with the limit named, Generate is not offered,
    and no forward pass runs (before, Generate was offered, and ran, ahead of the cap check)."""
    at = _hosted(monkeypatch, tiny_lm_dir, text=PROMPT_440)
    with _ForwardCalls() as calls:
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == [
        "The text has 440 tokens; the limit here is 128 tokens per sequence (max_tokens, special tokens "
        "included): shorten it by 312 tokens"
    ]
    assert "generate" not in [b.key for b in at.button]
    assert calls == []


def test_hosted_generate_click_on_an_over_cap_prompt_runs_no_model(monkeypatch, tiny_lm_dir):
    """The user's path: a short prompt, then a 440-token one typed in and Generate clicked in the same
    rerun: refused before any model call; Generate's new tokens count against the cap with the prompt."""
    at = _hosted(monkeypatch, tiny_lm_dir, text="the keys to the cabinet")
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    assert at.number_input(key="gen_n").max == 64  # 7 prompt tokens: room for Generate's own most, 64
    at.text_area(key="text").input(PROMPT_440)
    at.button(key="generate").click()
    with _ForwardCalls() as calls:
        at.run()
    assert any("The text has 440 tokens; the limit here is 128" in e.value for e in at.error)
    assert "cont" not in at.query_params and calls == []
    # 125 prompt tokens: 3 new ones fit, and generating them runs the model (the counter's control)
    at.text_area(key="text").input(" ".join(["word"] * 123))
    at.run()
    assert at.number_input(key="gen_n").max == 3 and "count together" in at.number_input(key="gen_n").help
    at.number_input(key="gen_n").set_value(3)
    at.button(key="generate").click()
    with _ForwardCalls() as calls:
        at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    cont = at.query_params["cont"]
    assert len((cont[0] if isinstance(cont, list) else cont).split(",")) == 3 and calls
    # a prompt that fills the cap leaves no room: Generate is not offered
    at.text_area(key="text").input(" ".join(["word"] * 126))
    with _ForwardCalls() as calls:
        at.run()
    assert "generate" not in [b.key for b in at.button]
    assert any("no room to generate" in i.value for i in at.info)
