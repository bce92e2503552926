"""`key_mask_grad` and `key_mask_ig` (`ctxmix.methods.context.keymask`): the gradient against finite differences of
gated forward passes, the gate at 0 against masking the keys with the model's own attention mask, the integrated
gradient's completeness, the SDPA path against eager on several families, and the methods through
attribute_context, evaluate, save/load, extend and the page. Tiny random float64 models of the real HF classes
(tests/conftest.py)."""

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_variant
from test_context_page import _env, _ok, _page, tiny_lm_dir  # noqa: F401 (fixtures)

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.context import keymask as km

CONTEXT = "The cat sat on the mat. The code is 4817. Birds fly south in winter. The sun was warm today."
QUERY = "What is the code?"
RESPONSE = "the code is 4817"
U = 2.0**-24  # float32 unit roundoff (the float32 softmax of the Llama-like families in a float64 model)
FLOAT32_INSIDE = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "gpt_neox",
}  # float32 softmax


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    return tiny_model("gpt2", tokenizer)  # float64 throughout: rounding is float64's


def _ca(m, methods, **kw):
    kw.setdefault("prompt", {"query_suffix": ""})  # the query as is: the sources' effect these checks were sized on
    return ctxmix.attribute_context(m, CONTEXT, QUERY, response=RESPONSE, methods=methods, progress=False, **kw)


def _log_p(m, ids, P, gates: torch.Tensor, impl=km.KEYMASK_EAGER) -> float:
    """log P(response) of a forward pass with per-key gates (n,) (no gradient)."""
    with torch.no_grad():
        return float(km.gated_log_probs(m, ids, P, km.log_bias(gates), impl).sum())


def _gates(n: int, keys, value: float) -> torch.Tensor:
    g = torch.ones(n, dtype=torch.float64)
    g[list(keys)] = value
    return g


