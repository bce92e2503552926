"""One-pass context attribution beyond `logit` (`ctxmix.methods.context.onepass`, `context_grad`):
`alti_logit` against explain's per-token `alti_logit` towards the same target on every decoder family,
streamed against stored traces, `grad_x_input` against direct autograd, and explain's `target_kind`.
Tiny random float64 models of the real HF classes (tests/conftest.py)."""

import numpy as np
import pytest
import torch
from conftest import exact_eager_twin, tiny_model
from test_prediction import DECODERS  # every family explain's alti_logit supports

import ctxmix
from ctxmix.engine.attention import output_only
from ctxmix.errors import BadInput
from ctxmix.methods.prediction import unattributed

CONTEXT = "The cat sat on the mat. The code is 4817. Birds fly south in winter."
QUERY = "What is the code?"
RESPONSE = "the code is 4817"

# Hugging Face computes RMSNorm, OPT's final norm, Gemma's soft-cap and Llama-like softmaxes partly in float32 even
# in a float64 model (tests/test_prediction.py's FLOAT32_INSIDE)
FLOAT32_INSIDE = {"llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "opt"}


def _ca(m, methods, **kw):
    return ctxmix.attribute_context(m, CONTEXT, QUERY, response=RESPONSE, methods=methods, progress=False, **kw)


def _explain_rows(m, ca, method, kind):
    """(T, n) explain's saliency of `method` at each response row q_t = P - 1 + t towards response token t,
    on the whole prompt + response (the same trace as attribute_context's), target_kind=kind."""
    ids = ca.prompt_ids + ca.response_ids
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    rows, terms = [], []
    for t in range(T):
        q = P - 1 + t
        ex = ctxmix.explain(m, None, [method], input_ids=ids, position=q, target=ids[q + 1], target_kind=kind)
        rows.append(ex.saliency[method])
        terms.append(unattributed(ex.logit_terms[method]))
    return np.array(rows), np.array(terms)


@pytest.mark.parametrize("family", DECODERS)
def test_alti_logit_scores_are_explains_contributions(tokenizer, family):
    """A span's source scores equal the sum of explain's per-token alti_logit contributions towards the same
    target (T1, the default) at each target row, restricted to the source's tokens; sources + the parts of
    no source + the unattributed terms = the span's summed log-probability."""
    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["alti_logit", "logit"])
    assert ca.options["target"] == "log_prob"
    want, want_terms = _explain_rows(m, ca, "alti_logit", "log_prob")
    assert np.allclose(ca.per_token["alti_logit"], want, rtol=0, atol=1e-12 * np.abs(want).max())
    per_source = np.array([[row[toks].sum() for toks in ca.source_tokens] for row in want])  # (T, d)
    scale = np.abs(want).max()
    # both paths decompose the same float64 trace (explain's ALTI maps are the same rows): agreement to rounding;
    # the brief's bound, 1e-6 relative, holds with a wide margin
    assert np.allclose(ca.scores["alti_logit"], per_source.sum(0), rtol=1e-6, atol=1e-9 * scale)
    a, b = ca.token_range((4, 16))
    assert np.allclose(ca.scores_for("alti_logit", (4, 16)), per_source[a:b].sum(0), rtol=1e-6, atol=1e-9 * scale)
    got_terms = sum(v for v in ca.terms["alti_logit"].values())
    assert np.allclose(got_terms, want_terms, rtol=1e-9, atol=1e-9 * scale)
    bk = ca.buckets("alti_logit")
    parts = sum(v for k, v in bk.items() if k != "target")
    size = np.abs(ca.per_token["alti_logit"]).sum() + sum(np.abs(v).sum() for v in ca.terms["alti_logit"].values())
    # float64 throughout: rounding only; float32 inside the model (softmax, norms): the layers' sum telescopes to
    # ~2^-24 of the magnitudes summed, 1e-6 leaves a margin of ~16x (as test_logit_scores_are_explains_contributions)
    assert abs(parts - bk["target"]) <= (1e-6 if family in FLOAT32_INSIDE else 1e-9) * size
    ids = ca.prompt_ids + ca.response_ids
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    with torch.no_grad(), output_only(m):  # the model's forward as ctxmix's calls run it (gemma2: ctxmix's blocks)
        lp = torch.log_softmax(m.hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    lp = lp[torch.arange(P - 1, P + T - 1), torch.tensor(ca.response_ids)]
    assert bk["target"] == pytest.approx(float(lp.sum()), rel=1e-12)
    # ALTI only moves mass between positions (rows sum to one, or zero: untraced): the totals agree with logit's
    total = ca.per_token["alti_logit"].sum(1) + ca.terms["alti_logit"]["untraced"]
    assert np.allclose(total, ca.per_token["logit"].sum(1), rtol=0, atol=1e-9 * size)


@pytest.mark.parametrize("kind", ["log_prob", "logit_prob", "logit"])
def test_target_kinds_match_explain_and_the_model(tokenizer, kind):
    """The three targets: attribute_context's logit rows equal explain's with the same target_kind, and the
    explained quantity is log p (T1), log p - log(1 - p) (T2, ContextCite's per-token logit-probability) or
    the raw logit, from the model's own softmax."""
    m = tiny_model("gpt2", tokenizer)
    ca = _ca(m, ["logit"], target_kind=kind)
    want, want_terms = _explain_rows(m, ca, "logit", kind)
    assert np.allclose(ca.per_token["logit"], want, rtol=0, atol=1e-12 * np.abs(want).max())
    ids = ca.prompt_ids + ca.response_ids
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    with torch.no_grad():
        z = m.hf(input_ids=torch.tensor([ids])).logits[0].double()[P - 1 : P + T - 1]
    r = torch.tensor(ca.response_ids)
    lp = torch.log_softmax(z, -1)[torch.arange(T), r]
    expected = {"log_prob": lp, "logit_prob": lp - torch.log1p(-lp.exp()), "logit": z[torch.arange(T), r]}[kind]
    assert np.allclose(ca.targets["logit"], expected.numpy(), rtol=1e-12, atol=0)
    # the rows plus the unattributed terms are the target (GPT-2 is float64 throughout: rounding only)
    assert np.allclose(want.sum(1) + want_terms, expected.numpy(), rtol=1e-9, atol=1e-9)


def test_streamed_alti_logit_equals_the_stored_trace(tokenizer):
    """Above the memory share the trace is streamed (layers rebuilt one at a time, top-down): the same numbers."""
    from ctxmix.methods.context.onepass import run_one_pass

    m = tiny_model("llama", tokenizer)
    ca = _ca(m, ["attention"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    methods = ["logit", "alti_logit", "attention"]
    held = run_one_pass(m, methods, ids, P, "log_prob", streamed=False)
    streamed = run_one_pass(m, methods, ids, P, "log_prob", streamed=True)
    for k in methods:
        assert streamed[k]["cost"]["streamed"] and not held[k]["cost"]["streamed"]
        np.testing.assert_allclose(streamed[k]["per_token"], held[k]["per_token"], rtol=0, atol=1e-12)
        for name, v in held[k]["terms"].items():
            np.testing.assert_allclose(streamed[k]["terms"][name], v, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- grad x input


def _direct_grad_x_input(m, ids, P, source_tokens, span, kernel="fast"):
    """(d,) the sum over the span's response tokens (a, b) of grad x input of log p, per source, by autograd on
    the model run with attention `kernel` (ctxmix's "eager" or "fast"): one backward pass of the span's summed
    log-probability."""
    from ctxmix.engine.attention import ctxmix_pass

    a, b = span
    E = m.hf.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
    with torch.enable_grad(), ctxmix_pass(kernel=kernel):
        lp = torch.log_softmax(m.hf(inputs_embeds=E).logits[0].double(), -1)
        r = torch.tensor(ids[P:])
        lp = lp[torch.arange(P - 1, len(ids) - 1), r]
        (g,) = torch.autograd.grad(lp[a:b].sum(), E)
    gx = (g[0] * E[0].detach()).sum(-1).double().numpy()
    return np.array([gx[toks].sum() for toks in source_tokens]), lp.detach().numpy()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_grad_x_input_span_is_the_sum_of_its_gradients(tokenizer, family, attn, monkeypatch):
    """grad_x_input of a span equals grad x input of the span's summed log-probability, recomputed here with one
    backward pass through the same kernel; the stored per-token rows add up to it with no new pass (scores_for).
    Both kernels of the gradient pass (a long context gets SDPA)."""
    from ctxmix.methods.context import grad as context_grad

    monkeypatch.setattr(context_grad, "gradient_attention", lambda model, n: attn)
    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["grad_x_input"])
    assert ca.cost["grad_x_input"]["attention"] == attn
    ids, P, T = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids), len(ca.response_ids)
    assert ca.cost["grad_x_input"]["forward"] == 1 and ca.cost["grad_x_input"]["backward"] == T
    kernel = "eager" if attn == "eager" else "fast"
    full, lp = _direct_grad_x_input(m, ids, P, ca.source_tokens, (0, T), kernel)
    a, b = ca.token_range((4, 16))
    span, _ = _direct_grad_x_input(m, ids, P, ca.source_tokens, (a, b), kernel)
    # the same passes through the same kernel: what differs is the order of the sums (T per-token backward passes
    # added up against one backward of their sum). Each score is a sum over T rows and d dimensions of products of
    # the per-token rows' magnitudes, each gradient a sum of d-term products, so reassociation moves a score by at
    # most (T + 2 d) u of those magnitudes, u the unit roundoff of the arithmetic the backward runs in: float64
    # (GPT-2), float32 where the family computes in float32 inside a float64 model (Llama's RMSNorm and softmax)
    u = 2.0**-24 if family in FLOAT32_INSIDE else 2.0**-53
    per = np.abs(ca.per_token["grad_x_input"])
    mags = np.array([per[:, toks].sum() for toks in ca.source_tokens])
    tol = (T + 2 * m.hf.config.hidden_size) * u * mags
    np.testing.assert_array_less(np.abs(ca.scores["grad_x_input"] - full), tol)
    a_, b_ = ca.token_range((4, 16))
    span_mags = np.array([per[a_:b_, toks].sum() for toks in ca.source_tokens])
    got_span = ca.scores_for("grad_x_input", (4, 16))
    np.testing.assert_array_less(np.abs(got_span - span), (T + 2 * m.hf.config.hidden_size) * u * span_mags)
    np.testing.assert_allclose(ca.targets["grad_x_input"], lp, rtol=1e-12)
    assert np.ptp(full) > 1e-3  # something to compare
    bk = ca.buckets("grad_x_input")  # the gap makes the buckets add up; it is nobody's contribution
    assert sum(v for k, v in bk.items() if k != "target") == pytest.approx(bk["target"], rel=1e-12, abs=1e-12)


def test_grad_x_input_sums_are_directional_derivatives(tokenizer):
    """Not a decomposition of log p: a source's score is d/d lambda log P(span) with only that source's word
    embeddings scaled by lambda, at lambda = 1 (Euler), and the sum over every position is the same with all
    embeddings scaled. Central differences (h = 1e-4, float64, GPT-2 float64 throughout): truncation
    h^2 / 6 |f'''| ~ 1e-9 and rounding 1e-16 |f| / h ~ 1e-11, so 1e-6 absolute is a wide margin."""
    m = tiny_model("gpt2", tokenizer)
    ca = _ca(m, ["grad_x_input"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    E0 = m.hf.get_input_embeddings()(torch.tensor([ids])).detach()
    r = torch.tensor(ca.response_ids)

    def log_p(scale):
        with torch.no_grad():
            lp = torch.log_softmax(m.hf(inputs_embeds=E0 * scale[None, :, None]).logits[0].double(), -1)
        return float(lp[torch.arange(P - 1, len(ids) - 1), r].sum())

    h = 1e-4
    for i, toks in enumerate(ca.source_tokens):
        up, down = torch.ones(len(ids), dtype=E0.dtype), torch.ones(len(ids), dtype=E0.dtype)
        up[toks], down[toks] = 1 + h, 1 - h
        assert abs((log_p(up) - log_p(down)) / (2 * h) - ca.scores["grad_x_input"][i]) < 1e-6
    n = len(ids)
    d_all = (log_p(torch.full((n,), 1 + h, dtype=E0.dtype)) - log_p(torch.full((n,), 1 - h, dtype=E0.dtype))) / (2 * h)
    total = ca.per_token["grad_x_input"].sum()
    assert abs(d_all - total) < 1e-6
    assert abs(total - ca.targets["grad_x_input"].sum()) > 1e-3  # and that is not log P: no completeness


def test_grad_x_input_runs_with_sdpa_beyond_the_budget(tokenizer, monkeypatch):
    """Where eager's attention probabilities would take over half the memory budget, the gradient pass runs the
    fast kernel (SDPA: no n x n probabilities held for the backward); within the budget, the family's eager
    function. The kernel is this call's (`Pass.kernel`): the model's config never changes."""
    from ctxmix.engine.attention import current_pass
    from ctxmix.methods.context import grad as context_grad

    m = tiny_model("llama", tokenizer)
    seen = []
    real = m.hf.forward

    def spy(*a, **k):
        seen.append((current_pass().kernel, m.hf.config._attn_implementation))
        return real(*a, **k)

    monkeypatch.setattr(m.hf, "forward", spy)
    ca = _ca(m, ["grad_x_input"])
    assert ("eager", "ctxmix") in seen and ca.cost["grad_x_input"]["attention"] == "eager"
    n = len(ca.prompt_ids) + len(ca.response_ids)
    # 2 layers x 4 heads x n^2 float64 values, twice: just over half of this budget
    monkeypatch.setattr(context_grad, "memory_budget", lambda device: 2 * 2 * 2 * 4 * n * n * 8 - 2)
    seen.clear()
    ca = _ca(m, ["grad_x_input"])
    assert ("fast", "ctxmix") in seen and ("eager", "ctxmix") not in seen
    assert ca.cost["grad_x_input"]["attention"] == "sdpa" and m.hf.config._attn_implementation == "ctxmix"


# ---------------------------------------------------------------- explain's target_kind


def test_explain_target_kind_log_prob_and_refusals(tokenizer):
    m = tiny_model("gpt2", tokenizer)
    text = "the keys to the old cabinet are"
    plain = ctxmix.explain(m, text, ["logit", "alti_logit"])
    assert "target_kind" not in plain.options and "entropy" not in plain.logit_terms["logit"]
    ex = ctxmix.explain(m, text, ["logit", "alti_logit"], target_kind="log_prob")
    assert ex.options["target_kind"] == "log_prob" and ex.target == plain.target
    with torch.no_grad():
        lp = torch.log_softmax(m.hf(input_ids=torch.tensor([ex.input_ids])).logits[0, -1].double(), -1)
    for meth in ("logit", "alti_logit"):
        got = ex.saliency[meth].sum() + unattributed(ex.logit_terms[meth])
        assert got == pytest.approx(float(lp[ex.target]), rel=1e-9)
    assert ex.prediction["explained"]["value"] == pytest.approx(float(lp[ex.target]), rel=1e-12)
    with pytest.raises(BadInput, match="logit difference"):
        ctxmix.explain(m, text, ["logit"], foil=1000, target_kind="log_prob")
    assert any(
        "none was asked for" in w for w in ctxmix.explain(m, text, ["attention"], target_kind="log_prob").warnings
    )
    with pytest.raises(BadInput, match="logit difference"):
        ctxmix.explain_batch(m, [text, text], ["logit"], foils=[None, 1000], target_kind="log_prob")
    batch = ctxmix.explain_batch(m, [text, "the dog"], ["logit", "alti_logit"], target_kind="log_prob")
    for meth in ("logit", "alti_logit"):
        np.testing.assert_allclose(batch[0].saliency[meth], ex.saliency[meth], rtol=1e-9, atol=1e-12)
        assert batch[0].logit_terms[meth]["entropy"] == pytest.approx(ex.logit_terms[meth]["entropy"], rel=1e-12)
    with pytest.raises(BadInput, match="target_kind must be one of"):
        ctxmix.explain(m, text, ["logit"], target_kind="prob")


def test_context_methods_are_registered():
    for name in ("alti_logit", "grad_x_input"):
        info = ctxmix.CONTEXT_METHODS[name]
        assert info.group == "context" and info.paper and "Cost" in info.caveat


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("streamed", [False, True])
def test_trace_keeps_the_response_rows_logits_only(tokenizer, family, streamed):
    """trace_ids(logits_from=k) holds the logits of positions k.. n-1 only (the LM head on those rows), equal to
    the full trace's rows; `logits_at` reads them by position and refuses a row it did not keep."""
    from ctxmix.engine.trace import trace_ids

    m = tiny_model(family, tokenizer)
    ids = m.tokenizer("The cat sat on the mat and the dog sat too.")["input_ids"]
    full = trace_ids(m, ids, streamed=streamed)
    k = len(ids) - 4
    part = trace_ids(m, ids, streamed=streamed, logits_from=k)
    assert part.logits.shape[0] == 4 and part.logits_start == k
    rows = torch.arange(k, len(ids))
    # the same rows through the same head: only the matmul's blocking may differ (float64 model: ~1e-15)
    assert torch.allclose(part.logits_at(rows), full.logits[rows], rtol=0, atol=1e-9 * full.logits.abs().max())
    with pytest.raises(ValueError, match="from position"):
        part.logits_at(torch.tensor([k - 1]))
    with pytest.raises(ValueError, match="outside"):
        trace_ids(m, ids, logits_from=len(ids))


def test_kept_logits_cuts_a_model_that_returns_every_row():
    """A causal LM whose forward has no `logits_to_keep` returns all n rows: the trace cuts them itself."""
    from types import SimpleNamespace

    from ctxmix.engine.trace import _kept_logits

    lg = torch.arange(30.0).view(1, 6, 5)
    kept, start = _kept_logits(SimpleNamespace(logits=lg), 6, 4)
    assert start == 4 and torch.equal(kept, lg[0, 4:])
    kept, start = _kept_logits(SimpleNamespace(logits=lg[:, 4:]), 6, 4)  # the model kept them
    assert start == 4 and torch.equal(kept, lg[0, 4:])


@pytest.mark.parametrize("family", DECODERS)
def test_rows_trace_equals_the_full_trace(tokenizer, family, monkeypatch):
    """`logit` and `attention` read the response rows of `trace_rows` (one forward pass, no layer replayed, no
    n x n map held): the same per-token contributions, terms and targets as from a full stored trace, and a
    reconstruction error no larger than the full trace's (its rows are a subset of the full rebuild's)."""
    from ctxmix.engine import rows as rows_mod
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.context.onepass import run_one_pass

    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["attention"])
    ids = ca.prompt_ids + ca.response_ids
    P = len(ca.prompt_ids)
    used = []
    real = rows_mod.trace_rows
    monkeypatch.setattr(rows_mod, "trace_rows", lambda *a: used.append(1) or real(*a))
    fast = run_one_pass(m, ["logit", "attention"], ids, P, "log_prob")
    assert used == [1]  # the rows trace ran, not a fallback
    full = run_one_pass(m, ["logit", "attention"], ids, P, "log_prob", streamed=False)
    for meth in ("logit", "attention"):
        a, b = fast[meth]["per_token"], full[meth]["per_token"]
        # the same float64 sums in another association order ((alpha v) W_O against alpha (v W_O)): rounding only
        assert np.allclose(a, b, rtol=0, atol=1e-9 * np.abs(b).max()), meth
        for k, v in full[meth]["terms"].items():
            assert np.allclose(fast[meth]["terms"][k], v, rtol=0, atol=1e-9 * (np.abs(b).max() + np.abs(v).max()))
    full_tr = trace_ids(m, ids, streamed=False)
    rows = list(range(P - 1, len(ids) - 1))
    rt = real(m, ids, rows)
    assert rt.reconstruction_error <= full_tr.reconstruction_error * (1 + 1e-6) + 1e-12
    with pytest.raises(ValueError, match="full trace"):
        from ctxmix.methods.context.onepass import decompose_rows

        decompose_rows(m, rt, rows, ids[P:], "log_prob", ("alti_logit",))


BF16_UNIT_ROUNDOFF = 2.0**-8  # bfloat16: 8 significand bits
F32_UNIT_ROUNDOFF = 2.0**-24


def _layer_outputs_and_readouts(m16, ca, target):
    """Independently of ctxmix, from the bf16 Llama's own forward pass (float64 afterwards): each layer's
    output h^{l+1} at the predicting rows q_t (L, T, d) and the readout rho_t (T, d) of each response token's
    target through the final RMSNorm at the real scale: gamma * (u_r - sum_v p_v u_v) / rms(h^L) (log_prob)
    or gamma * u_r / rms(h^L) (logit), p the softmax of the logits recomputed in float64."""
    hf = m16.hf
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    rows = torch.arange(P - 1, P - 1 + T)
    outs = []
    hooks = [
        layer.register_forward_hook(lambda mod, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].double()))
        for layer in hf.model.layers
    ]
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([ca.prompt_ids + ca.response_ids]))
    finally:
        for h in hooks:
            h.remove()
    gamma, eps = hf.model.norm.weight.double(), hf.model.norm.variance_epsilon
    W = hf.lm_head.weight.double()
    x = outs[-1][rows]
    s = torch.sqrt((x**2).mean(-1, keepdim=True) + eps)
    u_r = W[torch.tensor(ca.response_ids)]
    if target == "log_prob":
        u_r = u_r - torch.softmax((x / s * gamma) @ W.T, -1) @ W
    return torch.stack([h[rows] for h in outs]), gamma * u_r / s


