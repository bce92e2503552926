"""The batched engine: each sequence of a padded batch gets exactly its own unbatched maps,
on every family, for every mixing method and scope, in float32 and float64."""

import numpy as np
import pytest
import torch
from conftest import FAMILIES, tiny_model

from ctxmix.engine.trace import trace_batch_tensors, trace_ids
from ctxmix.methods.mixing import compute_maps, mixing_maps_batch, scope_maps_batch
from ctxmix.methods.registry import MIXING_METHODS, scope_names

TEXTS = [
    "the keys to the cabinet are on the table .",
    "a small dog barked .",
    "she loves math rather than engaging in sports , and her brother does not .",
]
MIXING = [m for m, info in MIXING_METHODS.items() if info.group != "scope"]


def _float32_inside(m) -> bool:
    """Families whose Hugging Face code runs a softmax or RMSNorm in float32 even in a float64
    model (OPT, Llama): a padded and an unpadded forward pass then differ at float32 rounding."""
    return m.spec.norm == "rmsnorm" or m.spec.family in ("OPT", "ModernBERT", "GPT-NeoX", "Phi")


@pytest.fixture(params=["whole batch", "sub-batches"])
def splitting(request, monkeypatch):
    """ "sub-batches": a budget that splits a batch of three into parts of two and one, with
    their own row chunks (ctxmix.methods.mixing._sub_batches)."""
    import ctxmix.methods.mixing as M

    if request.param == "sub-batches":
        n = max(len(t.split()) for t in TEXTS) + 4
        monkeypatch.setattr(M, "CHUNK_ELEMENTS", 2 * n * 40 * 6 * M.MIN_ROWS)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reference", ["own states", "own forward pass"])
