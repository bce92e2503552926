"""Context attribution's evaluation (`ContextAttribution.evaluate`, `ctxmix.benchmark.context.metrics`), its
notebook view (`show`, `_repr_html_`, `ctxmix.export.context.html`) and its file
(`ctxmix.export.context.npz_file`, `context_load`).
Top-k drops and held-out ablations against direct, unbatched recomputation with a tiny random float64 Llama
(tests/conftest.py), LDS against scipy, recall and the HTML on hand-made cases."""

import copy
import html
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_model
from scipy import stats

import ctxmix
from ctxmix.benchmark.context import metrics as cm
from ctxmix.engine.attention import output_only
from ctxmix.errors import BadInput
from ctxmix.methods.context.attribution import ContextAttribution

PARTS = [
    "The cat sat on the mat.",
    "The code is 4817.",
    "Birds fly south in winter.",
    "Rain fell all night.",
    "The shop opens at nine.",
    "Tea is served cold.",
    "Nobody saw the fox.",
]
CONTEXT = " ".join(PARTS)
QUERY = "What is the code?"
RESPONSE = "the code is 4817"
N_CC = 8  # ContextCite's own ablations: seeds 0..7
M = 16  # held-out ablations
# Batched (padded, sorted) and unbatched float64 passes differ only by summation order: a few ulps (2^-52)
# per op over ~40 positions x 2 layers, far below this; the leave-one-out test of test_context uses the same.
TOL = 1e-9


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def ca(llama):
    ca = ctxmix.attribute_context(
        llama,
        CONTEXT,
        QUERY,
        response=RESPONSE,
        methods=["logit", "attention", "contextcite", "leave_one_out"],
        n_ablations=N_CC,
        prompt={"query_suffix": ""},  # the query as the direct recomputations below build it
        progress=False,
        seeds="official",  # ContextCite's seeds 0..N_CC-1 and held-out ones from LDS_SEED, checked below
    )
    assert ca.sources == PARTS
    ca.evaluate(llama, n_ablations=M, gold=1, progress=False)
    return ca


def _log_p(model, ctx: str, response_ids, a: int = 0, b: int | None = None) -> float:
    """log P(response tokens a..b-1 | plain prompt of ctx, the response before them), one unbatched pass
    (BERT's tokenizer: no BOS)."""
    ids = model.tokenizer(f"Context: {ctx}\n\nQuery: {QUERY}", add_special_tokens=False).input_ids
    with torch.no_grad(), output_only(model):  # the ablations' attention (eager rounds softmax to float32)
        lp = torch.log_softmax(model.hf(input_ids=torch.tensor([ids + response_ids])).logits[0].double(), -1)
    per_token = lp[len(ids) - 1 : -1].gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
    return float(per_token[a:b].sum())


def _kept(mask) -> str:
    return " ".join(p for p, k in zip(PARTS, mask) if k)


# ---------------------------------------------------------------- top-k drop


def test_topk_drop_equals_direct_recomputation(llama, ca):
    """drop@k = log P(response | context) - log P(response | context without the top k), each reduced prompt
    built here by hand and run unbatched; ranks by descending score, ties to the earlier source."""
    t = ca.evaluation["table"].set_index("method")
    r = ca.response_ids
    full = _log_p(llama, CONTEXT, r)
    assert ca.evaluation["options"]["log_prob_full"] == pytest.approx(full, abs=TOL)
    for m in ca.methods:
        s = ca.scores[m]
        order = sorted(range(len(s)), key=lambda i: (-s[i], i))
        for k in (1, 3, 5):
            removed = set(order[:k])
            want = full - _log_p(llama, _kept([i not in removed for i in range(len(PARTS))]), r)
            assert t.loc[m, f"topk_drop@{k}"] == pytest.approx(want, abs=TOL), (m, k)
    # leave-one-out's top-1 drop is its own best score, by definition
    assert t.loc["leave_one_out", "topk_drop@1"] == pytest.approx(ca.scores["leave_one_out"].max(), abs=TOL)
    assert ca.evaluation["directions"] == {c: "higher" for c in t.columns}


def test_a_span_is_evaluated_on_its_own_tokens(llama, ca):
    """span: the statement is the span's tokens (the response before them kept), ranked by scores_for."""
    c = copy.deepcopy(ca)
    span = (4, 8)  # "code"
    t = c.evaluate(llama, k=(1,), n_ablations=2, span=span, progress=False).set_index("method")
    a, b = ca.token_range(span)
    assert c.evaluation["options"]["span_tokens"] == [a, b] and b - a < len(ca.response_ids)
    r = ca.response_ids
    for m in ("logit", "contextcite"):
        top = int(cm.top_order(ca.scores_for(m, span))[0])
        want = _log_p(llama, CONTEXT, r, a, b) - _log_p(llama, _kept([i != top for i in range(len(PARTS))]), r, a, b)
        assert t.loc[m, "topk_drop@1"] == pytest.approx(want, abs=TOL), m


