"""DecompX (Modarressi et al., ACL 2023): the parts sum to every layer's real hidden states and to the
logits on every family with a head rule; the post-LN path equals an independent transcription of the
official algorithm (mohsenfayyaz/DecompX, on the Hugging Face modules' own weights); the options do
what they say; batched, float32, saved files and refusals."""

import copy
import weakref

import numpy as np
import pytest
import torch
import transformers as T
from conftest import FAMILIES, exact_eager_twin, tiny_model, tiny_variant
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ctxmix
from ctxmix.engine.trace import trace
from ctxmix.errors import BadInput
from ctxmix.methods.decompx import DecompXOptions, decompx

TEXT = "the keys to the old cabinet are"
HEADLESS = {"deberta", "modernbert", "roberta"}  # the tiny ones: DeBERTa's pooler, two masked-LM heads
# Hugging Face computes RMSNorm (and OPT's, ModernBERT's norms) partly in float32 in a float64 model
FLOAT32_INSIDE = {"llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "opt"}


def _tol(family: str) -> float:
    return 1e-6 if family in FLOAT32_INSIDE else 1e-8


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_sum_to_every_state_and_to_the_logits(family, tokenizer):
    m = tiny_model(family, tokenizer)
    tr = trace(m, TEXT)
    t = tr.n - 1 if m.kind == "causal_lm" else 0
    tokens = [int(tr.logits[t].argmax()), 7] if m.kind == "causal_lm" else None
    r = decompx(m, tr, t, tokens, DecompXOptions(head=family not in HEADLESS))
    assert r.completeness.max() < _tol(family), r.completeness
    assert r.norms.shape == (m.n_layers, tr.n, tr.n)
    if family in HEADLESS:
        assert r.parts is None
        return
    gap = np.abs(r.parts.sum(1) - r.logits).max() / max(1.0, np.abs(r.logits).max())
    assert gap < _tol(family), (family, gap)
    if m.spec.causal:  # nothing reaches a position from tokens after it
        assert np.all(np.triu(r.norms[-1], 1) == 0)


def test_roberta_classification_head(tokenizer):
    m = tiny_variant("roberta", tokenizer, cls=T.RobertaForSequenceClassification, name="tiny-roberta-cls")
    ex = ctxmix.explain(m, TEXT, ["decompx"])
    lg = trace(m, TEXT).logits.double().numpy()
    np.testing.assert_allclose(ex.logit_contributions["decompx"].sum(1), lg, atol=1e-8)


def _reference_bert(hf, ids) -> np.ndarray:
    """The official algorithm for BertForSequenceClassification transcribed (its layer rule, its first layer
    and the classification head) on the Hugging Face modules' own weights: (n_k, C) parts of the logits."""
    emb = hf.bert.embeddings(input_ids=ids)[0]
    X, V = emb, None
    N = X.shape[0]
    out = hf.bert(input_ids=ids, output_attentions=True, output_hidden_states=True)

    def spread(P, b):
        bb = b.expand(P.shape[0], -1) if b.dim() == 1 else b
        w = torch.einsum("ikd,id->ik", P, bb).abs()
        w = w / (w.sum(-1, keepdim=True) + 1e-12)
        return P + w[..., None] * bb[:, None, :]

    def ln_pieces(P, pre, ln):
        s = (pre.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
        return spread((P - P.mean(-1, keepdim=True)) / s[:, None, :] * ln.weight, ln.bias)

    for l, layer in enumerate(hf.bert.encoder.layer):
        A = out.attentions[l][0]
        att_mod, H = layer.attention, hf.config.num_attention_heads
        dh = X.shape[1] // H
        Wv, bv = att_mod.self.value.weight.T, att_mod.self.value.bias
        Wo, bo = att_mod.output.dense.weight.T, att_mod.output.dense.bias
        if V is None:
            vals = (X @ Wv + bv).view(N, H, dh)
            att = torch.einsum("hik,khe,hed->ikd", A, vals, Wo.view(H, dh, -1))
            R = att.clone()
            R[range(N), range(N)] += X
            b_att = bo
        else:
            att = torch.zeros_like(V)
            for h in range(H):
                vh = V @ Wv[:, h * dh : (h + 1) * dh]
                att += torch.einsum("ij,jke->ike", A[h], vh) @ Wo[h * dh : (h + 1) * dh]
            R = att + V
            b_att = bv @ Wo + bo
        attn_out = torch.einsum("hij,jhe->ihe", A, (X @ Wv + bv).view(N, H, dh)).reshape(N, -1) @ Wo + bo
        pre1 = X + attn_out
        Z = ln_pieces(spread(R, b_att), pre1, att_mod.output.LayerNorm)
        z = att_mod.output.LayerNorm(pre1)
        W1, b1 = layer.intermediate.dense.weight.T, layer.intermediate.dense.bias
        W2, b2 = layer.output.dense.weight.T, layer.output.dense.bias
        u = z @ W1 + b1
        theta = layer.intermediate.intermediate_act_fn(u) / u
        Fz = spread((spread(Z @ W1, b1) * theta[:, None, :]) @ W2, b2)
        pre2 = z + layer.intermediate.intermediate_act_fn(u) @ W2 + b2
        V = ln_pieces(Z + Fz, pre2, layer.output.LayerNorm)
        X = layer.output.LayerNorm(pre2)
    Wp, bp = hf.bert.pooler.dense.weight.T, hf.bert.pooler.dense.bias
    v = X[0] @ Wp + bp
    P = spread(V[0:1] @ Wp, bp)[0] * (torch.tanh(v) / v)
    Wc, bc = hf.classifier.weight.T, hf.classifier.bias
    return spread((P @ Wc)[None], bc)[0].detach().numpy()


def test_post_ln_path_equals_the_official_algorithm(tokenizer):
    """Two layers of BERT, by the transcription of the official code: the same (n, C) parts."""
    m = tiny_model("bert", tokenizer)
    ids = torch.tensor([m.encode_input(TEXT).ids])
    with torch.no_grad():
        ref = _reference_bert(exact_eager_twin(m.hf), ids)
    ex = ctxmix.explain(m, None, ["decompx"], input_ids=ids[0].tolist())
    np.testing.assert_allclose(ex.logit_contributions["decompx"], ref.T, atol=1e-10)
    target = int(np.argmax(ref.sum(0)))
    assert ex.target == target
    np.testing.assert_allclose(ex.saliency["decompx"], ref[:, target], atol=1e-10)


def test_options(tokenizer):
    m = tiny_model("bert", tokenizer)
    lg = trace(m, TEXT).logits.double().numpy()
    tan = ctxmix.explain(m, TEXT, ["decompx"], decompx={"ff": "tangent"})
    np.testing.assert_allclose(tan.logit_contributions["decompx"].sum(1), lg, atol=1e-8)  # also complete
    zo = ctxmix.explain(m, TEXT, ["decompx"])
    assert np.abs(tan.saliency["decompx"] - zo.saliency["decompx"]).max() > 1e-6  # and different
    nob = ctxmix.explain(m, TEXT, ["decompx"], foil=0 if zo.target == 1 else 1, decompx={"bias": "none"})
    want = lg[nob.target] - lg[nob.foil]
    assert abs(nob.saliency["decompx"].sum() + nob.logit_terms["decompx"]["bias"] - want) < 1e-10
    assert abs(nob.logit_terms["decompx"]["bias"]) > 1e-6  # the biases are really left out
    headless = ctxmix.explain(m, TEXT, ["decompx"], decompx={"head": False})
    assert "decompx" not in headless.logit_contributions
    np.testing.assert_allclose(headless.saliency["decompx"], headless.global_maps["decompx"][-1][0])
    # the maps are the propagated norms, never rolled out again
    np.testing.assert_allclose(zo.global_maps["decompx"], headless.global_maps["decompx"])
    assert "decompx" not in zo.layer_maps
    with pytest.raises(BadInput, match="tangent"):
        ctxmix.explain(tiny_model("llama", tokenizer), TEXT, ["decompx"], decompx={"ff": "tangent"})
    with pytest.raises(BadInput, match="bias must be"):
        ctxmix.explain(m, TEXT, ["decompx"], decompx={"bias": "norm"})
    with pytest.raises(BadInput, match="no rule for the head"):
        ctxmix.explain(tiny_model("deberta", tokenizer), TEXT, ["decompx"])
    assert (
        "decompx"
        in ctxmix.explain(tiny_model("deberta", tokenizer), TEXT, ["decompx"], decompx={"head": False}).saliency
    )


def test_lm_target_and_foil(tokenizer):
    m = tiny_model("gpt2", tokenizer)
    ex = ctxmix.explain(m, TEXT, ["decompx", "logit"], foil=1000)
    tr = trace(m, TEXT)
    lg = tr.logits[-1].double()
    want = float(lg[ex.target] - lg[1000])
    assert ex.logit_contributions["decompx"].shape == (2, tr.n)
    assert abs(ex.saliency["decompx"].sum() - want) < 1e-9
    assert abs(ex.prediction["explained"]["value"] - want) < 1e-9


def test_float32_batched_and_saved(tokenizer, tmp_path):
    m64 = tiny_model("qwen2", tokenizer)
    m32 = ctxmix.model_from_hf(copy.deepcopy(m64.hf).float(), tokenizer, name="tiny-qwen2-float32")
    a = ctxmix.explain(m64, TEXT, ["decompx"], target=5)
    b = ctxmix.explain(m32, TEXT, ["decompx"], target=5)
    assert np.abs(a.saliency["decompx"] - b.saliency["decompx"]).max() < 1e-4 * np.abs(a.saliency["decompx"]).max()
    m = tiny_model("bert", tokenizer)
    texts = [TEXT, "a dog", "the cat that the dogs chase sleeps"]
    batch = ctxmix.explain_batch(m, texts, ["decompx"])
    for text, ex in zip(texts, batch):
        one = ctxmix.explain(m, text, ["decompx"])
        np.testing.assert_allclose(ex.logit_contributions["decompx"], one.logit_contributions["decompx"], atol=1e-10)
        np.testing.assert_allclose(ex.global_maps["decompx"], one.global_maps["decompx"], atol=1e-10)
    back = ctxmix.load_explanation(batch[0].save(tmp_path / "dx.npz"))
    np.testing.assert_array_equal(back.logit_contributions["decompx"], batch[0].logit_contributions["decompx"])
    np.testing.assert_array_equal(back.global_maps["decompx"], batch[0].global_maps["decompx"])


def test_ff_chunks_change_nothing_and_long_inputs_are_refused(tokenizer, monkeypatch):
    """The FF's row chunks (from the budget module, or given) only bound memory: one row per chunk equals
    the whole sequence in one chunk to rounding; and an input whose (n, n, d) pieces exceed the budget
    is refused before any work with the longest length that fits."""
    from ctxmix.engine import budget
    from ctxmix.methods import decompx as dx

    m = tiny_model("llama", tokenizer)
    text = "the keys to the old cabinet are on the table"
    ids = m.encode_input(text).ids
    tr = trace(m, text)
    one = decompx(m, tr, len(ids) - 1, [5, 6], DecompXOptions(chunk=1))
    whole = decompx(m, tr, len(ids) - 1, [5, 6], DecompXOptions(chunk=len(ids)))
    auto = decompx(m, tr, len(ids) - 1, [5, 6], DecompXOptions())
    for r in (one, auto):
        np.testing.assert_allclose(r.norms, whole.norms, rtol=0, atol=1e-12 * np.abs(whole.norms).max())
        np.testing.assert_allclose(r.parts, whole.parts, rtol=0, atol=1e-12 * np.abs(whole.parts).max())
    monkeypatch.setattr(budget, "memory_budget", lambda device: dx.pieces_bytes(m, 40))
    with pytest.raises(BadInput, match="inputs up to about 40 tokens"):
        ctxmix.explain(m, "word " * 60, ["decompx"])


def _advised(message: str) -> dict:
    """The decompx={...} a refusal advises, read literally from its message."""
    import ast
    import re

    found = re.findall(r"decompx=(\{[^}]*\})", message)
    assert found, f"no decompx={{...}} advice in: {message}"
    return ast.literal_eval(found[0])


def test_each_refusal_names_real_options_and_following_it_works(tokenizer, monkeypatch):
    """Every DecompX refusal (and the registry's caveat) advises a call that ctxmix accepts: the advised
    decompx={...} is read from the message and the same call made with it succeeds (the messages used to
    name decompx_head=False, decompx_bias and decompx_ff, which explain refuses as unknown options)."""
    from ctxmix.engine import budget
    from ctxmix.methods import decompx as dx
    from ctxmix.methods.registry import METHODS

    bert, llama, deberta = (tiny_model(f, tokenizer) for f in ("bert", "llama", "deberta"))
    with pytest.raises(BadInput, match="unknown option"):  # what the old advice led to
        ctxmix.explain(bert, TEXT, ["decompx"], decompx_head=False)
    cases = [
        (bert, {"bias": "norm"}),
        (bert, {"ff": "gelu"}),
        (bert, {"head": "no"}),
        (bert, {"heads": False}),
        (llama, {"ff": "tangent"}),
        (deberta, None),
    ]
    for m, given in cases:
        with pytest.raises(BadInput) as e:
            ctxmix.explain(m, TEXT, ["decompx"], decompx=given)
        ex = ctxmix.explain(m, TEXT, ["decompx"], decompx=_advised(str(e.value)))
        assert "decompx" in ex.saliency, (given, str(e.value))
    # the registry's caveat, on a model whose head has no rule
    assert "decompx" in ctxmix.explain(deberta, TEXT, ["decompx"], decompx=_advised(METHODS["decompx"].caveat)).saliency
    # options without the method: "add 'decompx' to the methods"
    with pytest.raises(BadInput, match="add 'decompx' to the methods"):
        ctxmix.explain(bert, TEXT, ["attention_flow"], decompx={"head": False})
    assert "decompx" in ctxmix.explain(bert, TEXT, ["attention_flow", "decompx"], decompx={"head": False}).saliency
    # too long for the memory budget: "inputs up to about N tokens fit", and N tokens do
    monkeypatch.setattr(budget, "memory_budget", lambda device: dx.pieces_bytes(bert, 40) + 1)
    ids = bert.encode_input("word " * 60).ids
    with pytest.raises(BadInput) as e:
        ctxmix.explain(bert, None, ["decompx"], input_ids=ids)
    import re

    fits = int(re.search(r"inputs up to about (\d+) tokens fit", str(e.value)).group(1))
    assert fits == 40
    assert "decompx" in ctxmix.explain(bert, None, ["decompx"], input_ids=ids[: fits - 1] + ids[-1:]).saliency


class _LivePeak(TorchDispatchMode):
    """The bytes of tensor storages allocated inside the mode and alive at once, at their peak: every aten
    op's outputs are seen; an output sharing an input's storage (a view, an in-place op) is no new
    allocation; a storage is freed when the last tensor seen on it dies. What a CUDA allocator's peak
    would count, on any device (RSS misses a buffer's pages until they are written)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = 0

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.now -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self.refs:
                self.refs[key] += 1
            elif key in ins or st.nbytes() == 0:
                continue
            else:
                self.refs[key], self.size[key] = 1, st.nbytes()
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize(
    "family,ff",
    [
        ("bert", "zero_origin"),
        ("bert", "tangent"),
        ("llama", "zero_origin"),
        ("gemma2", "zero_origin"),
        ("gpt_neox", "zero_origin"),
    ],
)
@pytest.mark.parametrize("rows", ["one", "all"])
def test_the_memory_check_counts_the_measured_peak(tokenizer, monkeypatch, family, ff, rows):
    """`pieces_bytes`, which the memory check compares with the budget, against the peak of the storages
    `decompx` really allocates (every aten op's outputs recorded): post-LN, pre-LN gated (GQA), sandwich
    and parallel layers, the FF in one chunk (the FF phase dominates) or a row per chunk (the attention
    phase does). At least the peak, and within 10 % above it: the count leaves out only tensors of n
    elements or (n, d)."""
    from ctxmix.methods import decompx as dx
    from ctxmix.methods import mixing

    if rows == "one":
        monkeypatch.setattr(mixing, "CHUNK_ELEMENTS", 1)
    m = tiny_model(family, tokenizer)
    tr = trace(m, " ".join(["the keys to the old cabinet are on the table"] * 4))
    t, tokens = (tr.n - 1, [5, 6]) if m.kind == "causal_lm" else (0, None)
    with _LivePeak() as p:
        decompx(m, tr, t, tokens, DecompXOptions(ff=ff))
    counted = dx.pieces_bytes(m, tr.n, ff)
    assert p.peak <= counted <= 1.1 * p.peak, (p.peak, counted, counted / p.peak)


def _spread(P, b):
    """AbsDot (DecompX's bias spread), written out again: b over each row's pieces P (c, n, D) by |<b, P_k>|."""
    if b is None:
        return P
    w = torch.einsum("ckd,d->ck", P, b).abs()
    return P + (w / (w.sum(-1, keepdim=True) + 1e-12))[..., None] * b


def _norm(P, real, w, b, eps, rms, one_plus=False):
    """A norm on pieces P (c, n, d) of rows whose real input is `real` (c, d), beta spread as DecompX spreads it."""
    gamma = 1 + w if one_plus else w
    if rms:
        return _spread(P / (real.pow(2).mean(-1, keepdim=True) + eps).sqrt()[:, None] * gamma, b)
    s = (real.var(-1, unbiased=False, keepdim=True) + eps).sqrt()[:, None]
    return _spread((P - P.mean(-1, keepdim=True)) / s * gamma, b)


def _reference_layer(family, layer, cfg, x, A, V):
    """One pre-LN / sandwich layer by ctxmix's rule for those shapes (`ctxmix.methods.decompx`), from the
    Hugging Face module's own weights: input pieces V (n, n, d) of the real input x (n, d), attention
    probabilities A (H, n, n) -> output pieces. LN1 on every attended position's pieces;
    b_att = sum_h (sum_j alpha) b_V^h W_O^h + b_O spread on attention + residual (the code's prior term; Gemma 2's
    sandwich: on the attention pieces, before LNa); LN2's beta, the FF's input biases and its output bias each
    spread where the FF adds them; a gated FF by the zero-baseline IG of act(g) * u (64-node Gauss-Legendre)."""
    at = layer.self_attn
    H, Hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    lin = lambda m, z: z @ m.weight.T + (m.bias if m.bias is not None else 0)  # noqa: E731
    if family == "opt":
        ln1, ln2 = layer.self_attn_layer_norm, layer.final_layer_norm
        norm = lambda m, P, real: _norm(P, real, m.weight, m.bias, m.eps, rms=False)  # noqa: E731
        real_norm = lambda m, z: m(z)  # noqa: E731
        o_proj = at.out_proj
    else:
        ln1 = layer.input_layernorm
        ln2 = layer.pre_feedforward_layernorm if family == "gemma2" else layer.post_attention_layernorm
        one = family == "gemma2"
        eps = lambda m: getattr(m, "eps", None) or m.variance_epsilon  # noqa: E731
        norm = lambda m, P, real: _norm(P, real, m.weight, None, eps(m), True, one)  # noqa: E731
        real_norm = lambda m, z: norm(m, torch.diag_embed(z.T).permute(1, 2, 0), z).sum(1)  # noqa: E731
        o_proj = at.o_proj
    n, d = x.shape
    dh = at.v_proj.weight.shape[0] // Hkv
    kv = lambda h: slice((h // (H // Hkv)) * dh, (h // (H // Hkv) + 1) * dh)  # noqa: E731
    Wv, bv, Wo, bo = at.v_proj.weight.T, at.v_proj.bias, o_proj.weight.T, o_proj.bias
    N1, x1 = norm(ln1, V, x), real_norm(ln1, x)
    a, attn = torch.zeros_like(V), torch.zeros_like(x)
    b_att = bo.expand(n, d).clone() if bo is not None else torch.zeros_like(x)
    for h in range(H):
        Wo_h = Wo[h * dh : (h + 1) * dh]
        a += torch.einsum("ij,jke->ike", A[h], N1 @ Wv[:, kv(h)]) @ Wo_h
        attn += A[h] @ (x1 @ Wv[:, kv(h)] + bv[kv(h)]) @ Wo_h
        b_att += A[h].sum(-1, keepdim=True) * (bv[kv(h)] @ Wo_h)
    attn = attn + (bo if bo is not None else 0)
    bb = lambda P, b: _spread_rows(P, b)  # noqa: E731
    if family == "gemma2":
        la = layer.post_attention_layernorm
        h_real = x + real_norm(la, attn)
        Hp = V + norm(la, bb(a, b_att), attn)
    else:
        h_real = x + attn
        Hp = bb(a + V, b_att)
    Z, z = norm(ln2, Hp, h_real), real_norm(ln2, h_real)
    if family == "opt":
        u = lin(layer.fc1, z)
        eta = _spread(Z @ layer.fc1.weight.T, layer.fc1.bias) * (torch.relu(u) / u)[:, None]
        F = _spread(eta @ layer.fc2.weight.T, layer.fc2.bias)
    else:
        mlp = layer.mlp
        g, up = lin(mlp.gate_proj, z), lin(mlp.up_proj, z)
        nodes, weights = np.polynomial.legendre.leggauss(64)
        al = torch.tensor((nodes + 1) / 2, dtype=x.dtype)[:, None, None]
        wt = torch.tensor(weights / 2, dtype=x.dtype)[:, None, None]
        xg = (al * g).requires_grad_(True)
        with torch.enable_grad():
            (dact,) = torch.autograd.grad(mlp.act_fn(xg).sum(), xg)
        I1, I2 = (wt * al * dact).sum(0), (wt * mlp.act_fn(al * g)).sum(0)
        gz = _spread(Z @ mlp.gate_proj.weight.T, mlp.gate_proj.bias)
        uz = _spread(Z @ mlp.up_proj.weight.T, mlp.up_proj.bias)
        eta = gz * (up * I1)[:, None] + uz * I2[:, None]
        F = _spread(eta @ mlp.down_proj.weight.T, mlp.down_proj.bias)
        if family == "gemma2":
            F = norm(layer.post_feedforward_layernorm, F, lin(mlp.down_proj, mlp.act_fn(g) * up))
    return Hp + F


def _spread_rows(P, b):
    """AbsDot with one bias per row: b (c, D) over the pieces P (c, n, D) of each row."""
    w = torch.einsum("ckd,cd->ck", P, b).abs()
    return P + (w / (w.sum(-1, keepdim=True) + 1e-12))[..., None] * b[:, None]


@pytest.mark.parametrize(
    "family,changes",
    [("opt", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("gemma2", {"attention_bias": True})],
)
def test_where_the_biases_go_beyond_bert(tokenizer, family, changes):
    """Pre-LN (OPT: LayerNorm, every bias), gated pre-LN (Llama with attention and MLP biases, GQA) and
    sandwich (Gemma 2 with attention biases): layer 2 from given input pieces equals that rule
    transcribed from the Hugging Face modules' own weights, token by token. Completeness holds wherever
    a bias is spread; this pins where: a bias spread on other pieces (the attention alone instead of
    attention + residual, after LNa instead of before, a forgotten spread) moves single tokens' parts."""
    from ctxmix.methods.decompx import decompx_layer

    m = tiny_variant(family, tokenizer, name=f"tiny-{family}-biased", **changes)
    ids = torch.tensor([m.encode_input(TEXT).ids])
    tr = trace(m, TEXT)
    with torch.no_grad():
        out = exact_eager_twin(m.hf)(input_ids=ids, output_attentions=True, output_hidden_states=True)
        o = DecompXOptions()
        V1 = decompx_layer(m.layers[0], tr.states[0], None, o)
        got = decompx_layer(m.layers[1], tr.states[1], V1, o)
        layers = m.hf.base_model.decoder.layers if family == "opt" else m.hf.base_model.layers
        want = _reference_layer(family, layers[1], m.hf.config, out.hidden_states[1][0], out.attentions[1][0], V1)
    # both sum to the layer's real output (HF's RMSNorm runs in float32 inside: 1e-6 of the state)
    scale = float(want.abs().max())
    np.testing.assert_allclose(want.sum(1), tr.states[1].y, atol=1e-6 * float(tr.states[1].y.abs().max()))
    # per token: float64 on both sides from the same inputs, apart from the float32 attention inputs
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * scale)