@pytest.mark.parametrize("target", ["log_prob", "logit"])
def test_bf16_buckets_add_up_to_the_float32_target(tokenizer, target):
    """A bf16 tiny Llama (the real HF class) against the same rounded weights in float32. The buckets add up to
    their target to float32 rounding (they missed it by 6e-3 on this model: the target was read from the
    model's bf16 logits and the model's rounding of each layer's output was nowhere); that target is the float32
    model's within the bf16 rounding bound, as is the "half_precision" bucket.

    Bounds: float32 sums over the n positions and d features of each token, u32 (n + d) sum_k |b_k|; bf16: each
    layer writes to the residual stream through four roundings (attention output, its residual sum, FF output,
    its residual sum), each at most u16 = 2^-8 of an element of that size, read on rho:
    4 u16 sum_l sum_i |h^{l+1}_{q_t i} rho_{t i}| per token t (both measured at 0.4 u16 of that sum on this model)."""
    import copy

    m16 = tiny_model("llama", tokenizer, dtype=torch.bfloat16)
    m32 = ctxmix.model_from_hf(copy.deepcopy(m16.hf).to(torch.float32), tokenizer, name=m16.name)
    kw = dict(methods=["logit", "alti_logit", "at2_exact"], target_kind=target, at2_weights="untrained")
    ca16, ca32 = _ca(m16, **kw), _ca(m32, **kw)
    assert ca16.response_ids == ca32.response_ids
    h, rho = _layer_outputs_and_readouts(m16, ca16, target)
    S = (h.abs() * rho.abs()).sum((0, 2)).numpy()  # (T,) sum over layers and features
    n, d = len(ca16.prompt_ids) + len(ca16.response_ids), h.shape[-1]
    for method in ("logit", "alti_logit", "at2_exact"):
        b = ca16.buckets(method)
        parts = {k: v for k, v in b.items() if k != "target"}
        f32_bound = F32_UNIT_ROUNDOFF * (n + d) * sum(abs(v) for v in parts.values())
        assert abs(sum(parts.values()) - b["target"]) <= f32_bound, (method, sum(parts.values()) - b["target"])
        if method == "at2_exact":  # a scale-free estimator: no model quantity to compare
            continue
        bf16_bound = 4 * BF16_UNIT_ROUNDOFF * S
        assert np.all(np.abs(ca16.targets[method] - ca32.targets[method]) <= bf16_bound)
        assert np.all(np.abs(ca16.terms[method]["half_precision"]) <= bf16_bound)
        assert "half_precision" not in ca32.terms[method]


