"""Contrastive targets: with a foil, every gradient and perturbation method explains target minus foil."""

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]
SAL = ["grad", "grad_x_input", "integrated_gradients", "blank_out", "cat", "attcat"]


def test_two_classes_foil_is_the_probability(tokenizer):
    """With two classes, sigmoid(l_1 - l_0) is exactly p_1: target 1 against foil 0 gives the
    probability-based methods' plain target-1 scores."""
    m = tiny_model("bert", tokenizer)
    plain = ctxmix.explain(m, None, SAL, target=1, input_ids=IDS, ig_steps=8)
    contrast = ctxmix.explain(m, None, SAL, target=1, foil=0, input_ids=IDS, ig_steps=8)
    assert contrast.target == 1 and contrast.foil == 0 and plain.foil is None
    for k in ("grad", "grad_x_input", "integrated_gradients", "blank_out"):
        np.testing.assert_allclose(contrast.saliency[k], plain.saliency[k], rtol=1e-9, atol=1e-12, err_msg=k)
    # CAT works on logits: target minus foil is CAT(target) - CAT(foil), by linearity
    other = ctxmix.explain(m, None, ["cat", "attcat"], target=0, input_ids=IDS)
    for k in ("cat", "attcat"):
        np.testing.assert_allclose(contrast.saliency[k], plain.saliency[k] - other.saliency[k], atol=1e-10)


def test_language_model_foil_changes_the_gradient_as_the_logit_difference(tokenizer):
    m = tiny_model("gpt2", tokenizer)
    keys, key = tokenizer.convert_tokens_to_ids(["keys", "key"])
    ex = ctxmix.explain(m, None, ["grad"], target="keys", foil="key", input_ids=IDS[:-1])
    assert ex.target == keys and ex.foil == key and ex.position == len(IDS) - 2
    with torch.enable_grad():  # by hand: ||d sigmoid(l_keys - l_key) / d e_i||
        E = m.hf.get_input_embeddings()(torch.tensor([IDS[:-1]])).detach().requires_grad_(True)
        z = m.hf(inputs_embeds=E).logits[0, -1].double()
        (g,) = torch.autograd.grad(torch.sigmoid(z[keys] - z[key]), E)
    np.testing.assert_allclose(ex.saliency["grad"], g[0].norm(dim=-1).numpy(), rtol=1e-9, atol=1e-15)
    plain = ctxmix.explain(m, None, ["grad"], target="keys", input_ids=IDS[:-1])
    assert not np.allclose(plain.saliency["grad"], ex.saliency["grad"])


def test_bad_foils(tokenizer, tmp_path):
    m = tiny_model("bert", tokenizer)
    with pytest.raises(BadInput, match="the foil is the target"):
        ctxmix.explain(m, None, ["grad"], target=1, foil=1, input_ids=IDS)
    with pytest.raises(BadInput, match="outside"):
        ctxmix.explain(m, None, ["grad"], target=1, foil=7, input_ids=IDS)
    ex = ctxmix.explain(m, None, ["alti"], foil=0, input_ids=IDS)
    assert any("foil applies" in w for w in ex.warnings)
    ex = ctxmix.explain(m, None, ["grad"], target=1, foil=0, input_ids=IDS)
    assert ctxmix.load_explanation(ex.save(tmp_path / "f.npz")).foil == 0


def test_explain_batch_takes_a_foil_per_text(tokenizer):
    m = tiny_model("bert", tokenizer)
    texts = ["the keys to the cabinet are on the table .", "a dog barked ."]
    got = ctxmix.explain_batch(m, texts, ["grad", "cat"], targets=[1, 0], foils=[0, None])
    assert got[0].foil == 0 and got[1].foil is None
    for t, tgt, foil, ex in zip(texts, [1, 0], [0, None], got):
        ref = ctxmix.explain(m, t, ["grad", "cat"], target=tgt, foil=foil)
        for k in ("grad", "cat"):
            np.testing.assert_allclose(ex.saliency[k], ref.saliency[k], rtol=1e-9, atol=1e-12)
    with pytest.raises(BadInput, match="one entry per text"):
        ctxmix.explain_batch(m, texts, ["grad"], foils=[0])