def test_each_sequence_of_a_batch_equals_its_own_maps(tokenizer, family, dtype, reference, splitting):
    """ "own states": the engine on the batch against the engine on each sequence's cropped states of
    the same forward pass (isolates the batched decompositions: 1e-10 in float64, 1e-5 in float32);
    "own forward pass": against an unpadded trace of the sequence alone (adds the model's own
    padded-vs-unpadded rounding, float32-sized in families that compute in float32 inside)."""
    m = tiny_model(family, tokenizer, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    rtol = 0
    if reference == "own forward pass" and _float32_inside(m):
        tol, rtol = max(tol, 1e-6), 1e-6  # float32 rounding inside the model, relative to the values
    batch = [m.encode(t)[0] for t in TEXTS]
    lens = [len(ids) for ids in batch]
    assert len(set(lens)) == len(lens)  # really padded
    methods = MIXING + list(scope_names(m.spec.position))
    tb = trace_batch_tensors(m, batch)
    got = mixing_maps_batch(tb, methods)
    scopes = scope_maps_batch(tb, next_ln=True)
    for b, ids in enumerate(batch):
        n = len(ids)
        tr = tb.trace(b) if reference == "own states" else trace_ids(m, ids)
        assert float(tb.errors[b]) == pytest.approx(tr.reconstruction_error, abs=tol)
        ref = compute_maps(tr, methods)
        for meth in methods:
            g = got[meth][b].double().cpu().numpy()
            np.testing.assert_allclose(g[:, :n, :n], ref[meth][0], rtol=rtol, atol=tol, err_msg=f"{family} {meth}")
            assert np.all(g[:, n:, :] == 0) and np.all(g[:, :, n:] == 0), f"padding leaked into {meth}"
        ref_scopes = {
            k: v
            for k, v in __import__("ctxmix.methods.mixing").methods.mixing.scope_layer_maps(tr, next_ln=True).items()
        }
        assert set(ref_scopes) == set(scopes)
        for k, v in ref_scopes.items():
            np.testing.assert_allclose(scopes[k][b, :, :n, :n].double().cpu().numpy(), v, rtol=rtol, atol=tol)


def test_batched_rows_sum_to_one_where_promised(tokenizer):
    m = tiny_model("bert", tokenizer)
    batch = [m.encode(t)[0] for t in TEXTS]
    tb = trace_batch_tensors(m, batch)
    got = mixing_maps_batch(tb, ["attention", "alti", "value_zeroing"])
    for b, ids in enumerate(batch):
        n = len(ids)
        for meth, maps in got.items():
            np.testing.assert_allclose(maps[b, :, :n, :n].sum(-1).cpu().numpy(), 1.0, atol=1e-10, err_msg=meth)


# ----------------------------------------------------------------- corpus analyses on the device

CORPUS = TEXTS + [
    "the cat sat .",
    "",
    "why do the dogs that the cats chase bark at night ?",
    "a very long sentence about nothing in particular that goes on and on for a while .",
]


def _reports(m, batch_size):
    import warnings

    from ctxmix.analyses.corpus import corpus_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty text's warning
        return corpus_report(
            m,
            CORPUS,
            change=True,
            amp=True,
            norms=True,
            outliers=True,
            min_count=1,
            top_k=1000,
            progress=False,
            batch_size=batch_size,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", FAMILIES)
def test_corpus_reports_do_not_depend_on_batching(tokenizer, family, dtype):
    """Every corpus report (change, FF-amp, RES2 norms, outliers) from one-sequence batches equals
    the one from padded, length-bucketed batches (float64 1e-10, float32 1e-5)."""
    m = tiny_model(family, tokenizer, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    rtol = 0
    if _float32_inside(m):
        tol, rtol = max(tol, 1e-6), 1e-6
    one, many = _reports(m, 1), _reports(m, 3)
    for k in one:
        a, b = one[k], many[k]
        assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0, k
        if k == "ff_amp":  # ties may order differently: compare as a table keyed by the pair
            a = a.sort_values(["layer", "out_token", "in_token"]).reset_index(drop=True)
            b = b.sort_values(["layer", "out_token", "in_token"]).reset_index(drop=True)
        for c in a.columns:
            if a[c].dtype.kind in "fc":
                np.testing.assert_allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=rtol, atol=tol, err_msg=f"{k} {c}")
            else:
                assert a[c].tolist() == b[c].tolist(), (k, c)
    assert set(one["change"]["n"]) == {len(CORPUS) - 1}  # the empty text is skipped


def test_ff_amp_matches_the_dictionary_definition(tokenizer):
    """FF-amp averaged per (output token, input token) pair, i != j, by hand from scope maps."""
    from collections import defaultdict

    import ctxmix
    from ctxmix.analyses.corpus import ff_amp_matrix, ff_amp_scopes

    m = tiny_model("bert", tokenizer)
    df = ctxmix.ff_amp(m, CORPUS[:4], min_count=1, top_k=10**6, progress=False)
    before, after = ff_amp_scopes(m)
    acc = defaultdict(list)
    for t in CORPUS[:4]:
        s = ctxmix.scope_maps(m, t)
        toks = m.tokens(m.encode(t)[0])
        D = ff_amp_matrix(s[before][1], s[after][1])
        for i in range(len(toks)):
            for j in range(len(toks)):
                if i != j:
                    acc[(toks[i], toks[j])].append(D[i, j])
    got = df[df.layer == 2].set_index(["out_token", "in_token"])
    assert len(got) == len(acc)
    for pair, v in acc.items():
        assert got.loc[pair, "score"] == pytest.approx(np.mean(v), abs=1e-12)
        assert got.loc[pair, "count"] == len(v)


def test_device_spearman_equals_scipy_with_ties():
    from scipy import stats

    from ctxmix.analyses.ranks import average_ranks, spearman

    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0])).numpy(), [4, 1, 4, 2, 4])
    a = rng.integers(0, 4, size=(6, 50)).astype(float)  # many ties
    b = rng.normal(size=(6, 50))
    b[:, :10] = 0.5
    got = spearman(torch.tensor(a), torch.tensor(b)).numpy()
    ref = [stats.spearmanr(x, y).statistic for x, y in zip(a, b)]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    # masked cells leave the others' ranks alone, and a constant side gives NaN as in scipy
    valid = torch.zeros(50, dtype=torch.bool)
    valid[:30] = True
    got = spearman(torch.tensor(a), torch.tensor(b), valid).numpy()
    np.testing.assert_allclose(got, [stats.spearmanr(x[:30], y[:30]).statistic for x, y in zip(a, b)], atol=1e-12)
    assert np.isnan(float(spearman(torch.ones(5), torch.arange(5.0))))