def test_a_span_leaves_whole_response_methods_as_nan_rows(llama, ca):
    """key_mask_ig stores the whole response's derivatives only: evaluating a part of the response gives it a row
    of NaN and a note (the page's Evaluate button with gemma3's default methods), the others their values; the
    whole response evaluates it as usual."""
    from ctxmix.methods.context.check import extend_attribution

    c = extend_attribution(copy.deepcopy(ca), llama, ["key_mask_ig"], progress=False)
    t = c.evaluate(llama, k=(1,), n_ablations=2, span=(4, 8), progress=False).set_index("method")
    assert t.loc["key_mask_ig"].isna().all() and not t.loc["logit"].isna().any()
    assert list(t.columns) == ["topk_drop@1", "lds"]
    assert "key_mask_ig scores the whole response only: no values for a part of it" in c.evaluation["notes"]
    whole = c.evaluate(llama, k=(1,), n_ablations=2, progress=False).set_index("method")
    assert not whole.loc["key_mask_ig"].isna().any()
    alone = copy.deepcopy(c)
    alone.methods = ["key_mask_ig"]
    t = alone.evaluate(llama, k=(1,), n_ablations=2, span=(4, 8), progress=False)
    assert list(t.columns) == ["method", "topk_drop@1", "lds"] and t[["topk_drop@1", "lds"]].isna().all().all()


def test_passes_are_counted_and_stored_ablations_reused(ca):
    """Every distinct mask runs once; those already in `.ablations` (leave-one-out's full context and single
    removals, ContextCite's masks) are read, not rerun: forward = distinct masks minus stored ones."""
    d = len(PARTS)
    want = {tuple([True] * d)}
    for m in ca.methods:
        order = cm.top_order(ca.scores[m])
        want |= {tuple(i not in set(order[:k]) for i in range(d)) for k in (1, 3, 5)}
    want |= {tuple(v) for v in ca.evaluation["masks"]}
    stored = {tuple(v) for ab in ca.ablations.values() for v in ab["masks"]}
    cost = ca.evaluation["cost"]
    assert cost["forward"] == len(want - stored) and cost["reused"] == len(want & stored) >= 2  # full + a top-1
    assert cost["distinct_masks"] == len(want) and cost["backward"] == 0 and cost["seconds"] > 0


# ---------------------------------------------------------------- LDS


def test_heldout_ablations_are_disjoint_seeded_and_measured(llama, ca):
    """Held-out masks are ContextCite's generator at seeds from 10,000 (disjoint from its 0..7); their stored
    per-token logit-probabilities are the model's log p - log(1 - p), checked on two masks unbatched."""
    ev = ca.evaluation
    assert ev["options"]["heldout_seeds"] == [cm.LDS_SEED, cm.LDS_SEED + M - 1]
    for j in range(M):
        want = np.random.RandomState(cm.LDS_SEED + j).choice([False, True], size=len(PARTS), p=[0.5, 0.5])
        assert (ev["masks"][j] == want).all()
    r = ca.response_ids
    for j in (0, M - 1):
        ids = llama.tokenizer(f"Context: {_kept(ev['masks'][j])}\n\nQuery: {QUERY}", add_special_tokens=False).input_ids
        with torch.no_grad(), output_only(llama):
            p = torch.softmax(llama.hf(input_ids=torch.tensor([ids + r])).logits[0].double(), -1)
        pt = p[len(ids) - 1 : -1].gather(-1, torch.tensor(r)[:, None])[:, 0].numpy()
        assert np.allclose(ev["logit_probs"][j], np.log(pt) - np.log1p(-pt), rtol=0, atol=TOL)


def test_lds_is_scipy_spearman_of_summed_kept_scores(ca):
    ev = ca.evaluation
    lp = ev["logit_probs"]
    log_P = -np.logaddexp(0, -lp).sum(1)
    measured = log_P - np.log(-np.expm1(log_P))  # logit P, written independently
    t = ev["table"].set_index("method")
    for m in ca.methods:
        pred = ev["masks"].astype(float) @ ca.scores[m]
        want = stats.spearmanr(pred, measured).statistic
        assert t.loc[m, "lds"] == pytest.approx(want, abs=1e-12), m
    # the pure function, with ties in the prediction (integer scores): scipy's average ranks
    rng = np.random.default_rng(0)
    masks, s, y = rng.random((30, 5)) < 0.5, np.array([1.0, 1.0, 2.0, 0.0, -1.0]), rng.normal(size=30)
    assert cm.lds(s, masks, y) == pytest.approx(stats.spearmanr(masks @ s, y).statistic, abs=1e-15)
    # a linear truth: its own weights have LDS 1
    w = rng.normal(size=5)
    assert cm.lds(w, masks, masks @ w) == pytest.approx(1.0)