def _reference_layer_rows(m, ids: list[int], P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `logit` and `alti_logit` are built from, transcribed in float64 from Ferrando et al. (ACL 2023 for
    the logit contributions, EMNLP 2022 for ALTI) with loops over tokens, layers and heads, reading only the HF
    Llama's weights, its layer inputs x^l and its attention probabilities (no ctxmix code). For response token t
    at row q = P - 1 + t with target r: rho = gamma_final * u_r / rms(x^L_q) (the final RMSNorm's scale
    frozen) and D[l, t, j] = sum_h alpha^{l,h}_{q j} <W_O^h W_V^{kv(h)} (gamma_l * x^l_j / rms(x^l_j)), rho>;
    emb[t] = <x^0_q, rho> (the predicted position's own embedding, at column q). ALTI's map of layer l (n, n):
    T_ij = sum_h alpha^{l,h}_{ij} W_O^h W_V^{kv(h)} x1_j (+ x^l_i at j = i), y_i = sum_j T_ij (the stream after
    the attention block), C_ij = max(0, |y_i|_1 - |y_i - T_ij|_1) normalised over j. x^L_q is the top layer
    recomputed here in float64 from its input (HF runs RMSNorm in float32 even in a float64 model).
    Returns D (L, T, n), emb (T,), C (L, n, n)."""
    hf = m.hf
    cfg = hf.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    with torch.no_grad():  # exact float64 eager attention (HF's own Llama code otherwise), every probability
        out = exact_eager_twin(hf)(input_ids=torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    xs = [h[0].double() for h in out.hidden_states[: cfg.num_hidden_layers]]  # layer inputs x^0 .. x^{L-1}
    n, T = len(ids), len(ids) - P

    def rmsnorm(norm, v):
        return norm.weight.double() * v / torch.sqrt((v**2).mean(-1, keepdim=True) + norm.variance_epsilon)

    def pieces(layer, x, alpha, q):
        """(H, n, d): alpha^h_{q j} W_O^h W_V^{kv(h)} x1_j, each head's update of row q split over positions."""
        x1 = rmsnorm(layer.input_layernorm, x)
        rows = []
        for h in range(H):
            g = h // (H // KV)
            Wv = layer.self_attn.v_proj.weight[g * dh : (g + 1) * dh].double()  # (dh, d)
            Wo = layer.self_attn.o_proj.weight[:, h * dh : (h + 1) * dh].double()  # (d, dh)
            rows.append(alpha[0, h, q].double()[:, None] * torch.stack([Wo @ (Wv @ x1[j]) for j in range(n)]))
        return torch.stack(rows)

    C = np.zeros((len(xs), n, n))
    for l, (layer, x, alpha) in enumerate(zip(hf.model.layers, xs, out.attentions)):
        for i in range(n):
            Tij = pieces(layer, x, alpha, i).sum(0)  # (n, d)
            Tij[i] += x[i]
            y = Tij.sum(0)
            c = (y.abs().sum() - (y - Tij).abs().sum(-1)).clamp(min=0)
            C[l, i] = (c / c.sum()).numpy()
    top, mlp = hf.model.layers[-1], hf.model.layers[-1].mlp
    D, emb = np.zeros((len(xs), T, n)), np.zeros(T)
    for t in range(T):
        q, r = P - 1 + t, ids[P + t]
        x_mid = xs[-1][q] + pieces(top, xs[-1], out.attentions[-1], q).sum((0, 1))
        x2 = rmsnorm(top.post_attention_layernorm, x_mid)
        gate, up = mlp.gate_proj.weight.double() @ x2, mlp.up_proj.weight.double() @ x2
        x_top = x_mid + mlp.down_proj.weight.double() @ (torch.nn.functional.silu(gate) * up)
        scale = torch.sqrt((x_top**2).mean() + hf.model.norm.variance_epsilon)
        rho = hf.model.norm.weight.double() * hf.lm_head.weight[r].double() / scale
        for l, (layer, x, alpha) in enumerate(zip(hf.model.layers, xs, out.attentions)):
            D[l, t] = (pieces(layer, x, alpha, q) @ rho).sum(0).numpy()
        emb[t] = float(xs[0][q] @ rho)
    return D, emb, C


def test_logit_and_alti_logit_rows_equal_a_float64_transcription(tokenizer):
    """`logit` (read from the rows trace) and `alti_logit` (the full trace, Horner form) against the float64
    loops above on a tiny Llama (GQA, random norms), target="logit": every response token's contribution of
    every position, logit = sum_l D^l + emb, alti_logit = sum_l D^l C^{l-1} ... C^0 + emb. They were checked
    only against explain and the full trace (ctxmix both). Shown to fail under deliberate mutations of code
    explain and these methods share: ctxmix.engine.layer.head_values repeating the value heads as a block
    (query head h reading value head h % Hkv, `torch.cat`) instead of interleaved (h // (H / Hkv),
    `repeat_interleave`), ctxmix.methods.readout.norm_adjoint returning `g` instead of `g / s` (no final-norm
    scale), and (alti_logit alone) ctxmix.engine.layer.alti_layer without its clamp at 0 (which the comparisons
    with explain and the stored trace pass). Tolerance: float64
    rounding, 2^-52 x (d + n) x the largest |contribution| x the L H terms summed (both sides read the same HF
    probabilities and layer inputs)."""
    m = tiny_model("llama", tokenizer)
    ca = _ca(m, ["logit", "alti_logit"], target_kind="logit")
    P = len(ca.prompt_ids)
    D, emb, C = _reference_layer_rows(m, ca.prompt_ids + ca.response_ids, P)
    L, T, n = D.shape
    cols = (np.arange(T), np.arange(P - 1, P - 1 + T))
    logit = D.sum(0)
    logit[cols] += emb
    alti = D[0].copy()
    for l in range(1, L):  # D^l traced back through C^{l-1} ... C^0
        back = D[l]
        for k in reversed(range(l)):
            back = back @ C[k]
        alti += back
    alti[cols] += emb
    H, d = m.hf.config.num_attention_heads, m.hf.config.hidden_size
    for method, want in (("logit", logit), ("alti_logit", alti)):
        got = ca.per_token[method]
        assert got.shape == want.shape and np.abs(want).max() > 0.1
        tol = 2.0**-52 * (d + n) * L * H * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=method)
    assert np.abs(alti - logit).max() > 0.01  # the ALTI maps moved something: two distinct checks


def _rows_and_full(m, ids, P):
    """`logit` and `attention` from the rows trace and from a full stored trace (tests above)."""
    from ctxmix.methods.context.onepass import run_one_pass

    fast = run_one_pass(m, ["logit", "attention"], ids, P, "log_prob")
    full = run_one_pass(m, ["logit", "attention"], ids, P, "log_prob", streamed=False)
    return fast, full


@pytest.mark.parametrize("family", DECODERS)
def test_rows_trace_forms_no_n_by_n_map(tokenizer, family, monkeypatch):
    """With blocks of 3 query rows (a budget of 3 rows' scores), the rows trace's probabilities are computed for
    at most 3 query rows at a time, and only for the asked rows, while n is several times that; every output
    comes from SDPA (no probabilities), or, for gemma2's soft-capped logits that SDPA refuses, from ctxmix's own
    probabilities times the values by blocks of at most 3 rows: no (H, n, n) map in any family (sliding windows:
    mistral, gemma2, gemma3 with a window of 4 < n). The numbers are the full trace's (float64 throughout: SDPA's
    and ctxmix's float64 softmax, association order only)."""
    from transformers.integrations import sdpa_attention

    from ctxmix.engine import attention as att
    from ctxmix.engine import rows as rows_mod

    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["attention"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    n = len(ids)
    # bytes per query row of a block: copies x element size x heads x keys
    monkeypatch.setattr(att, "ATTENTION_CHUNK_BYTES", 3 * att._SCORE_COPIES * 8 * m.n_heads * n)
    assert att.query_block_rows(m.n_heads, n, 8) == 3 and n > 6
    kept, eager_rows, sdpa = [], [], []
    real_probs, real_softmax, real_sdpa = (
        att.block_probs,
        torch.nn.functional.softmax,
        sdpa_attention.sdpa_attention_forward,
    )

    def probs(*a, **k):
        p = real_probs(*a, **k)
        kept.append(tuple(p.shape))
        return p

    monkeypatch.setattr(att, "block_probs", probs)

    def spy(x, *a, **k):
        if x.dim() == 4:
            eager_rows.append(tuple(x.shape))
        return real_softmax(x, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "softmax", spy)
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: sdpa.append(1) or real_sdpa(*a, **k))
    rt = rows_mod.trace_rows(m, ids, list(range(P - 1, n - 1)))
    monkeypatch.setattr(torch.nn.functional, "softmax", real_softmax)
    T = n - P
    assert max(s[-2] for s in kept) <= 3, kept[:3]
    assert not eager_rows  # no family eager function ran over any rows
    if family == "gemma2":  # the outputs too come from ctxmix's probabilities, by blocks of rows
        assert sum(s[-2] for s in kept) == m.n_layers * (T + n) and not sdpa
    else:
        assert sum(s[-2] for s in kept) == m.n_layers * T  # the asked rows, and only those
        assert len(sdpa) == m.n_layers
    assert rt.states[0].alpha.shape == (m.n_heads, T, n)
    assert float(rt.states[0].alpha.triu(diagonal=P).abs().max()) == 0.0  # row q_t = P - 1 + t: no later key
    fast, full = _rows_and_full(m, ids, P)
    for meth in ("logit", "attention"):
        a, b = fast[meth]["per_token"], full[meth]["per_token"]
        assert np.allclose(a, b, rtol=0, atol=1e-9 * np.abs(b).max()), meth
    np.testing.assert_allclose(fast["logit"]["target"], full["logit"]["target"], rtol=1e-12)


def test_rows_attention_keeps_sinks_and_sliding_window_rows(monkeypatch):
    """gpt-oss's attention (learned sinks per head, a sliding window, GQA): no ctxmix family has sinks, so ctxmix's
    attention function is checked on the module itself against its family's eager function over all rows: the
    same output (SDPA ignores sinks: the family's eager function runs by blocks of 2 rows) and the same
    probabilities of the asked rows (float64 rounding of sums in another blocking: 1e-12 relative)."""
    import transformers as T
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

    from ctxmix.engine import attention as att

    torch.manual_seed(0)
    cfg = T.GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        sliding_window=4,
        num_local_experts=2,
        intermediate_size=16,
        vocab_size=100,
    )
    module = GptOssAttention(cfg, 0).double().eval().requires_grad_(False)
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4, dtype=torch.float64))
    n, H, dh = 11, 4, 8
    q, k, v = torch.randn(1, H, n, dh, dtype=torch.float64), *torch.randn(2, 1, 2, n, dh, dtype=torch.float64)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    zero, low = torch.zeros((), dtype=torch.float64), torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64)
    rows = [3, 4, 9, 10]
    monkeypatch.setattr(att, "ATTENTION_CHUNK_BYTES", 2 * att._SCORE_COPIES * 8 * H * n)
    # eager's additive masks and SDPA's boolean ones: causal with a window of 4 (the blocks drop the later keys),
    # and one that opens later keys too (they must not)
    for allowed in ((j <= i) & (i - j < 4), (i - j).abs() < 4):
        additive = torch.where(allowed, zero, low)[None, None]
        want_out, want_p = eager_attention_forward(
            module, q, k, v, additive, scaling=module.scaling, s_aux=module.sinks
        )
        for mask in (additive, allowed[None, None]):
            req = att.Rows(rows, [None], {module: 0})
            with att.ctxmix_pass(rows=req):
                out, none = att.ctxmix_attention(module, q, k, v, mask, scaling=module.scaling, s_aux=module.sinks)
            assert none is None and out.shape == want_out.shape == (1, n, H, dh)
            torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(req.slots[0][0], want_p[0][:, rows], rtol=1e-12, atol=1e-14)
        assert float(want_p[0].sum(-1).min()) < 0.99  # the sinks took mass: something to check
        assert float(want_p[0, :, 10, :7].abs().max()) == 0.0  # and the window cut the early keys
    assert float(want_p[0, :, 3, 4:7].min()) > 0  # the second mask opened later keys


