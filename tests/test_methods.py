"""Each method against an independent reference or a hand-checkable value."""

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import exact_eager_twin, tiny_model

import ctxmix
from ctxmix.engine.layer import gated_ig_weights, ig_ratio
from ctxmix.engine.trace import trace_ids
from ctxmix.errors import BadInput
from ctxmix.methods.mixing import rollout
from ctxmix.methods.registry import MIXING_METHODS

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]
ALL_MIXING = ["attention", "attention_rollout", "norm", "norm_res", "norm_res_ln", "globenc", "alti", "value_zeroing"]


def test_rollout_hand_values():
    A = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [1.0, 0.0]]])
    R = rollout(A)
    np.testing.assert_allclose(R[1], A[1] @ A[0])
    np.testing.assert_allclose(R[1], [[0.5, 0.5], [1.0, 0.0]])
    Ri = rollout(A, add_identity=True)
    np.testing.assert_allclose(Ri[0], [[1.0, 0.0], [0.25, 0.75]])
    B = np.array([[[2.0, 2.0], [1.0, 3.0]]])
    np.testing.assert_allclose(rollout(B, row_normalise=True)[0], [[0.5, 0.5], [0.25, 0.75]])
    np.testing.assert_allclose(rollout(B)[0], B[0])  # GlobEnc: no normalisation by default


def _hf_layers(model):
    return model.hf.base_model.encoder.layer


def _reference_value_zeroing(model, ids):
    """The official algorithm (Mohebbi et al. code, hmohebbi/ValueZeroing): one HF layer call
    per zeroed token, value output hooked to zero v_t (bias included), float64 cosine."""
    with torch.no_grad():
        out = model.hf(torch.tensor([ids]), output_hidden_states=True)
        H = out.hidden_states
        n = len(ids)
        C = np.zeros((len(_hf_layers(model)), n, n))
        for l, layer in enumerate(_hf_layers(model)):
            for t in range(n):

                def hook(mod, inp, o, t=t):
                    o = o.clone()
                    o[:, t, :] = 0.0
                    return o

                h = layer.attention.self.value.register_forward_hook(hook)
                y = layer(H[l])
                h.remove()
                y = y[0] if isinstance(y, tuple) else y
                C[l, :, t] = (1 - F.cosine_similarity(y[0].double(), H[l + 1][0].double(), dim=-1)).numpy()
    return C / C.sum(-1, keepdims=True)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_value_zeroing_matches_official_loop(tokenizer, family):
    m = tiny_model(family, tokenizer)
    ex = ctxmix.explain(m, None, ["value_zeroing"], input_ids=IDS)
    np.testing.assert_allclose(ex.layer_maps["value_zeroing"], _reference_value_zeroing(m, IDS), atol=1e-10)


def _reference_alti(model, ids):
    """ALTI from a reference after the official code (mt-upc/transformer-contributions): hooks on value and
    LN1, BERT only; the attention from exact float64 eager on a copy of the model (HF's own code path)."""
    hf = exact_eager_twin(model.hf)
    enc = hf.base_model.encoder
    cfg = hf.config
    Hh, d = cfg.num_attention_heads, cfg.hidden_size
    dh = d // Hh
    cache, hooks = {}, []
    for l, layer in enumerate(enc.layer):
        hooks.append(
            layer.attention.self.value.register_forward_hook(lambda m, i, o, l=l: cache.__setitem__(("v", l), o))
        )
        hooks.append(
            layer.attention.output.LayerNorm.register_forward_hook(
                lambda m, i, o, l=l: cache.__setitem__(("ln", l), (i[0], o))
            )
        )
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    for h in hooks:
        h.remove()
    Cs = []
    torch.set_grad_enabled(False)
    for l, layer in enumerate(enc.layer):
        x = out.hidden_states[l][0]
        A = out.attentions[l][0]
        J = x.shape[0]
        v = cache[("v", l)][0].view(J, Hh, dh).permute(1, 0, 2)
        Wo = layer.attention.output.dense.weight.view(d, Hh, dh)
        bo = layer.attention.output.dense.bias
        ln = layer.attention.output.LayerNorm
        Tpre = torch.einsum("hij,hjd->ijd", A, torch.einsum("hjv,dhv->hjd", v, Wo))
        Tpre = Tpre + torch.eye(J, dtype=x.dtype).unsqueeze(-1) * x.unsqueeze(0)
        pre, post = cache[("ln", l)][0][0], cache[("ln", l)][1][0]
        sigma = torch.sqrt(pre.var(-1, unbiased=False) + ln.eps)
        Lmap = lambda u: (u - u.mean(-1, keepdim=True)) * ln.weight  # noqa: E731, B023 - called within the iteration
        T = Lmap(Tpre) / sigma[:, None, None]
        y = T.sum(1) + Lmap(bo)[None] / sigma[:, None] + ln.bias
        assert torch.allclose(y, post, atol=1e-10)
        dist = (y[:, None, :] - T).abs().sum(-1)
        C = (y.abs().sum(-1, keepdim=True) - dist).clamp(min=0)
        Cs.append((C / C.sum(-1, keepdim=True)).numpy())
    torch.set_grad_enabled(True)
    return np.stack(Cs)