def test_lds_nan_for_equal_or_non_finite_scores_and_said(llama, ca):
    masks, y = np.eye(4, dtype=bool), np.arange(4.0)
    assert math.isnan(cm.lds(np.full(4, 0.3), masks, y))  # every source equal: no ranking
    assert math.isnan(cm.lds(np.array([1.0, np.nan, 0, 0]), masks, y))
    assert math.isnan(cm.lds(np.arange(4.0), masks, np.ones(4)))  # constant target
    flat = copy.deepcopy(ca)
    flat.scores["attention"] = np.full(len(PARTS), 0.25)
    t = flat.evaluate(llama, k=(1, len(PARTS)), n_ablations=M, progress=False)
    row = t.set_index("method").loc["attention"]
    assert math.isnan(row["lds"]) and any("lds of attention is NaN" in n for n in t.attrs["notes"])
    assert math.isnan(row[f"topk_drop@{len(PARTS)}"]) and not math.isnan(row["topk_drop@1"])
    assert "recall@1" not in t.columns  # no gold given


# ---------------------------------------------------------------- recall and ranking


def test_recall_and_ranking_by_hand():
    s = [0.1, 0.5, 0.3, 0.5]
    assert cm.top_order(s).tolist() == [1, 3, 2, 0]  # the tie goes to the earlier source
    assert cm.recall_at(s, [3], 1) == 0.0 and cm.recall_at(s, [3], 3) == 1.0
    assert cm.recall_at(s, [0, 2], 3) == 0.5 and cm.recall_at(s, [0, 2], 4) == 1.0
    assert cm.top_order([np.nan, 1.0, -np.inf, 0.0]).tolist() == [1, 3, 2, 0]  # NaN last
    assert cm.without_top(s, 2).tolist() == [True, False, True, False]


def test_evaluate_recall_columns(ca):
    t = ca.evaluation["table"].set_index("method")
    for m in ca.methods:
        top = cm.top_order(ca.scores[m])
        assert t.loc[m, "recall@1"] == float(top[0] == 1) and t.loc[m, "recall@3"] == float(1 in top[:3])


def test_metrics_declare_their_direction():
    assert set(cm.CONTEXT_METRICS) == {"topk_drop@1", "topk_drop@3", "topk_drop@5", "lds", "recall@1", "recall@3"}
    assert all(m.higher_is_better for m in cm.CONTEXT_METRICS.values())
    assert cm.context_metric("topk_drop@10").range == (-math.inf, math.inf)
    with pytest.raises(BadInput, match="unknown context metric"):
        cm.context_metric("topk_drop@0")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 0}, "k must be"),
        ({"n_ablations": 1}, "n_ablations must be a whole number from 2 to 1024"),
        ({"gold": 7}, "gold must be a source index from 0 to 6"),
        ({"gold": []}, "gold must be"),
        ({"seed": 4}, "overlap ContextCite's 0..7"),
        ({"span": (0, 99)}, "outside the response"),
    ],
)
def test_bad_input_refused_before_any_pass(llama, ca, monkeypatch, kwargs, match):
    from ctxmix.methods.context import ablation as context_ablation

    monkeypatch.setattr(context_ablation, "response_logit_probs", lambda *a, **k: pytest.fail("a pass ran"))
    c = copy.deepcopy(ca)
    with pytest.raises(BadInput, match=match):
        c.evaluate(llama, **{"n_ablations": M, "progress": False, **kwargs})
    assert c.evaluation["options"] == ca.evaluation["options"]


def test_evaluate_refuses_another_model(tokenizer, ca):
    other = tiny_model("gpt2", tokenizer)
    with pytest.raises(BadInput, match="made with tiny-llama"):
        ca.evaluate(other, n_ablations=M, progress=False)


# ---------------------------------------------------------------- file