def test_bf16_rows_trace_is_within_bf16_rounding_of_the_full_trace(tokenizer, monkeypatch):
    """A bf16 tiny Llama through the rows trace (its attention by blocks of 2 query rows, so the bf16 roundings
    fall elsewhere than in one eager call): `logit`'s targets are within the bf16 bound of the float32 model's,
    4 u16 sum_l sum_i |h^{l+1}_{q_t i} rho_{t i}| (`test_bf16_buckets_add_up_to_the_float32_target`), hence
    within twice that of the full trace's on the same bf16 model; so is the "half_precision" term; and the
    buckets add up to their target to float32 rounding, as the full trace's do."""
    import copy

    from ctxmix.engine import rows as rows_mod
    from ctxmix.methods.context.onepass import run_one_pass

    m16 = tiny_model("llama", tokenizer, dtype=torch.bfloat16)
    m32 = ctxmix.model_from_hf(copy.deepcopy(m16.hf).to(torch.float32), tokenizer, name=m16.name)
    used = []
    real = rows_mod.trace_rows
    monkeypatch.setattr(rows_mod, "trace_rows", lambda *a: used.append(1) or real(*a))
    ca16, ca32 = _ca(m16, ["logit"], target_kind="logit"), _ca(m32, ["logit"], target_kind="logit")
    ids, P = ca16.prompt_ids + ca16.response_ids, len(ca16.prompt_ids)
    n = len(ids)
    from ctxmix.engine import attention as att

    monkeypatch.setattr(att, "ATTENTION_CHUNK_BYTES", 2 * att._SCORE_COPIES * 4 * m16.n_heads * n)
    assert ca16.response_ids == ca32.response_ids and used
    rows16 = run_one_pass(m16, ["logit"], ids, P, "logit")["logit"]
    full16 = run_one_pass(m16, ["logit"], ids, P, "logit", streamed=False)["logit"]
    assert len(used) == 3  # attribute_context twice, then run_one_pass: the rows trace each time
    h, rho = _layer_outputs_and_readouts(m16, ca16, "logit")
    bound = 4 * BF16_UNIT_ROUNDOFF * (h.abs() * rho.abs()).sum((0, 2)).numpy()  # (T,)
    assert np.all(np.abs(rows16["target"] - ca32.targets["logit"]) <= bound)
    assert np.all(np.abs(rows16["target"] - full16["target"]) <= 2 * bound)
    assert np.all(np.abs(rows16["terms"]["half_precision"]) <= bound)
    parts = rows16["per_token"].sum(1) + sum(rows16["terms"].values())
    scale = np.abs(rows16["per_token"]).sum(1) + sum(np.abs(v) for v in rows16["terms"].values())
    assert np.all(np.abs(parts - rows16["target"]) <= F32_UNIT_ROUNDOFF * (n + h.shape[-1]) * scale)