def test_key_mask_grad_equals_finite_differences_of_gated_passes(gpt2):
    """score_s = d log P / d a_s at a = 1 against differences of real forward passes with source s's gate moved:
    one-sided, (log P(a_s = 1) - log P(a_s = 1 - eps)) / eps, and central. Each difference's own error is
    estimated from the data (Richardson: one-sided error c eps + O(eps^2), so err(eps) ~ 2 |D(eps) - D(eps/2)|,
    a margin of 1.25 for the O(eps^2) part; central O(eps^2), err ~ 4/3 |D(eps) - D(eps/2)|), plus float64
    rounding of the two log P (~60 in size, 2^-52 relative, ~10^3 operations) divided by the step."""
    ca = _ca(gpt2, ["key_mask_grad"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    n = len(ids)
    logP = ca.targets["key_mask_grad"].sum()
    assert ca.cost["key_mask_grad"]["forward"] == 1 and ca.cost["key_mask_grad"]["backward"] == 1
    assert _log_p(gpt2, ids, P, torch.ones(n, dtype=torch.float64)) == pytest.approx(logP, rel=1e-14)
    eps = 1e-3
    rounding = 2 * abs(logP) * 1e3 * 2.0**-52 / (eps / 2)
    for s, keys in enumerate(ca.source_tokens):
        score = ca.scores["key_mask_grad"][s]
        at = {h: _log_p(gpt2, ids, P, _gates(n, keys, 1 + h)) for h in (eps, eps / 2, -eps, -eps / 2)}
        o1, o2 = (logP - at[-eps]) / eps, (logP - at[-eps / 2]) / (eps / 2)
        assert abs(o1 - score) <= 2.5 * abs(o1 - o2) + rounding, (s, score, o1, o2)
        c1, c2 = (at[eps] - at[-eps]) / (2 * eps), (at[eps / 2] - at[-eps / 2]) / eps
        assert abs(c2 - score) <= 4 / 3 * abs(c1 - c2) + rounding, (s, score, c1, c2)
    assert np.abs(ca.scores["key_mask_grad"]).max() > 1e-3  # not vacuous


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("impl", [km.KEYMASK_EAGER, km.KEYMASK_SDPA])
def test_gate_at_zero_is_masking_the_keys(tokenizer, family, impl):
    """a_s = 0 through the gate equals AT2's masking: a pass whose attention mask (the model's own, 2-D) zeroes
    source s's key positions for every query. The response rows' log-probabilities agree to float64 rounding
    (eager; SDPA to the float32 softmax of the eager reference where the family has one): a masked key's weight
    is exactly 0 either way."""
    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["logit"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    n = len(ids)
    keys = ca.source_tokens[1]
    with torch.no_grad():
        gated = km.gated_log_probs(m, ids, P, km.log_bias(_gates(n, keys, 0.0)), impl)
        mask = torch.ones((1, n), dtype=torch.long)
        mask[0, keys] = 0
        z = m.hf(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0, P - 1 : -1].double()
        masked = torch.log_softmax(z, -1)[torch.arange(n - P), torch.tensor(ids[P:])]
        unmasked = km.gated_log_probs(m, ids, P, torch.zeros(n, dtype=torch.float64), impl)
    size = float(masked.abs().max())
    tol = (64 * U if family in FLOAT32_INSIDE else 1e-12) * size
    np.testing.assert_allclose(gated.numpy(), masked.numpy(), rtol=0, atol=tol)
    assert float((unmasked - masked).abs().max()) > 1e3 * tol  # masking the source changes the response's log p


@pytest.mark.parametrize("K", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_key_mask_ig_completeness(gpt2, K):
    """With many levels the integrated gradient's sum over sources is log P(all kept) - log P(all sources masked),
    both measured by forward passes, within the midpoint rule's error: O(1/K^2), estimated from K and K/2
    (err(K) ~ |S_{K/2} - S_K| / 3), plus float64 rounding."""
    ca64 = _ca(gpt2, ["key_mask_ig"], key_mask_levels=K)
    ca32 = _ca(gpt2, ["key_mask_ig"], key_mask_levels=K // 2)
    ids, P = ca64.prompt_ids + ca64.response_ids, len(ca64.prompt_ids)
    n = len(ids)
    gated = [j for t in ca64.source_tokens for j in t]
    delta = _log_p(gpt2, ids, P, torch.ones(n, dtype=torch.float64)) - _log_p(gpt2, ids, P, _gates(n, gated, 0.0))
    s64, s32 = ca64.scores["key_mask_ig"].sum(), ca32.scores["key_mask_ig"].sum()
    assert abs(delta) > 0.1  # the sources matter
    assert abs(s64 - delta) <= 2 * abs(s32 - s64) / 3 + 1e-10 * abs(delta), (s64, s32, delta)
    assert abs(s64 - delta) < abs(s32 - delta)  # converging
    assert ca64.cost["key_mask_ig"]["backward"] == K and ca64.cost["key_mask_ig"]["forward"] == K + 2
    assert ca64.cost["key_mask_ig"]["levels"] == km.default_levels(K)
    # the buckets: sources + the masked baseline + the Riemann error = log P; keys off the path carry nothing
    bk = ca64.buckets("key_mask_ig")
    assert bk["all_sources_masked"] == pytest.approx(bk["target"] - delta, rel=1e-12)
    assert bk["sources"] + bk["all_sources_masked"] + bk["integration_error"] == pytest.approx(bk["target"], rel=1e-12)
    assert bk["template"] == bk["query"] == bk["response"] == 0.0


def test_key_mask_grad_keys_sum_to_zero_and_buckets_add_up(gpt2):
    """The per-key derivatives over every position sum to 0 (one bias on every visible key leaves each softmax
    unchanged), so `first_order_gap` is log P, and the buckets add up."""
    ca = _ca(gpt2, ["key_mask_grad"])
    row = ca.per_token["key_mask_grad"]
    assert row.shape == (1, len(ca.prompt_ids) + len(ca.response_ids))
    assert abs(row.sum()) <= 1e-12 * np.abs(row).sum()
    bk = ca.buckets("key_mask_grad")
    assert bk["first_order_gap"] == pytest.approx(bk["target"], rel=1e-12)
    parts = sum(v for k, v in bk.items() if k != "target")
    assert parts == pytest.approx(bk["target"], rel=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2", "mistral", "gemma3", "phi3", "gpt_neox"])
def test_sdpa_path_equals_eager(tokenizer, family):
    """The SDPA path (the bias in an extra q/k column) gives eager's per-key gradients, at a = 1 and along the IG
    path. Bound: float64 rounding where the family computes in float64; where eager's softmax is float32
    (FLOAT32_INSIDE), each per-key derivative sums L x H softmax rows, each rounded at 2^-24 relative in the
    forward and the backward: 2 L H 2^-24 times the sum of the derivatives' magnitudes."""
    # a window that cuts the prompt yet reaches the sources from the response in two layers (conftest's 4 does not)
    m = (
        tiny_variant(family, tokenizer, sliding_window=24)
        if family in ("mistral", "gemma3")
        else tiny_model(family, tokenizer)
    )
    ca = _ca(m, ["logit"])
    ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
    assert family not in ("mistral", "gemma3") or len(ids) > 24
    gated = [j for t in ca.source_tokens for j in t]
    L, H = m.n_layers, m.hf.config.num_attention_heads
    for method, levels in (("key_mask_grad", 4), ("key_mask_ig", [0.25, 0.7])):
        eager = km.key_mask_rows(m, ids, P, gated, method, levels, attn="eager")
        sdpa = km.key_mask_rows(m, ids, P, gated, method, levels, attn="sdpa")
        assert eager["cost"]["attention"] == "eager" and sdpa["cost"]["attention"] == "sdpa"
        e, s = eager["per_token"], sdpa["per_token"]
        mag = np.abs(e).sum()
        tol = (2 * L * H * U if family in FLOAT32_INSIDE else 1e-13) * mag
        assert np.abs(e - s).max() <= tol, (method, np.abs(e - s).max(), tol)
        assert mag > 1e-3
        np.testing.assert_allclose(eager["target"], sdpa["target"], rtol=64 * U if family in FLOAT32_INSIDE else 1e-13)


def test_soft_capped_family_stays_eager(tokenizer):
    """Gemma 2's soft-capped logits have no SDPA kernel: the memory-efficient path is refused and eager runs,
    the bias after the cap (the family's own eager function)."""
    m = tiny_model("gemma2", tokenizer)
    assert km.gate_attention(m, 10, "sdpa") == km.KEYMASK_EAGER
    ca = _ca(m, ["key_mask_grad"])
    assert ca.cost["key_mask_grad"]["attention"] == "eager"
    assert np.isfinite(ca.scores["key_mask_grad"]).all()


def test_auto_switches_to_sdpa_beyond_the_budget(tokenizer, monkeypatch):
    """ "auto" takes SDPA where eager's kept probabilities exceed half the memory budget, as grad_x_input does,
    and the model's own attention implementation is restored after the pass."""
    from ctxmix.engine.attention import current_attention

    m = tiny_model("llama", tokenizer)
    assert km.gate_attention(m, 40) == km.KEYMASK_EAGER
    monkeypatch.setattr("ctxmix.methods.context.grad.memory_budget", lambda device: 1)
    assert km.gate_attention(m, 40) == km.KEYMASK_SDPA
    ca = _ca(m, ["key_mask_grad"])
    assert ca.cost["key_mask_grad"]["attention"] == "sdpa"
    assert current_attention(m) == "ctxmix"  # set once at loading; the kernel is the call's


def test_whole_response_only_and_options(gpt2):
    """A sub-span is refused with what to do; the whole response's span is the stored row; levels are checked."""
    ca = _ca(gpt2, ["key_mask_grad", "key_mask_ig", "logit"])
    for m in ("key_mask_grad", "key_mask_ig"):
        with pytest.raises(BadInput, match=f"{m} scores the whole response only.*response="):
            ca.scores_for(m, (4, 8))
        with pytest.raises(BadInput, match="whole response only"):
            ca.buckets(m, (4, 8))
        np.testing.assert_array_equal(ca.scores_for(m, (0, len(ca.response))), ca.scores[m])
    ca.scores_for("logit", (4, 8))  # the others still score spans
    assert ca.options["key_mask_levels"] == 4
    for bad in (0, [0.0, 0.5], [1.5], "x", True):
        with pytest.raises(BadInput, match="levels"):
            _ca(gpt2, ["key_mask_ig"], key_mask_levels=bad)


def test_methods_run_through_evaluate_save_load_and_extend(tokenizer, tmp_path):
    """attribute_context with both methods, evaluate, save/load (npz and JSON: the same numbers and the sub-span
    refusal), and adding them to an attribution later (the page's path) gives the same scores."""
    from ctxmix.methods.context.check import extend_attribution

    m = tiny_model("llama", tokenizer)
    ca = _ca(m, ["key_mask_grad", "key_mask_ig"], key_mask_levels=3)
    ev = ca.evaluate(m, k=(1,), n_ablations=4, progress=False)
    assert list(ev["method"]) == ["key_mask_grad", "key_mask_ig"] and np.isfinite(ev["topk_drop@1"]).all()
    for name in ("ca.npz", "ca.json"):
        back = ctxmix.load_context_attribution(ca.save(tmp_path / name))
        for k in ca.methods:
            np.testing.assert_array_equal(back.scores[k], ca.scores[k])
            np.testing.assert_array_equal(back.per_token[k], ca.per_token[k])
        assert back.options["key_mask_levels"] == 3
        with pytest.raises(BadInput, match="whole response only"):
            back.scores_for("key_mask_ig", (4, 8))
    first = _ca(m, ["logit"], key_mask_levels=3)
    extend_attribution(first, m, ["key_mask_grad", "key_mask_ig"])
    for k in ("key_mask_grad", "key_mask_ig"):
        np.testing.assert_array_equal(first.scores[k], ca.scores[k])


def test_page_runs_the_key_mask_methods(_env, tiny_lm_dir):  # noqa: F811
    """The Context attribution page computes and shades both methods without an exception or an error."""
    at = _page(model=tiny_lm_dir, ctx=CONTEXT, query=QUERY, resp=RESPONSE, cmethod=["key_mask_grad", "key_mask_ig"])
    at.run()
    _ok(at)
    (ca,) = at.session_state["_ctx_cache"].values()
    assert {"key_mask_grad", "key_mask_ig"} <= set(ca.scores)
