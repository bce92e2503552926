"""`logit` and `alti_logit` (Ferrando et al., ACL 2023) on every decoder family: the tokens' parts
plus the unattributed terms are the model's logit (difference), each layer's parts are what its
attention block really writes to the stream at the explained position, ALTI-Logit is Logit traced
back through the ALTI layer maps, and the results survive batching, float32 and a saved file."""

import numpy as np
import pytest
import torch
from conftest import FAMILIES, tiny_model, tiny_variant

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.prediction import logit_parts, unattributed

DECODERS = [
    f
    for f in FAMILIES
    if f
    in (
        "gpt2",
        "opt",
        "llama",
        "llama3",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gpt_neox",
        "phi",
        "gemma",
        "gemma2",
        "gemma3",
    )
]
TEXT = "the keys to the old cabinet are"
# Hugging Face computes RMSNorm (and OPT's final norm, and Gemma's soft-capping) partly in float32 even
# in a float64 model: its logits then carry float32 rounding (relative 2^-24 x the reduction)
FLOAT32_INSIDE = {"llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "opt"}


@pytest.fixture(scope="module", params=DECODERS)
def decoder(request, tokenizer):
    return tiny_model(request.param, tokenizer)


def _tol(model, value: float) -> float:
    return 1e-6 * max(1.0, abs(value)) if model.name.removeprefix("tiny-") in FLOAT32_INSIDE else 1e-8


@pytest.mark.parametrize("foil", [False, True])
def test_tokens_and_terms_sum_to_the_logit(decoder, foil):
    ex0 = ctxmix.explain(decoder, TEXT, ["logit"])
    f = None
    if foil:
        top = torch.topk(torch.as_tensor(list(ex0.prediction["probabilities"].values())), 2)
        f = list(ex0.prediction["probabilities"])[1]
        f = decoder.tokenizer.convert_tokens_to_ids([f])[0]
        assert top.values[0] >= top.values[1]
    ex = ctxmix.explain(decoder, TEXT, ["logit", "alti_logit"], foil=f, per_head=True)
    tr = ctxmix.engine.trace.trace(decoder, TEXT)
    t = ex.position
    logits = tr.logits[t].double()
    from ctxmix.methods.readout import softcap

    cap = softcap(decoder)
    if cap:
        logits = cap * torch.atanh(logits / cap)
    want = float(logits[ex.target] - (logits[ex.foil] if foil else 0))
    for m in ("logit", "alti_logit"):
        got = float(ex.saliency[m].sum()) + unattributed(ex.logit_terms[m])
        assert abs(got - want) < _tol(decoder, want), (m, got, want)
        assert ex.logit_contributions[m].shape == (2 if foil else 1, len(ex.tokens))
        np.testing.assert_allclose(
            ex.logit_contributions[m][0] - (ex.logit_contributions[m][1] if foil else 0), ex.saliency[m], atol=1e-12
        )
        L, n = decoder.n_layers, len(ex.tokens)
        assert ex.layer_saliency[m].shape == (L, n) and ex.head_saliency[m].shape[::2] == (L, n)
        np.testing.assert_allclose(ex.head_saliency[m].sum(1), ex.layer_saliency[m], atol=1e-10)
        total = ex.layer_saliency[m].sum(0)
        np.testing.assert_allclose(total[:t], ex.saliency[m][:t], atol=1e-10)
        # the predicted position also holds its own embedding's part (the official code's choice)
        emb = ctxmix.explain(decoder, TEXT, [m], foil=f, embedding="term").logit_terms[m]["embedding"]
        assert abs(ex.saliency[m][t] - total[t] - emb) < 1e-10
        assert len(ex.logit_terms[m]["mlp"]) == L and len(ex.logit_terms[m]["attention_bias"]) == L
    # causal: nothing comes from after the explained position
    assert np.all(ex.layer_saliency["logit"][:, t + 1 :] == 0)
    # rows of ALTI's rollout sum to one (or are all zero: "untraced"), so both methods share their total
    untraced = sum(ex.logit_terms["alti_logit"]["untraced"])
    assert abs(ex.saliency["logit"].sum() - ex.saliency["alti_logit"].sum() - untraced) < _tol(decoder, want)


def test_each_layers_parts_are_its_real_attention_update(decoder):
    """Against the model's own modules (forward hooks on each layer's attention output projection, or
    on Gemma 2/3's post-attention norm): a layer's token parts plus its b_O term are what that module
    really outputs at t, read through the frozen final norm."""
    from operator import attrgetter

    spec = decoder.spec
    layers = attrgetter(spec.layers)(decoder.hf.base_model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        attrgetter(spec.post_attn_norm or spec.out_proj)(layer).register_forward_hook(
            lambda mod, inp, out, l=l: seen.__setitem__(l, (out[0] if isinstance(out, tuple) else out)[0].detach())
        )
        for l, layer in enumerate(layers)
    ]
    try:
        tr = ctxmix.engine.trace.trace(decoder, TEXT)
    finally:
        for h in hooks:
            h.remove()
    t = tr.n - 1
    target = int(tr.logits[t].argmax())
    parts = logit_parts(decoder, tr, t, [target])
    from ctxmix.methods.readout import readout

    r, _ = readout(decoder, tr.states[-1].y[t], decoder.hf.get_output_embeddings().weight[[target]].double())
    for l in range(decoder.n_layers):
        want = float(seen[l][t].double() @ r[0])
        got = float(parts.per_head[0, l].sum() + parts.attention_bias[0, l])
        assert abs(got - want) < _tol(decoder, want), (l, got, want)


def test_alti_logit_is_logit_traced_back_through_alti(tokenizer):
    """Two layers, by hand: layer 1 is Logit's; layer 2 is Logit's layer-2 row times ALTI's layer-1 map."""
    m = tiny_model("gpt2", tokenizer)
    ex = ctxmix.explain(m, TEXT, ["logit", "alti_logit", "alti"])
    lg, al, C = ex.layer_saliency["logit"], ex.layer_saliency["alti_logit"], ex.layer_maps["alti"]
    np.testing.assert_allclose(al[0], lg[0], atol=1e-12)
    np.testing.assert_allclose(al[1], lg[1] @ C[0], atol=1e-12)
    # asked without "alti", the ALTI maps are computed for it but not reported
    ex2 = ctxmix.explain(m, TEXT, ["alti_logit"])
    assert "alti" not in ex2.layer_maps
    np.testing.assert_allclose(ex2.saliency["alti_logit"], ex.saliency["alti_logit"], atol=1e-12)


def test_embedding_as_a_term(tokenizer):
    m = tiny_model("llama", tokenizer)
    a = ctxmix.explain(m, TEXT, ["logit"])
    b = ctxmix.explain(m, TEXT, ["logit"], embedding="term")
    t = a.position
    assert "embedding" in b.logit_terms["logit"] and "embedding" not in a.logit_terms["logit"]
    assert abs(a.saliency["logit"][t] - b.saliency["logit"][t] - b.logit_terms["logit"]["embedding"]) < 1e-10
    assert (
        abs(
            unattributed(b.logit_terms["logit"])
            + b.saliency["logit"].sum()
            - unattributed(a.logit_terms["logit"])
            - a.saliency["logit"].sum()
        )
        < 1e-10
    )


def test_float32_matches_float64(tokenizer):
    import copy

    m64 = tiny_model("qwen2", tokenizer)
    m32 = ctxmix.model_from_hf(copy.deepcopy(m64.hf).float(), tokenizer, name="tiny-qwen2-float32")
    a = ctxmix.explain(m64, TEXT, ["logit", "alti_logit"], foil=1000)
    b = ctxmix.explain(m32, TEXT, ["logit", "alti_logit"], foil=1000)
    assert a.target == b.target
    for m in ("logit", "alti_logit"):
        scale = np.abs(a.layer_saliency[m]).max()
        assert np.abs(a.layer_saliency[m] - b.layer_saliency[m]).max() < 1e-4 * scale, m


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_batched_equals_one_at_a_time(tokenizer, family):
    """Each sequence of a padded batch against its own unpadded run: 1e-10 in float64, but GPT-NeoX's
    Hugging Face code runs its attention in float32 inside, so its padded and unpadded forward passes
    differ at float32 rounding (rtol 1e-6, as tests/test_batched.py allows)."""
    m = tiny_model(family, tokenizer)
    rtol = 1e-6 if family == "gpt_neox" else 0
    texts = [TEXT, "a dog", "the cat that the dogs chase sleeps"]
    batch = ctxmix.explain_batch(m, texts, ["logit", "alti_logit"], foils=[None, 2000, None])
    for text, ex, foil in zip(texts, batch, [None, 2000, None]):
        one = ctxmix.explain(m, text, ["logit", "alti_logit"], foil=foil)
        assert ex.target == one.target and ex.foil == one.foil
        for k in ("logit", "alti_logit"):
            np.testing.assert_allclose(ex.saliency[k], one.saliency[k], rtol=rtol, atol=1e-10)
            np.testing.assert_allclose(ex.layer_saliency[k], one.layer_saliency[k], rtol=rtol, atol=1e-10)
            assert ex.logit_terms[k].keys() == one.logit_terms[k].keys()


def test_saved_and_reopened(tokenizer, tmp_path):
    m = tiny_model("gemma2", tokenizer)
    ex = ctxmix.explain(m, TEXT, ["logit", "alti_logit", "norm"], foil=1000, per_head=True)
    back = ctxmix.load_explanation(ex.save(tmp_path / "lm.npz"))
    for k in ("logit", "alti_logit"):
        np.testing.assert_array_equal(back.layer_saliency[k], ex.layer_saliency[k])
        np.testing.assert_array_equal(back.head_saliency[k], ex.head_saliency[k])
        np.testing.assert_array_equal(back.logit_contributions[k], ex.logit_contributions[k])
        assert back.logit_terms[k] == ex.logit_terms[k]
    assert back.foil == ex.foil and back.target == ex.target
    assert any("soft-caps" in w for w in ex.warnings)


def test_clear_refusals(tokenizer, minilm):
    with pytest.raises(BadInput, match="causal language model"):
        ctxmix.explain(minilm, TEXT, ["logit"])
    with pytest.raises(BadInput, match="causal language model"):
        ctxmix.explain(tiny_model("roberta", tokenizer), TEXT, ["alti_logit"])
    post = tiny_variant("opt", tokenizer, do_layer_norm_before=False, name="tiny-opt-post-ln")
    with pytest.raises(BadInput, match="post-LN"):
        ctxmix.explain(post, TEXT, ["logit"])
    with pytest.raises(BadInput, match="embedding must be"):
        ctxmix.explain(tiny_model("gpt2", tokenizer), TEXT, ["logit"], embedding="both")


def test_registry_group_and_methods_listing():
    from ctxmix.methods.registry import METHODS, PREDICTION_METHODS

    for m in ("logit", "alti_logit"):
        assert METHODS[m].group == "prediction" and m in PREDICTION_METHODS
        assert "Causal LMs" in METHODS[m].doc and "Causal LMs only" in METHODS[m].caveat


def test_attention_flow_in_explain(minilm, tmp_path):
    """explain's attention_flow is the flow module on the head-mean attention, the explained row by
    default (others NaN), every row with flow_rows="all"; not rolled out; saved and reopened."""
    from ctxmix.methods.flow import attention_flow

    text = "The keys to the cabinet are on the table ."
    ex = ctxmix.explain(minilm, text, ["attention_flow", "attention"], position=3)
    G = ex.global_maps["attention_flow"]
    want = attention_flow(ex.layer_maps["attention"], rows=[3])
    np.testing.assert_allclose(G[:, 3], want[:, 3], atol=0)
    assert np.isnan(np.delete(G, 3, axis=1)).all() and "attention_flow" not in ex.layer_maps
    np.testing.assert_allclose(ex.saliency["attention_flow"], G[-1, 3])
    assert abs(ex.saliency["attention_flow"].sum() - 1) < 1e-12
    full = ctxmix.explain(minilm, text, ["attention_flow"], flow_rows="all")
    assert not np.isnan(full.global_maps["attention_flow"]).any() and "attention" not in full.layer_maps
    np.testing.assert_allclose(full.global_maps["attention_flow"][:, 3], G[:, 3], atol=1e-12)
    back = ctxmix.load_explanation(ex.save(tmp_path / "flow.npz"))
    np.testing.assert_array_equal(back.global_maps["attention_flow"], G)
    with pytest.raises(BadInput, match="flow_rows must be"):
        ctxmix.explain(minilm, text, ["attention_flow"], flow_rows="some")


def test_attention_flow_refuses_a_length_beyond_a_minute_per_row(minilm, monkeypatch):
    import ctxmix.methods.flow as flow

    called = []
    monkeypatch.setattr(flow, "attention_flow", lambda *a, **k: called.append(1))
    long_text = " ".join(["word"] * 470)
    with pytest.raises(BadInput, match="limited to"):
        ctxmix.explain(minilm, long_text, ["attention_flow"])
    with pytest.raises(BadInput, match="limited to"):  # every row of 60 tokens: 60 rows within a minute
        ctxmix.explain(minilm, " ".join(["word"] * 200), ["attention_flow"], flow_rows="all")
    assert not called


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_saturated_soft_cap_explains_the_pre_cap_logit(tokenizer, dtype):
    """Gemma 2 with a small final soft-cap c, so the top logits saturate (c tanh(z/c) = c exactly in the
    model's dtype): `logit`, `alti_logit` and `decompx` explain the pre-cap logit z that the model's
    own lm_head computed (read by a hook), not c atanh(capped / c) (inf in float32, about 17.6 c after a
    clamp in float64), and their parts still sum to it."""
    import copy

    from ctxmix.methods.decompx import DecompXOptions, decompx

    m = tiny_variant("gemma2", tokenizer, final_logit_softcapping=0.2, name="tiny-gemma2-cap")
    if dtype != torch.float64:
        m = ctxmix.model_from_hf(copy.deepcopy(m.hf).to(dtype), tokenizer, name="tiny-gemma2-cap-float32")
    seen = {}
    hook = m.hf.lm_head.register_forward_hook(lambda mod, i, o: seen.__setitem__("z", o[0].detach()))
    try:
        ex = ctxmix.explain(m, TEXT, ["logit", "alti_logit", "decompx"])
        tr = ctxmix.engine.trace.trace(m, TEXT)
    finally:
        hook.remove()
    t, w = ex.position, ex.target
    cap = m.hf.config.final_logit_softcapping
    assert tr.logits[t, w].abs() == torch.tensor(cap, dtype=dtype)  # saturated: atanh cannot give z back
    z = float(seen["z"][t, w])
    # ctxmix recomputes z from its last state: off by the state's reconstruction error times |u_w|_1,
    # plus the rounding of a d-term dot product in each (2 d u sum |u_w,i f_i|, u the unit roundoff)
    U = m.hf.lm_head.weight[w].double()
    f = m.layers[-1].next_norm(tr.states[-1].y[t]).double()
    u = torch.finfo(dtype).eps / 2
    tol = float(U.abs().sum() * tr.reconstruction_error + 2 * len(U) * u * (U * f).abs().sum())
    capped = tr.logits[t, w] / cap  # what undoing the cap would give: inf, or 17.6 c after the clamp
    undone = float(cap * torch.atanh(capped.clamp(-1 + 1e-15, 1 - 1e-15)))
    assert not abs(undone - z) <= tol, (undone, z)
    assert abs(ex.prediction["explained"]["value"] - z) <= tol, (ex.prediction["explained"]["value"], z, tol)
    r = decompx(m, tr, t, [w], DecompXOptions())
    assert np.isfinite(r.logits).all() and abs(r.logits[0] - z) <= tol, (r.logits, z, tol)
    assert any("soft-caps" in note for note in ex.warnings)  # the caveat stays
    if dtype == torch.float64:  # the parts sum to z (float32 adds the propagation's rounding: not derived here)
        for meth in ("logit", "alti_logit"):
            got = float(ex.saliency[meth].sum()) + unattributed(ex.logit_terms[meth])
            assert abs(got - z) < _tol(m, z) + tol, (meth, got, z)
        assert abs(float(ex.saliency["decompx"].sum()) - z) < _tol(m, z) + tol