_ROWS_MEMORY_CHILD = """
import json, sys
import numpy as np, torch, transformers as T
import ctxmix
from ctxmix.engine.rows import trace_rows

def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))

n, heads = 2048, 32
torch.manual_seed(0)
cfg = T.LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=heads,
                    num_key_value_heads=heads, intermediate_size=512, max_position_embeddings=n)
hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
m = ctxmix.model_from_hf(hf, T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path()))
ids = np.random.RandomState(0).randint(0, 1024, n).tolist()
trace_rows(m, ids[:64], list(range(56, 63))).reconstruction_error  # warm up at a small size
open("/proc/self/clear_refs", "w").write("5")  # the peak resident memory from here on
before = kib("VmRSS")
err = trace_rows(m, ids, list(range(n - 9, n - 1))).reconstruction_error  # every layer built
print(json.dumps({"extra": (kib("VmHWM") - before) * 1024, "err": err}))
"""


@pytest.mark.slow
def test_rows_trace_memory_is_far_below_one_attention_map():
    """A float32 random Llama with 32 heads (d 256, 2 layers) on 2,048 tokens, in a fresh process: the rows trace
    (forward pass and every layer built) holds less than a quarter of one (H, n, n) float32 map (512 MiB) over
    what the process held before. Its parts: one block of scores (`ATTENTION_CHUNK_BYTES`, 64 MiB), eager's (1, 1,
    n, n) float32 mask (16 MiB), L + 1 hidden states and one layer's activations (~10 MiB). The previous rows
    trace ran eager attention over all rows: two or three such maps at once (1.07 GiB measured)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]  # this checkout's ctxmix
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", _ROWS_MEMORY_CHILD], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    one_map = 32 * 2048 * 2048 * 4
    assert got["extra"] < one_map / 4, got["extra"] / 2**20
    assert got["err"] < 1e-4  # the layers rebuilt right: float32 sums over d = 256 of states ~1, 256 x 2^-24 = 2e-5


def test_share_trace_false_gives_the_rows_methods_their_own_pass(tokenizer, monkeypatch):
    """share_trace=False (the benchmark's time columns): logit and attention run on their own rows pass, not on
    alti_logit's full trace, so each method's seconds are its own; the scores are the same either way."""
    from ctxmix.engine import rows as engine_rows
    from ctxmix.methods.context import onepass

    m = tiny_model("llama", tokenizer)
    methods = ["logit", "attention", "alti_logit"]
    calls = []
    for mod, name in ((onepass, "trace_ids"), (engine_rows, "trace_rows")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    shared = _ca(m, methods)
    assert calls == ["trace_ids"]  # one full trace for all three
    calls.clear()
    alone = _ca(m, methods, share_trace=False)
    assert sorted(calls) == ["trace_ids", "trace_rows"]
    for meth in methods:
        assert np.allclose(alone.scores[meth], shared.scores[meth], rtol=1e-9, atol=1e-12), meth
        assert alone.cost[meth]["seconds"] > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "mistral"])
def test_float32_rows_trace_is_within_the_derived_bound_of_the_full_trace(tokenizer, family):
    """In float32 the rows trace and the full trace run the same kernel on the same inputs (the same hidden
    states, bit for bit) and keep probabilities computed from the same dot products in another blocking: a
    contribution, a sum of probability-weighted head vectors, moves by at most (d_h + n + d) u of its magnitude,
    u = 2^-24 (docs/correctness.md, "The reference is the model's own forward"). Measured: ~3 u."""
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    ca = _ca(m, ["attention"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    fast, full = _rows_and_full(m, ids, P)
    dh = m.hf.config.hidden_size // m.n_heads
    bound = (dh + len(ids) + m.hf.config.hidden_size) * 2.0**-24
    for meth in ("logit", "attention"):
        a, b = fast[meth]["per_token"], full[meth]["per_token"]
        assert np.abs(a - b).max() <= bound * np.abs(b).max(), meth
