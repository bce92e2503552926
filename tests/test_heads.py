"""Per-head maps: how they relate to the layer maps, on every family."""

import numpy as np
import pytest
from conftest import FAMILIES, tiny_model

import ctxmix
from ctxmix.engine.layer import head_vectors
from ctxmix.engine.trace import trace_ids

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]


@pytest.mark.parametrize("family", FAMILIES)
def test_head_maps_relate_to_the_layer_maps(tokenizer, family):
    m = tiny_model(family, tokenizer)
    ex = ctxmix.explain(m, None, ["attention", "norm", "alti"], input_ids=IDS, per_head=True)
    L, n = m.n_layers, len(IDS)
    H = m.layers[0].n_heads
    assert set(ex.head_maps) == {"attention", "norm"}  # alti has no per-head form
    for k in ex.head_maps:
        assert ex.head_maps[k].shape == (L, H, n, n)
    # attention: the layer map is the heads' mean
    np.testing.assert_allclose(ex.head_maps["attention"].mean(1), ex.layer_maps["attention"], rtol=0, atol=1e-12)
    # norm: head h's map is the norm of its vector alpha^h_ij f^h(x_j); the heads' vectors sum to the
    # layer's vector, whose norm is the layer map
    tr = trace_ids(m, IDS)
    for l, (lw, st) in enumerate(zip(m.layers, tr.states)):
        src = st.x if lw.position == "post" else st.x1
        f = head_vectors(lw, src, with_bias=True)  # (H, n, d)
        vec = st.alpha[:, :, :, None] * f[:, None, :, :]  # (H, n, n, d)
        if lw.position == "sandwich":  # Gemma 2/3: the block adds LNa(attention output), RMSNorm
            vec = vec * lw.post_attn_norm.gamma / lw.post_attn_norm.scale(st.attn)[None, :, None, :]
        np.testing.assert_allclose(vec.norm(dim=-1).numpy(), ex.head_maps["norm"][l], rtol=0, atol=1e-10)
        np.testing.assert_allclose(vec.sum(0).norm(dim=-1).numpy(), ex.layer_maps["norm"][l], rtol=0, atol=1e-10)
    assert np.all(ex.layer_maps["norm"] <= ex.head_maps["norm"].sum(1) + 1e-10)  # triangle inequality


def test_head_maps_batched_saved_and_warned(tokenizer, tmp_path):
    m = tiny_model("gpt2", tokenizer)
    texts = ["the keys to the cabinet are on the table .", "a dog barked ."]
    got = ctxmix.explain_batch(m, texts, ["attention", "norm"], per_head=True)
    for t, ex in zip(texts, got):
        ref = ctxmix.explain(m, t, ["attention", "norm"], per_head=True)
        for k in ref.head_maps:
            np.testing.assert_allclose(ex.head_maps[k], ref.head_maps[k], rtol=0, atol=1e-10)
    back = ctxmix.load_explanation(got[0].save(tmp_path / "h.npz"))
    np.testing.assert_array_equal(back.head_maps["norm"], got[0].head_maps["norm"])
    ex = ctxmix.explain(m, texts[0], ["alti"], per_head=True)
    assert not ex.head_maps and any("per-head form" in w for w in ex.warnings)
    assert not ctxmix.explain(m, texts[0], ["attention"]).head_maps  # only when asked