def test_save_load_keeps_the_evaluation(tmp_path, ca):
    p = ca.save(tmp_path / "ca")
    for back in (ctxmix.load_context_attribution(p), ctxmix.load_context_attribution(p.read_bytes(), name="x")):
        pd.testing.assert_frame_equal(back.evaluation["table"], ca.evaluation["table"])
        assert (back.evaluation["masks"] == ca.evaluation["masks"]).all()
        assert np.array_equal(back.evaluation["logit_probs"], ca.evaluation["logit_probs"])
        assert back.evaluation["cost"] == ca.evaluation["cost"] and back.options == ca.options
        assert np.array_equal(back.scores["contextcite"], ca.scores["contextcite"])
    bare = copy.deepcopy(ca)
    bare.evaluation = {}
    assert ctxmix.load_context_attribution(bare.save(tmp_path / "bare.npz")).evaluation == {}
    # a version-1 file (before the evaluation) still opens; an upload is checked against the archive limits
    import dataclasses
    import json

    from ctxmix.export.context.npz_file import _arrays
    from ctxmix.service.limits import LOCAL

    arrays = dict(_arrays(bare))
    arrays["meta"] = np.array(json.dumps({**json.loads(str(arrays["meta"])), "version": 1}))
    np.savez_compressed(tmp_path / "v1.npz", **arrays)
    assert ctxmix.load_context_attribution(tmp_path / "v1.npz").sources == PARTS
    data = p.read_bytes()
    assert ctxmix.load_context_attribution(data, limits=LOCAL).sources == PARTS
    tiny = dataclasses.replace(LOCAL, max_archive_mb=len(data) / 2 / 2**20)
    with pytest.raises(BadInput):
        ctxmix.load_context_attribution(data, limits=tiny, name="up.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="could not be read as a saved context attribution"):
        ctxmix.load_context_attribution(tmp_path / "junk.npz")


# ---------------------------------------------------------------- HTML


def _hand_ca(context, spans, scores: dict) -> ContextAttribution:
    return ContextAttribution(
        model_name="tiny <b>model</b>",
        context=context,
        query=None,
        sources=[context[a:b] for a, b in spans],
        source_spans=spans,
        source_tokens=[[i] for i in range(len(spans))],
        prompt_ids=list(range(len(spans))),
        labels=np.arange(len(spans)),
        response="ok & done",
        response_ids=[1, 2],
        response_offsets=np.array([[0, 2], [2, 9]]),
        methods=list(scores),
        scores={m: np.asarray(v, dtype=float) for m, v in scores.items()},
    )


SPAN_RE = re.compile(r'<span data-source="(\d+)" data-score="([^"]+)" [^>]*style="background:rgb\((\d+),(\d+),(\d+)\)')


def test_html_escapes_every_source_and_shades_by_order_and_sign():
    context = 'Alpha & "beta". <script>alert(1)</script> here. Plain one. Zero one. Worst <i>one</i>.'
    parts = ['Alpha & "beta".', "<script>alert(1)</script> here.", "Plain one.", "Zero one.", "Worst <i>one</i>."]
    spans, cur = [], 0
    for p in parts:
        a = context.index(p, cur)
        spans.append((a, a + len(p)))
        cur = a + len(p)
    scores = [0.5, 2.0, 1.0, 0.0, -1.5]
    ca = _hand_ca(context, spans, {"logit": scores, "attention": [0.1, 0.4, 0.2, 0.0, 0.3]})
    out = str(ca.show("logit"))
    assert "<script>" not in out and "<i>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    for p in parts:
        assert html.escape(p, quote=True) in out
    cells = {int(i): (float(v), tuple(map(int, rgb))) for i, v, *rgb in SPAN_RE.findall(out)}
    assert sorted(cells) == list(range(5)) and [cells[i][0] for i in range(5)] == scores
    assert cells[3][1] == (255, 255, 255)  # zero: white
    assert cells[4][1][0] > cells[4][1][2]  # negative: red
    pos = sorted((i for i in range(5) if scores[i] > 0), key=lambda i: scores[i])
    assert all(cells[i][1][2] > cells[i][1][0] for i in pos)  # positive: blue
    reds = [cells[i][1][0] for i in pos]
    assert reds == sorted(reds, reverse=True) and len(set(reds)) == len(reds)  # darker as the score grows
    assert cells[1][1] == (33, 102, 172)  # the largest |score| sits at the scale's end
    assert "blue raises the response, red lowers it" in out
    both = str(ca.show())
    assert both.count('class="ctxmix-context-method"') == 2 and "darker blue: higher score" in both
    summary = ca._repr_html_()
    assert "tiny &lt;b&gt;model&lt;/b&gt;" in summary and "<script>" not in summary and "ok &amp; done" in summary
    with pytest.raises(BadInput, match="was not computed"):
        ca.show("contextcite")


def test_repr_html_shows_the_evaluation(ca):
    s = ca._repr_html_()
    assert "evaluation" in s and "topk_drop@1" in s and "lds" in s
    assert ca.show()._repr_html_() == str(ca.show())


def test_compat_is_evaluated_with_the_same_counterfactual_and_no_reuse(tokenizer):
    """A compat=True attribution (official rebuild for its own fit) is evaluated with ctxmix's rule, so none of
    its ablations can be reused: every pass is rerun, and the measurements equal the default attribution's,
    which reads its ContextCite rows where the held-out masks repeat them (3 sources: 8 possible masks)."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = (
        "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP]{% endfor %}"
        "{% if add_generation_prompt %} assistant :{% endif %}"
    )
    model = tiny_model("llama", chat)
    context = " ".join(PARTS[:3])
    kw = dict(response=RESPONSE, methods=["contextcite"], n_ablations=N_CC, progress=False, seeds="official")
    out = {}
    for compat in (True, False):
        c = ctxmix.attribute_context(model, context, QUERY, compat=compat, **kw)
        assert c.prompt_ids == ctxmix.attribute_context(model, context, QUERY, **kw).prompt_ids  # same ids here
        c.evaluate(model, k=(1,), n_ablations=M, progress=False)
        out[compat] = c.evaluation
    assert out[True]["cost"]["reused"] == 0 and out[False]["cost"]["reused"] >= 1
    assert (out[True]["masks"] == out[False]["masks"]).all()
    assert np.allclose(out[True]["logit_probs"], out[False]["logit_probs"], rtol=0, atol=TOL)


# ---------------------------------------------------------------- seeds


def test_each_example_gets_its_own_masks_and_compat_keeps_the_official_seeds(llama, tmp_path):
    """ContextCite's masks and evaluate's held-out masks are seeded per example by default: two contexts with the
    same number of sources get different masks (they got the same, seeds 0..n-1 and 10,000.. for every example),
    the same context the same ones; the first seed is a SHA-256 of the caller's seed and the texts (pinned here:
    not Python's salted hash()), recorded in `options["mask_seed"]`, so a saved attribution evaluates on the same
    held-out masks. compat=True (and seeds="official") keep the official seed + i."""
    from ctxmix.methods.context import ablation as cab

    other = CONTEXT.replace("Tea is served cold.", "Milk is served warm.")
    kw = dict(response=RESPONSE, methods=["contextcite"], n_ablations=N_CC, progress=False, prompt={"query_suffix": ""})
    a, again, b = (ctxmix.attribute_context(llama, c, QUERY, **kw) for c in (CONTEXT, CONTEXT, other))
    assert a.n_sources == b.n_sources == len(PARTS)
    masks = [x.ablations["contextcite"]["masks"] for x in (a, again, b)]
    assert (masks[0] == masks[1]).all() and not (masks[0] == masks[2]).all()
    assert a.options["seeds"] == "example" and a.options["mask_seed"] == cab.example_seed(0, CONTEXT, QUERY)
    assert cab.example_seed(0, CONTEXT, QUERY) == 633_461_482  # SHA-256: the same on any machine and run
    assert cab.example_seed(1, CONTEXT, QUERY) != a.options["mask_seed"]  # the caller's seed still draws others
    assert (masks[0] == cab.contextcite_masks(N_CC, len(PARTS), a.options["mask_seed"])).all()
    for x in (a, b):
        x.evaluate(llama, k=(1,), n_ablations=M, progress=False)
    assert not (a.evaluation["masks"] == b.evaluation["masks"]).all()
    first = a.options["mask_seed"] + cm.LDS_SEED
    assert a.evaluation["options"]["heldout_seeds"] == [first, first + M - 1]
    a.save(tmp_path / "a.npz")
    saved = ctxmix.load_context_attribution(tmp_path / "a.npz")
    saved.evaluation = {}
    saved.evaluate(llama, k=(1,), n_ablations=M, progress=False)
    assert (saved.evaluation["masks"] == a.evaluation["masks"]).all()
    pd.testing.assert_frame_equal(saved.evaluation["table"], a.evaluation["table"])
    official = cab.contextcite_masks(N_CC, len(PARTS), 0)
    for x in (
        ctxmix.attribute_context(llama, CONTEXT, QUERY, compat=True, **kw),
        ctxmix.attribute_context(llama, other, QUERY, seeds="official", **kw),
    ):
        assert x.options["seeds"] == "official" and x.options["mask_seed"] == 0
        assert (x.ablations["contextcite"]["masks"] == official).all()
    with pytest.raises(BadInput, match="seeds must be one of"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, seeds="python", **kw)