def test_corpus_pass_does_not_synchronise_per_sequence(tokenizer, monkeypatch):
    """No .cpu()/.item()/.tolist()/.numpy() in the corpus loop: the count of such calls is the
    same for a corpus twice as long (only the final tables come back from the device)."""
    from ctxmix.analyses.corpus import corpus_report

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    calls = {"n": 0}
    for name in ("cpu", "item", "tolist", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    for k in (1, 2):
        calls["n"] = 0
        corpus_report(m, TEXTS * 2 * k, change=True, amp=True, norms=True, outliers=True, progress=False, batch_size=2)
        counts.append(calls["n"])
    assert counts[0] == counts[1], counts


def test_batches_are_length_bucketed_and_fit_the_budget(tokenizer):
    from ctxmix.analyses.corpus import plan_batches
    from ctxmix.engine.budget import batch_size_for, memory_budget, sequence_bytes

    m = tiny_model("bert", tokenizer)
    lengths = [5, 40, 7, 40, 6, 12, 39, 8]
    plan = plan_batches(m, lengths, batch_size=3)
    assert sorted(k for b in plan for k in b) == list(range(len(lengths)))
    assert [len(b) for b in plan] == [3, 3, 2]
    flat = [lengths[k] for b in plan for k in b]
    assert flat == sorted(flat)
    # by default, padding may add at most 10 % (CPU) to a batch's n^2 work: short and long apart
    lens = [33, 120, 118, 34, 60]
    assert [[lens[k] for k in b] for b in plan_batches(m, lens)] == [[33, 34], [60], [118, 120]]
    assert memory_budget("cpu") > 0
    one = sequence_bytes(m, 128)
    assert batch_size_for(m, 128, budget=2 * one * 3, max_batch=64) == 3  # half the budget for states
    assert batch_size_for(m, 128, budget=1) == 1  # never zero
    assert sequence_bytes(m, 512) > 4 * sequence_bytes(m, 128)  # the n^2 terms


def test_corpus_api_rejects_bad_arguments(tokenizer):
    import ctxmix
    from ctxmix.errors import BadInput

    m = tiny_model("bert", tokenizer)
    with pytest.raises(BadInput, match="not one string"):
        ctxmix.contextualization_change(m, "a string", progress=False)
    with pytest.raises(BadInput, match="ignore_low_gamma"):
        ctxmix.contextualization_change(m, TEXTS, ignore_low_gamma=1.5, progress=False)
    with pytest.raises(BadInput, match="mask_rate"):
        ctxmix.contextualization_change(m, TEXTS, mask_rate=-1, progress=False)
    with pytest.raises(BadInput, match="top_k"):
        ctxmix.ff_amp(m, TEXTS, top_k=-1, progress=False)
    with pytest.raises(BadInput, match="batch_size"):
        ctxmix.contextualization_change(m, TEXTS, batch_size=0, progress=False)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_explain_batch_equals_explain(tokenizer, family):
    """explain_batch (one padded pass, batched maps) gives each text what explain gives it alone,
    saliency methods, prediction and per-text method lists included."""
    import ctxmix

    m = tiny_model(family, tokenizer)
    sal = ["grad", "grad_x_input", "integrated_gradients", "blank_out", "cat", "attcat"]
    methods = ["alti", "value_zeroing", "globenc"] + sal
    per = [methods, ["alti"], sal]
    got = ctxmix.explain_batch(m, TEXTS, methods, methods_per_text=per, ig_steps=8)
    for t, ms, ex in zip(TEXTS, per, got):
        ref = ctxmix.explain(m, t, ms, ig_steps=8)
        assert ex.tokens == ref.tokens and ex.methods == ms and ex.position == ref.position
        assert set(ex.saliency) == set(ms) and ex.target == ref.target
        for k in ms:
            np.testing.assert_allclose(ex.saliency[k], ref.saliency[k], rtol=1e-9, atol=1e-10, err_msg=k)
        for k in ex.layer_maps:
            np.testing.assert_allclose(ex.layer_maps[k], ref.layer_maps[k], rtol=0, atol=1e-10, err_msg=k)
        assert ex.prediction["label"] == ref.prediction["label"]


def test_lower_triangle_change_matches_scipy(tokenizer):
    """lower_triangle keeps only j <= i of each sequence (padding excluded) before ranking."""
    from scipy import stats

    import ctxmix
    from ctxmix.analyses.corpus import PRE_COMPARISONS

    m = tiny_model("gpt2", tokenizer)
    df = ctxmix.contextualization_change(m, TEXTS, lower_triangle=True, progress=False, batch_size=3)
    a, b = PRE_COMPARISONS["+Ff"]
    vals = []
    for t in TEXTS:
        s = ctxmix.scope_maps(m, t)
        il = np.tril_indices(s[a].shape[-1])
        vals.append(1 - stats.spearmanr(s[a][0][il], s[b][0][il]).statistic)
    row = df[(df.layer == 1) & (df.comparison == "+Ff")].iloc[0]
    assert row.change == pytest.approx(np.mean(vals), abs=1e-12)
    assert row["std"] == pytest.approx(np.std(vals), abs=1e-12)
    full = ctxmix.contextualization_change(m, TEXTS, progress=False, batch_size=3)
    assert not np.allclose(full["change"], df["change"])


def test_server_caps_on_a_corpus(tokenizer):
    """max_tokens cuts long sequences (the closing special token kept, with a warning);
    max_total_tokens refuses a larger corpus before any work."""
    from ctxmix.analyses.corpus import encode_corpus
    from ctxmix.errors import BadInput

    m = tiny_model("bert", tokenizer)
    long = "one two three four five six seven eight nine ten eleven twelve"
    with pytest.warns(UserWarning, match="cut to 6 tokens"):
        _, ids, _, _ = encode_corpus(m, [long, "a b"], max_tokens=6)
    assert len(ids[0]) == 6 and ids[0][0] == 101 and ids[0][-1] == 102 and len(ids[1]) == 4
    with pytest.raises(BadInput, match="cap here is 10"):
        encode_corpus(m, [long, long], max_total_tokens=10)


def test_a_corpus_job_stops_at_its_progress_callback(tokenizer):
    """The dashboard cancels a job by raising from its progress callback (Streamlit interrupts a
    script at its next call when the user stops or reruns it): the pass ends there, and the
    memory-budget slot is given back."""
    import ctxmix.engine.budget as budget
    from ctxmix.analyses.corpus import corpus_report

    m = tiny_model("bert", tokenizer)
    calls = []

    class Stop(Exception):
        pass

    def progress(done, total):
        calls.append(done)
        if len(calls) == 2:
            raise Stop

    with pytest.raises(Stop):
        corpus_report(m, TEXTS * 4, progress=progress, batch_size=2)
    assert len(calls) == 2 and budget._ACTIVE == 0


# ---------------------------------------------------------------------------------------------
# explain_batch's edges: per-text cost checks, and every option of explain on the batch path
# ---------------------------------------------------------------------------------------------

SHORT = "a small dog barked ."
LONG = "the keys to the old wooden cabinet in the hall are on the kitchen table , said the woman . " * 3


def _flow_limit_between(monkeypatch, m, short: int, long: int) -> None:
    """Set attention flow's time limit so that `short` tokens pass and `long` do not (one row)."""
    import ctxmix.methods.flow as F

    mid = (short + long) // 2
    monkeypatch.setattr(F, "FLOW_ROW_SECONDS", F.flow_cost_seconds(mid, m.n_layers))
    assert F.flow_max_tokens(m.n_layers, F.FLOW_ROW_SECONDS) in range(short, long)


def test_a_long_text_that_did_not_ask_for_flow_does_not_fail_the_batch(tokenizer, monkeypatch):
    """Attention flow's cost check applies to the texts that ask for it, each at its own length: a long
    text asking for ALTI beside a short one asking for flow (or only padding the batch) keeps its ALTI.
    The old code checked every method of the union at the batch's longest text and refused it all."""
    import ctxmix
    from ctxmix.errors import BadInput

    m = tiny_model("bert", tokenizer)
    ns = [len(ctxmix.explain(m, t, ["attention"]).tokens) for t in (SHORT, LONG)]
    _flow_limit_between(monkeypatch, m, *ns)
    got = ctxmix.explain_batch(
        m, [SHORT, LONG], ["attention_flow", "alti"], methods_per_text=[["attention_flow"], ["alti"]]
    )
    ref = ctxmix.explain(m, LONG, ["alti"])
    np.testing.assert_allclose(got[1].saliency["alti"], ref.saliency["alti"], rtol=1e-9, atol=1e-10)
    assert "attention_flow" in got[0].saliency
    # a text that only pads the batch is not checked either
    got = ctxmix.explain_batch(m, [SHORT, LONG], ["attention_flow"], methods_per_text=[["attention_flow"], []])
    assert got[1].saliency == {} and "attention_flow" in got[0].saliency
    # the long text asking for flow itself is refused, named, as explain refuses it
    with pytest.raises(BadInput, match=rf"text 1 \({ns[1]} tokens\), attention_flow: attention flow on {ns[1]}"):
        ctxmix.explain_batch(m, [SHORT, LONG], ["attention_flow"])
    with pytest.raises(BadInput, match=f"attention flow on {ns[1]} tokens"):
        ctxmix.explain(m, LONG, ["attention_flow"])


def test_method_refusals_are_per_text_and_method(tokenizer, monkeypatch):
    """`method_refusals`: the methods one text's length rules out, and nothing for the others; a bad
    option is no length's fault and raises."""
    from ctxmix.errors import BadInput
    from ctxmix.methods.explain import method_refusals

    m = tiny_model("bert", tokenizer)
    _flow_limit_between(monkeypatch, m, 10, 40)
    assert method_refusals(m, 10, ["attention_flow", "alti"]) == {}
    why = method_refusals(m, 40, ["attention_flow", "alti", "decompx"])
    assert list(why) == ["attention_flow"] and "attention flow on 40 tokens" in why["attention_flow"]
    with pytest.raises(BadInput, match="flow_rows"):
        method_refusals(m, 10, ["attention_flow"], flow_rows="some")


def _option_cases():
    """One case per option of `explain` (and per saliency option): (family, methods, explain's
    keyword arguments, explain_batch's keyword arguments for the one explained text, whether the option
    changes the result from its default). Options that take the text's place (input_ids) or go with
    it (token_type_ids, segments) are given as a list of ids in both calls."""
    ids = [101, 1996, 6309, 2024, 2182, 102, 1037, 3899, 102]  # [CLS] the keys are here [SEP] a dog [SEP]
    segs = [-1, 0, 0, 0, 0, -1, 1, 1, -1]
    types = [0, 0, 0, 0, 0, 0, 1, 1, 1]
    return {
        "target": ("bert", ["grad_x_input"], {"target": 0}, {"targets": [0]}, True),
        "position": ("bert", ["alti"], {"position": 2}, {"positions": [2]}, True),
        "input_ids": ("bert", ["alti"], {"input_ids": ids}, {}, False),
        "token_type_ids": (
            "bert",
            ["alti"],
            {"input_ids": ids, "token_type_ids": types},
            {"token_type_ids": [types]},
            True,
        ),
        "segments": ("bert", ["alti"], {"input_ids": ids, "segments": segs}, {"segments": [segs]}, True),
        "res2": ("bert", ["AtbFfRes"], {"res2": "diagonal"}, {"res2": "diagonal"}, True),
        "precision": ("bert", ["value_zeroing"], {"precision": "bf16"}, {"precision": "bf16"}, True),
        "per_head": ("bert", ["attention"], {"per_head": True}, {"per_head": True}, True),
        "foil": ("gpt2", ["grad_x_input"], {"target": 1996, "foil": 2024}, {"targets": [1996], "foils": [2024]}, True),
        "embedding": ("gpt2", ["logit"], {"embedding": "term"}, {"embedding": "term"}, True),
        "target_kind": ("gpt2", ["logit"], {"target_kind": "log_prob"}, {"target_kind": "log_prob"}, True),
        "flow_rows": ("bert", ["attention_flow"], {"flow_rows": "all"}, {"flow_rows": "all"}, True),
        "decompx": ("bert", ["decompx"], {"decompx": {"bias": "none"}}, {"decompx": {"bias": "none"}}, True),
        "ig_baseline": (
            "bert",
            ["integrated_gradients"],
            {"ig_baseline": "zero", "ig_steps": 4},
            {"ig_baseline": "zero", "ig_steps": 4},
            True,
        ),
        "ig_steps": ("bert", ["integrated_gradients"], {"ig_steps": 3}, {"ig_steps": 3}, True),
        "blank_replacement": (
            "bert",
            ["blank_out"],
            {"blank_replacement": "mask"},
            {"blank_replacement": "mask"},
            True,
        ),
        "cat_mask_special": ("bert", ["cat"], {"cat_mask_special": False}, {"cat_mask_special": False}, True),
        "grad_at": ("bert", ["grad"], {"grad_at": "embedding_output"}, {"grad_at": "embedding_output"}, True),
    }


# explain's options that explain_batch has no path for, and why (a new option must be added to
# _option_cases or here, with its reason: the test below fails otherwise)
NO_BATCH_PATH = {
    "decoder_text": "ALTI+ on an encoder-decoder is per text; explain_batch explains an encoder-decoder's encoder only",
    "image": "images are explained one at a time: explain_batch takes texts; the results cache keys them (test_cache)",
    "audio": "clips are explained one at a time, as images (test_speech.py)",
    "sampling_rate": "the rate of an audio clip (test_speech.py)",
}


def _explain_options() -> list[str]:
    """explain's options, read from its signature (the text and methods aside) and the saliency
    options its **saliency_options take: a future option is in this list without anyone adding it."""
    import inspect

    from ctxmix.methods.explain import explain
    from ctxmix.methods.saliency import SALIENCY_OPTIONS

    sig = inspect.signature(explain).parameters.values()
    named = [p.name for p in sig if p.kind is not p.VAR_KEYWORD and p.name not in ("model", "text", "methods")]
    return named + list(SALIENCY_OPTIONS)


def _assert_same_explanation(a, b, what: str) -> None:
    """Every field both carry, equal: float64 tiny models, one sequence batched with a padding-only
    longer one vs alone, so the only differences are summation orders of padded rows (~1e-15 relative;
    1e-9 leaves room for the n-step reductions of IG and value zeroing)."""
    assert a.tokens == b.tokens and a.position == b.position, what
    assert a.target == b.target and a.foil == b.foil, what
    assert a.options == b.options, f"{what}: {a.options} != {b.options}"
    assert a.warnings == b.warnings, what
    for field in ("saliency", "layer_maps", "global_maps", "head_maps", "layer_saliency", "logit_contributions"):
        da, db = getattr(a, field, {}), getattr(b, field, {})
        assert set(da) == set(db), f"{what}: {field}"
        for k in da:
            np.testing.assert_allclose(da[k], db[k], rtol=1e-9, atol=1e-10, err_msg=f"{what}: {field}[{k}]")


@pytest.mark.parametrize("option", _explain_options())
def test_every_option_of_explain_reaches_explain_batch(tokenizer, option):
    """Each option of `explain` (introspected) gives the same Explanation through explain_batch, with a
    longer padding-only text in the batch, and (where it changes anything) a different one from its
    default: an option explain_batch takes but does not pass on (decompx= did) fails here."""
    import ctxmix

    if option in NO_BATCH_PATH:
        pytest.skip(NO_BATCH_PATH[option])
    cases = _option_cases()
    assert option in cases, f"explain's option {option!r} has no batch case: add it to _option_cases"
    family, methods, ekw, bkw, changes = cases[option]
    m = tiny_model(family, tokenizer)
    text = None if "input_ids" in ekw else "the keys are here ."
    item = ekw["input_ids"] if "input_ids" in ekw else text
    one = ctxmix.explain(m, text, methods, **ekw)
    got = ctxmix.explain_batch(m, [item, LONG], methods, methods_per_text=[methods, []], **_per_text(bkw))
    _assert_same_explanation(got[0], one, option)
    if changes:
        default = ctxmix.explain_batch(m, [item, LONG], methods, methods_per_text=[methods, []], **_defaults(ekw, bkw))
        a, b = default[0], got[0]
        assert any(not np.allclose(a.saliency[k], b.saliency[k], equal_nan=True) for k in methods) or (
            a.options,
            a.target,
            a.foil,
            set(a.head_maps),
        ) != (b.options, b.target, b.foil, set(b.head_maps)), (
            f"{option} changes nothing: the test could not see it ignored"
        )


def _per_text(bkw: dict) -> dict:
    """The batch's keyword arguments with the padding-only second text's entry (None) appended."""
    per = ("targets", "positions", "foils", "token_type_ids", "segments")
    return {k: (v + [None] if k in per else v) for k, v in bkw.items()}


def _defaults(ekw: dict, bkw: dict) -> dict:
    """The batch call without the option under test (what stays: the ids' pair marks, IG's steps)."""
    keep = {"ig_steps": 4} if "ig_baseline" in ekw else {}
    if "foil" in ekw:
        keep["targets"] = bkw["targets"]
    return _per_text(keep)


def test_the_runner_refuses_one_text_and_method_and_keeps_the_rest(tokenizer, tmp_path, monkeypatch):
    """In the benchmark runner, a text too long for attention flow gets a `refused` unit for that
    method alone, with the message; its other methods and the batch's other texts are done. The
    refusal is not retried by a rerun of the same ctxmix version, and is by another version. The old
    code marked every task of the batch as an error, retried (and failing) on every run."""
    import json
    import sqlite3

    import yaml

    import ctxmix
    from ctxmix import benchmark as runner

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": t, "label": k}) + "\n" for k, t in enumerate([SHORT, LONG]))
    )
    ns = [len(ctxmix.explain(m, t, ["attention"]).tokens) for t in (SHORT, LONG)]
    _flow_limit_between(monkeypatch, m, *ns)
    cfg = {
        "name": "refusals",
        "models": [str(tmp_path / "tiny")],
        "datasets": [{"id": "d", "source": "file", "path": str(tmp_path / "d.jsonl")}],
        "methods": ["attention_flow", "alti"],
        "metrics": ["aopc"],
        "example_batch": 2,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    db = tmp_path / "r.sqlite"

    def units():
        with sqlite3.connect(str(db)) as c:
            rows = c.execute("SELECT example_id, method, status, detail FROM units ORDER BY example_id, method")
            return [tuple(r) for r in rows], c.execute("SELECT COUNT(*) FROM errors").fetchone()[0]

    runner.run_bench(tmp_path / "c.yaml", db=db, quiet=True)
    got, errors = units()
    assert errors == 0
    assert [r[:3] for r in got] == [
        ("000000", "alti", "done"),
        ("000000", "attention_flow", "done"),
        ("000001", "alti", "done"),
        ("000001", "attention_flow", "refused"),
    ]
    assert f"attention flow on {ns[1]} tokens" in got[3][3]
    plan = runner.load_config(tmp_path / "c.yaml")
    with runner.ResultsStore(db) as store:
        assert ("d", "000001", "attention_flow") in {u[1:] for u in store.finished_units(plan.run_id)}
        monkeypatch.setattr(ctxmix, "__version__", ctxmix.__version__ + ".next")
        assert ("d", "000001", "attention_flow") not in {u[1:] for u in store.finished_units(plan.run_id)}


def test_the_runner_retries_a_decompx_refusal_that_depends_on_free_memory(tokenizer, tmp_path, monkeypatch):
    """DecompX's memory check reads the memory free at the time (and the jobs beside it): its refusal is
    recorded as an error, with the message, and retried by the next run, never kept as a deterministic
    `refused` unit that a busy moment would lose for good. The other methods are done."""
    import json
    import sqlite3

    import yaml

    import ctxmix.engine.budget as budget
    from ctxmix import benchmark as runner

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": SHORT, "label": 0}) + "\n")
    cfg = {
        "name": "memory",
        "models": [str(tmp_path / "tiny")],
        "datasets": [{"id": "d", "source": "file", "path": str(tmp_path / "d.jsonl")}],
        "methods": ["decompx", "alti"],
        "metrics": ["aopc"],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    db = tmp_path / "r.sqlite"
    from ctxmix.methods.decompx import pieces_bytes

    room = pieces_bytes(m, 2)  # a busy moment: room for two tokens, the options' check at one passes
    monkeypatch.setattr(budget, "memory_budget", lambda device: room)
    runner.run_bench(tmp_path / "c.yaml", db=db, quiet=True)
    with sqlite3.connect(str(db)) as c:
        got = [tuple(r) for r in c.execute("SELECT method, status, detail FROM units ORDER BY method")]
    errs = [tuple(r) for r in sqlite3.connect(str(db)).execute("SELECT * FROM errors")]
    assert [r[:2] for r in got] == [("alti", "done"), ("decompx", "error")], (got, errs)
    assert "budget" in got[1][2]
    plan = runner.load_config(tmp_path / "c.yaml")
    with runner.ResultsStore(db) as store:
        assert ("d", "000000", "decompx") not in {u[1:] for u in store.finished_units(plan.run_id)}