def test_alti_matches_reference(tokenizer):
    m = tiny_model("bert", tokenizer)
    ex = ctxmix.explain(m, None, ["alti"], input_ids=IDS)
    ref = _reference_alti(m, IDS)
    np.testing.assert_allclose(ex.layer_maps["alti"], ref, atol=1e-10)
    np.testing.assert_allclose(ex.global_maps["alti"][-1], np.linalg.multi_dot(ref[::-1]), atol=1e-10)


def test_globenc_matches_reference_formula(tokenizer):
    """N_Enc from the GlobEnc code's recipe (its `modeling_bert.py`), written independently with einsum."""
    m = tiny_model("bert", tokenizer)
    ex = ctxmix.explain(m, None, ["norm", "norm_res", "globenc"], input_ids=IDS)
    with torch.no_grad():  # exact float64 eager attention on a copy of the model (HF's own code path)
        out = exact_eager_twin(m.hf)(torch.tensor([IDS]), output_hidden_states=True, output_attentions=True)
        for l, layer in enumerate(_hf_layers(m)):
            x = out.hidden_states[l][0]
            A = out.attentions[l][0]
            n, d = x.shape
            Hh = A.shape[0]
            v = layer.attention.self.value(x).view(n, Hh, d // Hh)
            Wo = layer.attention.output.dense.weight.view(d, Hh, d // Hh)
            f = torch.einsum("jhv,dhv->hjd", v, Wo)
            z = torch.einsum("hij,hjd->ijd", A, f)
            np.testing.assert_allclose(ex.layer_maps["norm"][l], z.norm(dim=-1).numpy(), atol=1e-10)
            zres = z + torch.eye(n, dtype=x.dtype)[:, :, None] * x[None]
            np.testing.assert_allclose(ex.layer_maps["norm_res"][l], zres.norm(dim=-1).numpy(), atol=1e-10)
            ln1, ln2 = layer.attention.output.LayerNorm, layer.output.LayerNorm
            pre1 = layer.attention.output.dense(torch.einsum("hij,jhv->ihv", A, v).reshape(n, d)) + x
            zt = (
                (zres - zres.mean(-1, keepdim=True))
                / torch.sqrt(pre1.var(-1, unbiased=False) + ln1.eps)[:, None, None]
                * ln1.weight
            )
            a = ln1(pre1)
            pre2 = layer.output.dense(layer.intermediate(a)) + a
            xt = (
                (zt - zt.mean(-1, keepdim=True))
                / torch.sqrt(pre2.var(-1, unbiased=False) + ln2.eps)[:, None, None]
                * ln2.weight
            )
            np.testing.assert_allclose(ex.layer_maps["globenc"][l], xt.norm(dim=-1).numpy(), atol=1e-10)
    np.testing.assert_allclose(ex.global_maps["globenc"], rollout(ex.layer_maps["globenc"]))


def test_ig_closed_form_matches_numeric_ig():
    """Zero-baseline IG of gelu(sum of pieces), 200-node Gauss-Legendre per element, vs g(u)/u."""
    torch.manual_seed(0)
    P = torch.randn(5, 7, dtype=torch.float64) * 2  # 5 pieces, 7 elements
    u = P.sum(0)
    closed = P * ig_ratio(u, F.gelu)
    x, w = np.polynomial.legendre.leggauss(200)
    a = torch.tensor((x + 1) / 2)
    w = torch.tensor(w / 2)
    uu = (a[:, None] * u[None]).requires_grad_(True)
    (g,) = torch.autograd.grad(F.gelu(uu).sum(), uu)
    numeric = P * (w[:, None] * g).sum(0)
    np.testing.assert_allclose(closed.numpy(), numeric.numpy(), atol=1e-12)
    np.testing.assert_allclose(closed.sum(0).numpy(), F.gelu(u).numpy(), atol=1e-14)


def test_gated_ig_matches_numeric_ig():
    """SwiGLU: IG share of piece j is g_j*u*I1 + u_j*I2; compare with IG computed by autograd
    along the straight path of f(alpha) = silu(alpha*g) * (alpha*u), and check completeness."""
    torch.manual_seed(0)
    G = torch.randn(4, 9, dtype=torch.float64) * 3
    U = torch.randn(4, 9, dtype=torch.float64)
    G[:, 0] *= 20  # large pre-activations take the identity branch
    G[:, 1] *= 1e-4  # near-zero ones take the quadrature branch
    g, u = G.sum(0), U.sum(0)
    I1, I2 = gated_ig_weights(g, F.silu)
    shares = G * (u * I1) + U * I2
    np.testing.assert_allclose(shares.sum(0).numpy(), (F.silu(g) * u).numpy(), atol=1e-12)
    x, w = np.polynomial.legendre.leggauss(400)
    ref = torch.zeros_like(G)
    for ak, wk in zip(x, w):
        al = float((ak + 1) / 2)
        gg = (al * g).requires_grad_(True)
        uu = (al * u).requires_grad_(True)
        dg, du = torch.autograd.grad((F.silu(gg) * uu).sum(), (gg, uu))
        ref += wk / 2 * (G * dg + U * du)
    np.testing.assert_allclose(shares.numpy(), ref.numpy(), atol=1e-9)


def test_explain_contract_on_every_family(tiny):
    ex = ctxmix.explain(tiny, None, ALL_MIXING, input_ids=IDS)
    n, L = len(IDS), tiny.n_layers
    assert ex.tokens == tiny.tokens(IDS)
    for m in ALL_MIXING:
        assert ex.layer_maps[m].shape == (L, n, n)
        assert ex.global_maps[m].shape == (L, n, n)
        assert ex.saliency[m].shape == (n,)
        assert np.all(np.isfinite(ex.layer_maps[m]))
        if MIXING_METHODS[m].rows_sum_to_one:
            # 1e-6: OPT and Llama take their softmax in float32 even in float64 models
            np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=1e-6)
            np.testing.assert_allclose(ex.global_maps[m].sum(-1), 1.0, atol=1e-6)
    if tiny.spec.causal:
        assert ex.position == n - 1
        for m in ALL_MIXING:
            assert np.allclose(np.triu(ex.layer_maps[m][0], 1), 0, atol=1e-12), m


@pytest.mark.parametrize("family", ["bert", "gpt2", "roberta"])
def test_saliency_methods(tokenizer, family):
    m = tiny_model(family, tokenizer)
    meths = ["grad", "grad_x_input", "integrated_gradients", "blank_out", "cat", "attcat", "alti"]
    ex = ctxmix.explain(m, None, meths, input_ids=IDS)
    for k in meths:
        assert ex.saliency[k].shape == (len(IDS),) and np.all(np.isfinite(ex.saliency[k])), k
    assert np.all(ex.saliency["grad"] >= 0)
    assert ex.target is not None


def test_attcat_masks_special_tokens_as_the_attcat_code_does(tokenizer):
    """Explained with [CLS]/[SEP] masked as keys, no query attends to them: AttCAT is 0 there;
    unmasked they receive attention. CAT of the last layer input is <d logit/d h, h>, summed."""
    m = tiny_model("bert", tokenizer)
    tr = trace_ids(m, IDS)
    from ctxmix.methods.saliency import cat_scores

    _, masked = cat_scores(m, tr, 1, 0, mask_special=True)
    cat, plain = cat_scores(m, tr, 1, 0, mask_special=False)
    assert np.abs(masked[:, [0, -1]]).max() < 1e-6 < np.abs(plain[:, [0, -1]]).max()
    assert np.abs(masked[:, 1:-1]).max() > 1e-6
    with torch.enable_grad():  # the last layer's input: grad of the class-1 logit, by hand
        E = m.hf.get_input_embeddings()(torch.tensor([IDS])).requires_grad_(True)
        out = m.hf(inputs_embeds=E, output_hidden_states=True)
        h = out.hidden_states[m.n_layers - 1]
        (g,) = torch.autograd.grad(out.logits[0, 1], h)
    np.testing.assert_allclose(cat[-1], (g[0] * h[0]).sum(-1).detach().numpy(), atol=1e-10)


@pytest.mark.parametrize(
    "opts, msg",
    [
        ({"ig_baseline": "gaussian"}, "ig_baseline must be one of 'pad'"),
        ({"ig_steps": 0}, "ig_steps must be a whole number from 1"),
        ({"blank_replacement": "pad"}, "blank_replacement must be one of 'unk'"),
        ({"ig_stepz": 3}, "unknown option 'ig_stepz'"),
    ],
)
def test_saliency_options_are_checked(tokenizer, opts, msg):
    m = tiny_model("bert", tokenizer)
    with pytest.raises(BadInput, match=msg):
        ctxmix.explain(m, None, ["integrated_gradients", "blank_out"], input_ids=IDS, **opts)


def test_blank_out_known_value(tokenizer):
    """Blanking a token changes p_target by exactly the difference of two forward passes."""
    m = tiny_model("bert", tokenizer)
    ex = ctxmix.explain(m, None, ["blank_out"], input_ids=IDS, target=1)
    with torch.no_grad():
        p = torch.softmax(m.hf(torch.tensor([IDS])).logits[0], -1)[1]
        ids = list(IDS)
        ids[3] = tokenizer.unk_token_id
        q = torch.softmax(m.hf(torch.tensor([ids])).logits[0], -1)[1]
    assert ex.saliency["blank_out"][3] == pytest.approx(float(p - q), abs=1e-12)


def test_integrated_gradients_completeness(tokenizer):
    """IG attributions (before abs) sum to p(x) - p(baseline); check through captum's delta."""
    from captum.attr import IntegratedGradients

    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.saliency import _baseline_ids, _embed, _forward_embeds, _score

    m = tiny_model("bert", tokenizer)
    tr = trace_ids(m, IDS)
    E = _embed(m, torch.tensor([IDS]))
    B = _embed(m, torch.tensor([_baseline_ids(m, IDS, "pad")]))
    f = lambda x: _score(m, _forward_embeds(m, tr, x).logits, 0, 0)  # noqa: E731
    _, delta = IntegratedGradients(f).attribute(E, baselines=B, n_steps=64, return_convergence_delta=True)
    assert abs(float(delta)) < 1e-6


def test_two_threads_get_identical_results(tokenizer):
    m = tiny_model("bert", tokenizer)
    out = [None, None]

    def run(k):
        out[k] = ctxmix.explain(m, None, ["alti", "value_zeroing", "grad"], input_ids=IDS)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    solo = ctxmix.explain(m, None, ["alti", "value_zeroing", "grad"], input_ids=IDS)
    for ex in out:
        for k in ("alti", "value_zeroing"):
            np.testing.assert_array_equal(ex.layer_maps[k], solo.layer_maps[k])
        np.testing.assert_array_equal(ex.saliency["grad"], solo.saliency["grad"])


def test_bad_inputs(minilm):
    with pytest.raises(ctxmix.BadInput, match="valid methods"):
        ctxmix.explain(minilm, "a b", ["alti", "nope"])
    with pytest.raises(ctxmix.BadInput, match="empty"):
        ctxmix.explain(minilm, "  ", ["alti"])
    with pytest.raises(ctxmix.BadInput, match="post-LN model"):
        ctxmix.explain(minilm, "a b", ["AtbLn"])
    with pytest.raises(ctxmix.BadInput, match="head"):
        ctxmix.explain(minilm, "a b", ["grad"])
    with pytest.warns(UserWarning, match="truncated"):
        ex = ctxmix.explain(minilm, "word " * 600, ["attention"])
    assert len(ex.tokens) == 512 and ex.warnings


def test_minilm_explain_real_model(minilm):
    text = "The keys to the cabinet are on the table ."
    ex = ctxmix.explain(minilm, text, ["globenc", "alti", "value_zeroing"])
    assert ex.tokens[0] == "[CLS]" and ex.tokens[-1] == "[SEP]"
    assert ex.layer_maps["alti"].shape == (6, 12, 12)
    assert ex.reconstruction_error < 1e-4
    s = ctxmix.scope_maps(minilm, text)
    assert set(s) == {"Atb", "AtbFf", "AtbFfRes", "AtbFfResLn"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_half_precision_models_give_finite_maps_near_float32(tokenizer, family, dtype):
    """The float16 / bfloat16 options (meant for CUDA) run every mixing method on CPU too: finite
    maps, rows that sum to one where promised, near the float32 maps (bench/perf.py reports the
    exact differences on a CUDA device)."""
    import copy

    m32 = tiny_model(family, tokenizer, dtype=torch.float32)
    half = ctxmix.model_from_hf(copy.deepcopy(m32.hf).to(dtype), tokenizer, name=f"tiny-{family}-half")
    ref = ctxmix.explain(m32, None, ALL_MIXING, input_ids=IDS)
    ex = ctxmix.explain(half, None, ALL_MIXING, input_ids=IDS)
    for m in ALL_MIXING:
        assert np.all(np.isfinite(ex.layer_maps[m])), m
        if MIXING_METHODS[m].rows_sum_to_one:  # the model's own probabilities sum to 1 to its precision
            tol = torch.finfo(dtype).eps if m.startswith("attention") else 1e-6
            np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=tol, err_msg=m)
        np.testing.assert_allclose(ex.layer_maps[m], ref.layer_maps[m], atol=0.1, err_msg=m)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_gradients_at_the_embedding_output(tokenizer, family):
    """grad_at="embedding_output": the gradient with respect to layer 0's input, by hand; on a
    Llama-like model (no embedding LayerNorm, no position embeddings) that is the word embedding."""

    m = tiny_model(family, tokenizer)
    ids = IDS if family == "bert" else IDS[:-1]
    ex = ctxmix.explain(
        m,
        None,
        ["grad", "grad_x_input", "integrated_gradients"],
        target=1,
        input_ids=ids,
        grad_at="embedding_output",
        ig_steps=16,
    )
    x = torch.tensor([ids])
    with torch.enable_grad():
        h0 = m.hf(input_ids=x, output_hidden_states=True).hidden_states[0].detach().requires_grad_(True)
        # the reference runs the model from h0 without ctxmix's hook: inputs_embeds for Llama, the
        # encoder layers one by one for BERT (one unpadded sequence: no mask)
        if family == "llama":
            z = m.hf(inputs_embeds=h0).logits[0, -1].double()
            p = torch.softmax(z, -1)[1]
        else:
            hs = h0
            for layer in m.hf.base_model.encoder.layer:
                hs = layer(hs)
                hs = hs[0] if isinstance(hs, tuple) else hs
            p = torch.softmax(m.hf.classifier(m.hf.base_model.pooler(hs)).double()[0], -1)[1]
        (g,) = torch.autograd.grad(p, h0)
    np.testing.assert_allclose(ex.saliency["grad"], g[0].norm(dim=-1).numpy(), rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(
        ex.saliency["grad_x_input"], (g[0] * h0[0].detach()).norm(dim=-1).numpy(), rtol=1e-8, atol=1e-14
    )
    word = ctxmix.explain(m, None, ["grad"], target=1, input_ids=ids)
    if family == "llama":  # layer 0 reads the word embeddings: the two choices agree
        np.testing.assert_allclose(word.saliency["grad"], ex.saliency["grad"], rtol=1e-10)
    else:  # BERT's embedding LayerNorm and position embeddings sit between them
        assert np.abs(word.saliency["grad"] - ex.saliency["grad"]).max() > 1e-6
    assert np.isfinite(ex.saliency["integrated_gradients"]).all()
