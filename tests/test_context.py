"""Context attribution (`ctxmix.attribute_context`): sources, prompt, ContextCite against an independent
transcription of the official algorithm, leave-one-out against direct recomputation, the one-pass `logit`
against `explain`, and every refusal. Tiny random float64 models of the real HF classes (tests/conftest.py)."""

import copy

import numpy as np
import pytest
import torch
from conftest import exact_eager_twin, tiny_model

import ctxmix
from ctxmix.engine.attention import output_only
from ctxmix.errors import BadInput
from ctxmix.methods.context import ablation as cab
from ctxmix.methods.context.sources import TEMPLATE, Sources, make_sources, paragraph_spans, sentence_spans

CONTEXT = "The cat sat on the mat. The code is 4817. Birds fly south in winter."
QUERY = "What is the code?"
RESPONSE = "the code is 4817"

CHAT = (
    "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP]{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = CHAT
    return t


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def chat_llama(chat_tokenizer):
    return tiny_model("llama", chat_tokenizer)


# ---------------------------------------------------------------- sources


def _texts(text):
    return [text[a:b] for a, b in sentence_spans(text)]


def test_sentence_splitter_hard_cases():
    """Abbreviations, decimals and initials do not end a sentence; quotes stay with their sentence; a newline
    always ends one (ContextCite splits per line); parts without a letter are not sources."""
    assert _texts("Dr. Smith paid $3.50 for it. He left at 5 p.m. on Monday.") == [
        "Dr. Smith paid $3.50 for it.",
        "He left at 5 p.m. on Monday.",
    ]
    assert _texts("The U.S. economy grew 2.5% in 2023. Prices rose.") == [
        "The U.S. economy grew 2.5% in 2023.",
        "Prices rose.",
    ]
    assert _texts('He said "Stop." Then he left.') == ['He said "Stop."', "Then he left."]
    assert _texts("e.g. this is fine. Mr. Brown, i.e. the boss, came.") == [
        "e.g. this is fine.",
        "Mr. Brown, i.e. the boss, came.",
    ]
    assert _texts("Title line\nFirst one here.  Second one!\n\n1.\n----\nLast?") == [
        "Title line",
        "First one here.",
        "Second one!",
        "Last?",
    ]
    text = "  Lead.\r\nNext line.\n"
    for a, b in sentence_spans(text):  # spans index the original string, stripped
        assert text[a:b] == text[a:b].strip() and text[a:b]


def test_paragraphs_documents_and_explicit_spans():
    text = "First para. Still first.\n\n  Second para.\n \nThird."
    assert [text[a:b] for a, b in paragraph_spans(text)] == ["First para. Still first.", "Second para.", "Third."]
    s = make_sources(["Doc one. Two.", " Doc two "], "document")
    assert s.text == "Doc one. Two.\n\n Doc two " and s.texts == ["Doc one. Two.", "Doc two"]
    s = make_sources("abc def ghi", [(0, 3), (8, 11)])
    assert s.texts == ["abc", "ghi"] and s.kind == "spans"


def test_rebuild_rules():
    """ContextCite's rebuild: each kept part keeps its own separator, the first kept loses its own; the default
    keeps the text before the first source and after the last so that keeping everything gives the context."""
    s = Sources(text="\nA. B.\n\nC. tail", spans=[(1, 3), (4, 6), (8, 10)], kind="spans")
    assert s.separators == ["\n", " ", "\n\n"] and s.trail == " tail"
    assert s.rebuild([1, 0, 1], "official") == "A.\n\nC."
    assert s.rebuild([0, 1, 1], "official") == "B.\n\nC."
    assert s.rebuild([1, 1, 1], "official") == "A. B.\n\nC."  # the official rule drops lead and tail
    assert s.rebuild([1, 1, 1]) == s.text
    assert s.rebuild([0, 1, 1]) == "\nB.\n\nC. tail"
    assert s.rebuild([0, 0, 0]) == "\n tail"


def test_masks_match_the_official_seeds():
    """The official `_create_mask`'s vectors (legacy RandomState, seeds 0..3, d = 10), and the prefix property
    across d."""
    m = cab.contextcite_masks(4, 10)
    rows = ["".join("1" if v else "0" for v in r) for r in m]
    assert rows == ["1111010110", "0100000001", "0010000100", "1101110000"]
    assert (cab.contextcite_masks(4, 20)[:, :10] == m).all()


def test_aggregation_is_stable_where_the_official_overflows():
    """ContextCite's target logit P from the per-token logit-probs; at log P = -2e-9 the official float32
    formula gives +inf, the default stays finite and equals -log(-log P) to first order."""
    lp = np.array([[-1.0, 0.5, 2.0]])
    P = np.prod(1 / (1 + np.exp(-lp)))
    assert cab.aggregate(lp)[0] == pytest.approx(np.log(P / (1 - P)), rel=1e-12)
    confident = np.array([[np.log(np.expm1(2e-9) ** -1)]])  # sigmoid(l) = exp(-2e-9)
    assert np.isinf(cab.aggregate(confident, compat=True)[0])
    y = cab.aggregate(confident)[0]
    assert np.isfinite(y) and y == pytest.approx(-np.log(2e-9), rel=1e-6)
    with pytest.raises(BadInput, match="infinite"):
        cab.lasso_fit(np.eye(2, dtype=bool), np.array([np.inf, 1.0]), 1, compat=True)


def test_lasso_near_zero_alpha_is_least_squares_and_constant_columns_get_zero():
    """With alpha -> 0 and a full-rank design the rescaled weights are OLS on the raw masks."""
    rng = np.random.RandomState(0)
    X = rng.rand(40, 3) < 0.5
    X = np.concatenate([X, np.ones((40, 1), bool)], 1)
    y = X[:, :3] @ np.array([1.0, -2.0, 0.5]) + 3.0
    w, b = cab.lasso_fit(X, y, 4, alpha=1e-9)
    # sklearn stops its coordinate descent at a duality gap of tol = 1e-4 (relative to ||y||^2): ~1e-5 here
    assert np.allclose(w, [1.0, -2.0, 0.5, 0.0], atol=1e-4) and b == pytest.approx(3.0, abs=1e-4)


# ---------------------------------------------------------------- prompt


def test_prompt_labels_sources_template_and_query(chat_llama):
    from ctxmix.methods.context.prompt import PromptBuilder

    src = make_sources(CONTEXT)
    pr = PromptBuilder(chat_llama, QUERY).encode(src)
    toks = chat_llama.tokens(pr.ids)
    assert toks[0] == "[CLS]" and toks[1] != "[CLS]"  # one BOS, from the template's text
    for i, text in enumerate(src.texts):
        words = [t for t, lab in zip(toks, pr.labels) if lab == i]
        assert chat_llama.tokenizer.convert_tokens_to_string(words) == text.lower()
    assert chat_llama.tokenizer.convert_tokens_to_string([t for t, lab in zip(toks, pr.labels) if lab == -2]) == (
        QUERY.lower()
    )
    assert set(pr.labels[:3]) == {TEMPLATE} and pr.labels[-1] == TEMPLATE


def test_special_token_text_is_kept_as_text(chat_llama):
    """A context that spells [SEP] is read as text (not id 102) by default, and refused by compat=True."""
    from ctxmix.methods.context.prompt import PromptBuilder

    src = make_sources("The [SEP] marker is text. Another sentence here.")
    b = PromptBuilder(chat_llama, QUERY)
    ids = b.encode(src).ids
    sep = chat_llama.tokenizer.sep_token_id
    assert ids.count(sep) == 1  # the template's own [SEP] only
    with pytest.raises(BadInput, match=r"\[SEP\]"):
        ctxmix.attribute_context(chat_llama, src.text, QUERY, response=RESPONSE, compat=True, methods=["logit"])


# ---------------------------------------------------------------- ContextCite


def _official_contextcite(model, parts, query, response_text, n_ablations):
    """An independent transcription of MadryLab/context-cite (0e646f5) for given sentence parts: prompt,
    re-tokenised response, masks, logit-probs, aggregation and LASSO."""
    from sklearn.linear_model import Lasso
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    tok, context = model.tokenizer, " ".join(parts)
    seps, cur = [], 0
    for part in parts:  # split_text: each part carries the text before it
        end = context.find(part, cur)
        seps.append(context[cur:end])
        cur = end + len(part)

    def prompt_ids(mask):
        kept = [(s, p) for s, p, m in zip(seps, parts, mask) if m]
        ctx = "".join(p if k == 0 else s + p for k, (s, p) in enumerate(kept))
        chat = tok.apply_chat_template(
            [{"role": "user", "content": f"Context: {ctx}\n\nQuery: {query}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return tok.encode(chat, add_special_tokens=False), chat

    ids, chat = prompt_ids(np.ones(len(parts), bool))
    response_ids = tok(chat + response_text, add_special_tokens=False).input_ids[len(ids) :]
    T = len(response_ids)
    masks = np.zeros((n_ablations, len(parts)), dtype=bool)
    lps = torch.zeros((n_ablations, T))  # float32, as the official buffer
    for seed in range(n_ablations):
        masks[seed] = np.random.RandomState(seed).choice([False, True], size=len(parts), p=[0.5, 0.5])
        x = torch.tensor([prompt_ids(masks[seed])[0] + response_ids])
        with torch.no_grad(), output_only(model):  # the official code runs the model as loaded: SDPA by default
            logits = model.hf(input_ids=x).logits[:, -(T + 1) : -1][0]
        labels = torch.tensor(response_ids)
        correct = logits.gather(-1, labels[:, None])[:, 0]
        other = logits.clone().scatter_(-1, labels[:, None], -torch.inf).logsumexp(-1)
        lps[seed] = correct - other
    lps = lps.numpy().astype(np.float32)
    t = torch.tensor(lps)
    log_p = torch.nn.functional.logsigmoid(t).sum(dim=1)
    y = (log_p - torch.log1p(-torch.exp(log_p))).numpy()
    X, Y = masks.astype(np.float32), y / T
    scaler, lasso = StandardScaler(), Lasso(alpha=0.01, random_state=0, fit_intercept=True)
    make_pipeline(scaler, lasso).fit(X, Y)
    return {
        "weights": lasso.coef_ / scaler.scale_ * T,
        "masks": masks,
        "logit_probs": lps,
        "response_ids": response_ids,
        "prompt_ids": ids,
    }


N_ABL = 8


@pytest.fixture(scope="module")
def cc_pair(chat_llama):
    kw = dict(response=RESPONSE, methods=["contextcite"], n_ablations=N_ABL, progress=False)
    compat = ctxmix.attribute_context(chat_llama, CONTEXT, QUERY, compat=True, **kw)
    # the official seeds, as compat's: the default's per-example seeds draw other masks by design
    default = ctxmix.attribute_context(chat_llama, CONTEXT, QUERY, seeds="official", **kw)
    return compat, default


def test_contextcite_compat_equals_the_official_algorithm(chat_llama, cc_pair):
    compat, _ = cc_pair
    ref = _official_contextcite(chat_llama, compat.sources, QUERY, RESPONSE, N_ABL)
    assert compat.prompt_ids == ref["prompt_ids"] and compat.response_ids == ref["response_ids"]
    ab = compat.ablations["contextcite"]
    assert (ab["masks"] == ref["masks"]).all()
    # both from the same float64 model, the reference's rounded to float32 as the official buffer is
    assert np.allclose(ab["logit_probs"].astype(np.float32), ref["logit_probs"], rtol=0, atol=0)
    assert np.abs(compat.scores["contextcite"] - ref["weights"]).max() < 1e-6
    assert np.ptp(ref["weights"]) > 0.01  # the fit found something to compare


def test_contextcite_default_differs_only_in_the_aggregation(cc_pair):
    """Same masks, prompts, response ids and per-token logit-probs (no text outside the sources, a given response:
    neither the kept outside text nor the response ids can differ); only the aggregation's precision and stability
    differ, so refitting compat's ablations in the default mode gives the default's scores, and the two fits agree
    to the float32 rounding of the targets and the LASSO's own tolerance (tol=1e-4 on the duality gap)."""
    compat, default = cc_pair
    assert default.prompt_ids == compat.prompt_ids and default.response_ids == compat.response_ids
    a, b = compat.ablations["contextcite"], default.ablations["contextcite"]
    assert (a["masks"] == b["masks"]).all() and np.array_equal(a["logit_probs"], b["logit_probs"])
    w, _ = cab.contextcite_scores(a, 0, len(default.response_ids), compat=False)
    assert np.array_equal(w, default.scores["contextcite"])
    scale = np.abs(default.scores["contextcite"]).max()
    assert np.abs(default.scores["contextcite"] - compat.scores["contextcite"]).max() < 1e-2 * scale


def test_contextcite_compat_differs_from_default_around_the_sources(chat_llama):
    """Text outside the sources: with text before the first source, compat's rebuild drops it (even with every
    source kept), the default keeps it; the unablated prompts then differ."""
    ctx = "1.\n" + CONTEXT + "\n2."  # "1." and "2." hold no letter: not sources, text around them
    kw = dict(response=RESPONSE, methods=["leave_one_out"], progress=False)
    c = ctxmix.attribute_context(chat_llama, ctx, QUERY, compat=True, **kw)
    d = ctxmix.attribute_context(chat_llama, ctx, QUERY, **kw)
    assert any("drops the text" in w for w in c.warnings)
    lp_c, lp_d = c.ablations["leave_one_out"]["logit_probs"][0], d.ablations["leave_one_out"]["logit_probs"][0]
    assert not np.allclose(lp_c, lp_d)


def test_compat_shows_the_model_only_the_official_rebuild(chat_llama):
    """compat=True with text outside the sources (a list number before, a footer after): the unablated prompt,
    the generated response and the ablations are those of the official package, which builds every prompt
    from the sources only (the reference gets the sources, never the text around them)."""
    ctx = "1.\n" + CONTEXT + "\n2."
    c = ctxmix.attribute_context(
        chat_llama,
        ctx,
        QUERY,
        response=RESPONSE,
        compat=True,
        methods=["contextcite"],
        n_ablations=N_ABL,
        progress=False,
    )
    ref = _official_contextcite(chat_llama, c.sources, QUERY, RESPONSE, N_ABL)
    assert c.prompt_ids == ref["prompt_ids"] and c.response_ids == ref["response_ids"]
    lp = c.ablations["contextcite"]["logit_probs"]
    assert np.array_equal(lp.astype(np.float32), ref["logit_probs"])
    assert c.context == ctx and c.sources == make_sources(ctx).texts  # spans still index the given context
    gen = ctxmix.attribute_context(
        chat_llama, ctx, QUERY, compat=True, methods=["logit"], max_new_tokens=3, progress=False
    )
    g = ctxmix.generate(chat_llama, input_ids=ref["prompt_ids"], max_new_tokens=3, greedy=True)
    assert gen.prompt_ids == ref["prompt_ids"]
    assert gen.response == chat_llama.tokenizer.decode(list(g.new_ids))


def test_logit_prob_is_log_p_minus_log_1_minus_p(chat_llama, cc_pair):
    """ContextCite's per-token logit-probability for every ablation: the stored value equals log p - log(1 - p)
    from the model's own softmax over an unbatched, unpadded pass (float64; p ~ 1e-5 here, so log1p(-p) is exact to
    rounding)."""
    from ctxmix.methods.context.prompt import PromptBuilder

    _, ca = cc_pair
    src = make_sources(CONTEXT)
    b = PromptBuilder(chat_llama, QUERY)
    ab = ca.ablations["contextcite"]
    T = len(ca.response_ids)
    for mask, lp in zip(ab["masks"], ab["logit_probs"]):
        x = torch.tensor([b.ids(src.rebuild(mask)) + ca.response_ids])
        with torch.no_grad(), output_only(chat_llama):  # the ablations' attention (eager rounds softmax to float32)
            p = torch.softmax(chat_llama.hf(input_ids=x).logits[0, -(T + 1) : -1].double(), -1)
        pr = p[torch.arange(T), torch.tensor(ca.response_ids)].numpy()
        assert np.allclose(lp, np.log(pr) - np.log1p(-pr), rtol=1e-10, atol=1e-10)


def test_refitting_the_official_lasso_on_ablations_gives_the_scores(cc_pair):
    from sklearn.linear_model import Lasso
    from sklearn.preprocessing import StandardScaler

    _, ca = cc_pair
    ab, T = ca.ablations["contextcite"], len(ca.response_ids)
    log_p = -np.logaddexp(0, -ab["logit_probs"]).sum(1)
    y = log_p - np.log(-np.expm1(log_p))
    sc = StandardScaler().fit(ab["masks"].astype(float))
    lasso = Lasso(alpha=0.01, random_state=0).fit(sc.transform(ab["masks"].astype(float)), y / T)
    assert np.allclose(lasso.coef_ / sc.scale_ * T, ca.scores["contextcite"], rtol=0, atol=1e-12)


def _reference_span_scores(masks, logit_probs, a: int, b: int, alpha: float = 0.01) -> np.ndarray:
    """ContextCite's span scores transcribed in float64 from the paper and the official code, without ctxmix:
    y = logit P(span) with log P(span) = sum_{a <= t < b} log sigmoid(l_t) and log(1 - P) = log(-expm1(log P));
    the masks standardised by hand (mean, population std), scikit-learn's Lasso(alpha, intercept,
    random_state=0) fitted to y / T (T = b - a tokens), its coefficients divided by the std and times T."""
    from sklearn.linear_model import Lasso

    lp = -np.logaddexp(0.0, -np.asarray(logit_probs, dtype=np.float64)[:, a:b]).sum(1)
    y = lp - np.log(-np.expm1(lp))
    X = np.asarray(masks, dtype=np.float64)
    mean, std = X.mean(0), X.std(0)
    fit = Lasso(alpha=alpha, fit_intercept=True, random_state=0).fit((X - mean) / std, y / (b - a))
    return fit.coef_ / std * (b - a)


def test_span_scores_reuse_the_ablations(cc_pair):
    """A span's ContextCite scores refit the stored ablations on the span's tokens only, against the independent
    float64 transcription above (it was checked against `lasso_fit`, which `scores_for` calls). Shown to fail
    under two mutations of ctxmix.methods.context.ablation: `contextcite_scores` reading the logit-probabilities
    from token a to the end (`[:, a:]`) instead of the span's (`[:, a:b]`), and `lasso_fit` returning the
    weights without the factor T (`w * n_tokens` -> `w`). Tolerance: the two fits see inputs equal to float64
    rounding and run the same coordinate descent, 1e-9 of the largest weight."""
    _, ca = cc_pair
    ab = ca.ablations["contextcite"]
    for span in [(4, 8), (4, 16), None]:  # "code", "code is 4817", the whole response
        a, b = ca.token_range(span)
        want = _reference_span_scores(ab["masks"], ab["logit_probs"], a, b)
        got = ca.scores_for("contextcite", span)
        assert np.ptp(want) > 0.01, span  # the fit found something to compare
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max(), err_msg=str(span))
    assert ca.token_range((4, 8)) == (1, 2) and ca.token_range((4, 16))[1] - ca.token_range((4, 16))[0] >= 2
    for bad in [(0, 99), (5, 5), (-1, 3)]:
        with pytest.raises(BadInput, match="outside the response"):
            ca.scores_for("contextcite", bad)


# ---------------------------------------------------------------- leave-one-out


def test_leave_one_out_equals_direct_recomputation(llama):
    """S + 1 passes: each score is log P(response | context) - log P(response | context without source i),
    each recomputed here from a hand-built plain prompt, unbatched."""
    ca = ctxmix.attribute_context(
        llama, CONTEXT, QUERY, response=RESPONSE, methods=["leave_one_out"], prompt={"query_suffix": ""}, progress=False
    )  # the query as is (a model without a chat template gets an answer cue by default)
    tok, parts = llama.tokenizer, ca.sources
    r = ca.response_ids

    def log_p(ctx):
        ids = tok(f"Context: {ctx}\n\nQuery: {QUERY}", add_special_tokens=False).input_ids  # no BOS in BERT's
        with torch.no_grad(), output_only(llama):  # the passes' attention (eager rounds softmax to float32)
            lp = torch.log_softmax(llama.hf(input_ids=torch.tensor([ids + r])).logits[0].double(), -1)
        return float(lp[len(ids) - 1 : -1].gather(-1, torch.tensor(r)[:, None]).sum())

    full = log_p(CONTEXT)
    direct = [full - log_p(" ".join(p for k, p in enumerate(parts) if k != i)) for i in range(len(parts))]
    assert np.allclose(ca.scores["leave_one_out"], direct, rtol=1e-9, atol=1e-9)
    assert ca.cost["leave_one_out"]["forward"] == len(parts) + 1


# ---------------------------------------------------------------- one pass


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("target", ["logit", "log_prob"])
def test_logit_scores_are_explains_contributions(tokenizer, family, target):
    """A span's source scores equal the sum of explain's `logit` per-token contributions at each target row
    towards the same target (explain's target_kind), restricted to the source's tokens. Float64: 1e-9
    relative."""
    m = tiny_model(family, tokenizer)
    ca = ctxmix.attribute_context(
        m, CONTEXT, QUERY, response=RESPONSE, methods=["logit"], target_kind=target, progress=False
    )
    ids = ca.prompt_ids + ca.response_ids
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    with torch.no_grad():
        logits = m.hf(input_ids=torch.tensor([ids])).logits[0].double()
    want = np.zeros((T, len(ca.sources)))
    for t in range(T):
        q = P - 1 + t
        kw = dict(input_ids=ids[: q + 1], position=q, target=ids[q + 1], target_kind=target)
        row = ctxmix.explain(m, None, ["logit"], **kw).saliency["logit"]
        want[t] = [row[toks].sum() for toks in ca.source_tokens]
    assert np.allclose(ca.scores["logit"], want.sum(0), rtol=1e-9, atol=1e-9 * np.abs(want).max())
    a, b = ca.token_range((4, 16))
    assert np.allclose(ca.scores_for("logit", (4, 16)), want[a:b].sum(0), rtol=1e-9, atol=1e-9 * np.abs(want).max())
    # sources + template + query + separators + response positions + unattributed terms = the summed target
    bk = ca.buckets("logit")
    parts = sum(v for k, v in bk.items() if k != "target")
    # GPT-2's eager attention runs in float64: exact to rounding. Llama's takes its softmax in float32 (the
    # model's own rounding, what the trace's reconstruction error measures), so the layers' sum telescopes
    # only to ~2^-24 relative to the magnitudes summed: 1e-6 of them leaves a margin of ~16x
    size = np.abs(ca.per_token["logit"]).sum() + sum(np.abs(v).sum() for v in ca.terms["logit"].values())
    assert abs(parts - bk["target"]) <= (1e-9 if family == "gpt2" else 1e-6) * size
    if target == "log_prob":
        lp = torch.log_softmax(logits, -1)[torch.arange(P - 1, P + T - 1), torch.tensor(ca.response_ids)]
        assert bk["target"] == pytest.approx(float(lp.sum()), rel=1e-12)


def test_attention_is_the_head_mean_of_the_predicting_rows(llama):
    ca = ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RESPONSE, methods=["attention"], progress=False)
    ids = ca.prompt_ids + ca.response_ids
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    with torch.no_grad():
        att = exact_eager_twin(llama.hf)(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    A = torch.stack([a[0] for a in att]).double().mean((0, 1))[P - 1 : P + T - 1].numpy()  # (T, n)
    want = np.array([[A[t, toks].sum() for toks in ca.source_tokens] for t in range(T)]).mean(0)
    assert np.allclose(ca.scores["attention"], want, rtol=1e-12)
    # each row sums to one up to Llama's float32 softmax (2^-24 per entry, ~40 entries, 2 layers x 4 heads)
    assert sum(v for k, v in ca.buckets("attention").items() if k != "target") == pytest.approx(T, rel=1e-6)


# ---------------------------------------------------------------- the result


def test_save_load_and_frame(tmp_path, cc_pair):
    _, ca = cc_pair
    p = ca.save(tmp_path / "ca")
    back = ctxmix.load_context_attribution(p)
    assert back.sources == ca.sources and back.response_ids == ca.response_ids and back.options == ca.options
    assert np.array_equal(back.scores["contextcite"], ca.scores["contextcite"])
    assert np.array_equal(back.scores_for("contextcite", (4, 8)), ca.scores_for("contextcite", (4, 8)))
    assert back.provenance["weights_sha256"] == ca.provenance["weights_sha256"]
    f = ca.to_frame()
    assert list(f.columns) == ["method", "source", "start", "end", "text", "score", "rank"] and len(f) == 3
    top = ca.top("contextcite", 1)[0]
    assert top[1] == ca.scores["contextcite"].max() and ca.cost["contextcite"]["forward"] == N_ABL


def test_generated_response_drops_eos_by_default(llama, monkeypatch):
    """The response ids: the generated ids without the end-of-sequence token (default); only EOS -> refused."""
    from ctxmix.engine import generate as gen

    real = gen.generate

    def fake(model, input_ids, max_new_tokens, greedy, new=(2003, 2004, 102), progress=None):
        g = real(model, input_ids=input_ids, max_new_tokens=1)
        g.input_ids = list(input_ids) + list(new)
        return g

    monkeypatch.setattr(gen, "generate", fake)
    ca = ctxmix.attribute_context(llama, CONTEXT, QUERY, methods=["attention"], progress=False)
    assert ca.response_ids == [2003, 2004] and ca.options["eos_dropped"]
    assert ca.response == llama.tokenizer.decode([2003, 2004])
    monkeypatch.setattr(gen, "generate", lambda *a, **k: fake(*a, **k, new=(102,)))
    with pytest.raises(BadInput, match="only an end-of-sequence"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, methods=["attention"], progress=False)


class _NoPass:
    """Counts the model's forward passes (a refusal must come before any)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        fwd = self.model.hf.forward

        def counted(*a, **k):
            self.calls += 1
            return fwd(*a, **k)

        self.model.hf.forward = counted
        return self

    def __exit__(self, *exc):
        del self.model.hf.forward


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(context="  "), "context is empty"),
        (dict(context=[]), "context is empty"),
        (dict(context="Only one sentence here."), "one sentence source only"),
        (dict(response=""), "response is empty"),
        (dict(response="[SEP]"), "only special tokens"),
        (dict(context="Some words here. " * 40), "window of 128"),
        (dict(sources=[(0, 10), (5, 20)]), "overlaps"),
        (dict(sources=[(0, 10), (20, 999)]), "outside the context"),
        (dict(n_ablations=1), "from 2 to 1024"),
        (dict(n_ablations=5000), "from 2 to 1024"),
        (dict(methods=["contextcite"], seed=2**32 - 3, seeds="official"), "seed must be at most"),  # RandomState < 2^32
        (dict(methods=["nope"]), "unknown context-attribution"),
        (dict(query=""), "query must be"),
    ],
)
def test_bad_input_is_refused_before_any_pass(llama, kwargs, match):
    call = dict(context=CONTEXT, query=QUERY, response=RESPONSE, methods=["contextcite", "logit"], progress=False)
    call.update(kwargs)
    with _NoPass(llama) as counter, pytest.raises(BadInput, match=match):
        ctxmix.attribute_context(llama, call.pop("context"), **call)
    assert counter.calls == 0


def test_leave_one_out_cap_and_encoder_refusal(tokenizer, llama, monkeypatch):
    monkeypatch.setattr(cab, "MAX_LOO_SOURCES", 2)
    with pytest.raises(BadInput, match="over the limit of 2"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RESPONSE, methods=["leave_one_out"], progress=False)
    with pytest.raises(BadInput, match="encoder-only"):
        ctxmix.attribute_context(tiny_model("bert", tokenizer), CONTEXT, QUERY, response=RESPONSE, progress=False)


def test_explain_points_context_methods_to_attribute_context(llama):
    with pytest.raises(BadInput, match="attribute_context"):
        ctxmix.explain(llama, "a b c", ["contextcite"])
    for info in ctxmix.CONTEXT_METHODS.values():
        assert info.group == "context" and info.paper and "Cost" in info.caveat


def test_compat_docstring_says_the_sources_differ():
    """compat=True reproduces the official arithmetic, not its sources (nltk's punkt against ctxmix's pysbd):
    the docstring says so and names the way out (explicit spans)."""
    doc = " ".join(ctxmix.attribute_context.__doc__.split())
    assert "nltk's punkt" in doc and "pysbd" in doc and "explicit character spans" in doc
