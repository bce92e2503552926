"""The FF paper's corpus analyses against direct computations."""

import random

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FAMILIES, tiny_model
from scipy import stats

import ctxmix
from ctxmix.analyses.corpus import POST_COMPARISONS, PRE_COMPARISONS, low_gamma_dims, mask_tokens
from ctxmix.engine.trace import trace_batch, trace_ids

TEXTS = [
    "the keys to the cabinet are on the table .",
    "a small dog barked at the old man .",
    "she loves math rather than engaging in sports .",
]


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_contextualization_change_matches_direct_spearman(tokenizer, family):
    m = tiny_model(family, tokenizer)
    df = ctxmix.contextualization_change(m, TEXTS, progress=False)
    assert list(df.columns) == ["layer", "comparison", "change", "std", "n"]
    comps = POST_COMPARISONS if family == "bert" else PRE_COMPARISONS
    assert len(df) == m.n_layers * len(comps)
    assert set(df["n"]) == {len(TEXTS)}
    # recompute one cell by hand
    a, b = comps["+Ff"]
    vals = []
    for t in TEXTS:
        s = ctxmix.scope_maps(m, t)
        vals.append(1 - stats.spearmanr(s[a][1].ravel(), s[b][1].ravel()).statistic)
    row = df[(df.layer == 2) & (df.comparison == "+Ff")].iloc[0]
    assert row.change == pytest.approx(np.mean(vals), abs=1e-12)
    assert row["std"] == pytest.approx(np.std(vals), abs=1e-12)
    assert df["change"].between(0, 2).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_traces_equal_single_traces(tokenizer, family):
    """Corpus loops trace several sequences per padded forward pass: same states and logits."""
    m = tiny_model(family, tokenizer)
    batch = [m.encode(t)[0] for t in TEXTS]
    assert len({len(ids) for ids in batch}) > 1  # really padded
    for tb, ids in zip(trace_batch(m, batch), batch):
        ts = trace_ids(m, ids)
        assert tb.input_ids == ids and tb.tokens == ts.tokens
        for a, b in zip(tb.states, ts.states):
            torch.testing.assert_close(a.alpha, b.alpha, rtol=0, atol=1e-12)
            torch.testing.assert_close(a.y, b.y, rtol=0, atol=1e-10)
        if ts.logits is not None:
            torch.testing.assert_close(tb.logits, ts.logits, rtol=0, atol=1e-10)
        assert tb.reconstruction_error == pytest.approx(ts.reconstruction_error, abs=1e-10)


def test_low_gamma_dims_drop_the_lowest(tokenizer):
    m = tiny_model("bert", tokenizer)
    keep = low_gamma_dims(m, 0.1)  # d = 24 -> floor(2.4) = 2 dims dropped per layer
    for lw, k in zip(m.layers, keep):
        dropped = torch.nonzero(~k).ravel()
        assert len(dropped) == 2
        assert set(dropped.tolist()) == set(torch.argsort(lw.ln2.gamma)[:2].tolist())
    full = ctxmix.contextualization_change(m, TEXTS, progress=False)
    ablated = ctxmix.contextualization_change(m, TEXTS, ignore_low_gamma=0.1, progress=False)
    assert not np.allclose(full["change"], ablated["change"])


def test_mask_tokens(tokenizer):
    m = tiny_model("bert", tokenizer)
    ids = tokenizer("one two three four five six seven eight nine ten eleven")["input_ids"]
    out = mask_tokens(m, ids, 0.12, random.Random(0))
    masked = [i for i, (a, b) in enumerate(zip(ids, out)) if a != b]
    assert len(masked) == max(1, int(0.12 * (len(ids) - 2)))
    assert all(out[i] == tokenizer.mask_token_id for i in masked)
    assert out[0] == ids[0] and out[-1] == ids[-1]


def test_ff_outliers_against_module_outputs(tokenizer):
    """Mean |FF input| and |FF output| per dimension, from hooks on the real modules."""
    m = tiny_model("bert", tokenizer)
    df = ctxmix.ff_outliers(m, TEXTS, progress=False)
    assert list(df.columns) == ["layer", "dim", "gamma", "ff_in_mean_abs", "ff_out_mean_abs"]
    layer = m.hf.base_model.encoder.layer[1]
    ins, outs = [], []
    h1 = layer.intermediate.dense.register_forward_hook(lambda mod, i, o: ins.append(i[0][0]))
    h2 = layer.output.dense.register_forward_hook(lambda mod, i, o: outs.append(o[0]))
    with torch.no_grad():
        for t in TEXTS:
            m.hf(**tokenizer(t, return_tensors="pt"))
    h1.remove()
    h2.remove()
    d2 = df[df.layer == 2]
    np.testing.assert_allclose(d2.ff_in_mean_abs, torch.cat(ins).abs().mean(0).numpy(), atol=1e-12)
    np.testing.assert_allclose(d2.ff_out_mean_abs, torch.cat(outs).abs().mean(0).numpy(), atol=1e-12)
    np.testing.assert_allclose(d2.gamma, layer.output.LayerNorm.weight.detach().numpy())


def test_gpt2_gamma_is_next_layers_ln1(tokenizer):
    m = tiny_model("gpt2", tokenizer)
    df = ctxmix.ff_outliers(m, TEXTS[:1], progress=False)
    base = m.hf.base_model
    np.testing.assert_allclose(df[df.layer == 1].gamma, base.h[1].ln_1.weight.detach().numpy())
    np.testing.assert_allclose(df[df.layer == 2].gamma, base.ln_f.weight.detach().numpy())


def test_outlier_correlations_hand_case():
    df = pd.DataFrame(
        {
            "layer": 1,
            "dim": range(4),
            "gamma": [1.0, 2.0, 3.0, 4.0],
            "ff_in_mean_abs": 0.0,
            "ff_out_mean_abs": [8.0, 4.0, 2.0, 1.0],
        }
    )
    r = ctxmix.ff_outlier_correlations(df).iloc[0]
    assert r.spearman == pytest.approx(-1.0)
    assert r.pearson == pytest.approx(stats.pearsonr([1, 2, 3, 4], [8, 4, 2, 1]).statistic)


def test_res2_norms(tokenizer):
    m = tiny_model("bert", tokenizer)
    df = ctxmix.ff_residual_norms(m, TEXTS, progress=False)
    np.testing.assert_allclose(df.ratio, df.bypass_norm / df.ff_out_norm)
    assert (df.ff_out_norm > 0).all() and len(df) == m.n_layers


def test_ff_amp(tokenizer):
    m = tiny_model("bert", tokenizer)
    df = ctxmix.ff_amp(m, TEXTS * 2, top_k=5, progress=False)
    assert list(df.columns) == ["layer", "out_token", "in_token", "score", "count"]
    assert (df["count"] >= 2).all()
    for _, g in df.groupby("layer"):
        assert len(g) <= 5 and list(g.score) == sorted(g.score, reverse=True)
    # the score of one pair by hand: normalised AtbFf - normalised Atb over its occurrences
    top = df.iloc[0]
    vals = []
    for t in TEXTS * 2:
        ids = m.encode(t)[0]
        toks = m.tokens(ids)
        s = ctxmix.scope_maps(m, input_ids=ids)
        A, B = s["Atb"][top.layer - 1], s["AtbFf"][top.layer - 1]
        D = B / B.sum(0, keepdims=True) - A / A.sum(0, keepdims=True)
        vals += [
            D[i, j]
            for i in range(len(ids))
            for j in range(len(ids))
            if i != j and toks[i] == top.out_token and toks[j] == top.in_token
        ]
    assert top.score == pytest.approx(np.mean(vals)) and top["count"] == len(vals)


def test_empty_corpus_and_texts(tokenizer):
    m = tiny_model("bert", tokenizer)
    with pytest.raises(ctxmix.BadInput):
        ctxmix.contextualization_change(m, [], progress=False)
    with pytest.warns(UserWarning, match="1 empty"):
        df = ctxmix.ff_residual_norms(m, ["", TEXTS[0]], progress=False)
    assert len(df) == m.n_layers
