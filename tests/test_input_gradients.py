"""Gradient methods on images and clips: a classifier (ViT, wav2vec2) differentiated at layer 0's input (the patch
or frame embeddings), checked against the model's own forward and central differences in float64."""

import numpy as np
import pytest
import torch
from test_speech import clip, speech_model
from test_vision import photo, vision_model

import ctxmix
from ctxmix.engine.inputs import trace_audio, trace_image
from ctxmix.errors import BadInput
from ctxmix.methods import saliency as S

GRADS = ["grad", "grad_x_input", "integrated_gradients", "cat", "attcat"]
CASES = {
    "vit-classifier": (lambda: vision_model("vit-classifier"), trace_image, {"image": photo()}, lambda: (photo(),)),
    "wav2vec2-classifier": (
        lambda: speech_model("wav2vec2-classifier"),
        lambda m, a: trace_audio(m, a, sampling_rate=16000),
        {"audio": clip(), "sampling_rate": 16000},
        lambda: (clip(),),
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    build, trace, kwargs, args = CASES[request.param]
    m = build()
    return m, trace(m, *args()), kwargs


def _prob(model, out, target: int) -> torch.Tensor:
    return torch.softmax(out.logits.double(), -1)[:, target]


def test_the_forward_from_layer0_input_is_the_models_own(case):
    """The hook that replaces layer 0's input with X, given the input's own X, reproduces the model's logits."""
    m, tr, _ = case
    X = S._embedding_output(m, tr, tr.input_ids)
    assert X.shape == (1, tr.n, m.hf.config.hidden_size)
    with torch.no_grad():
        own = m.hf(**S._input_kwargs(m, tr)).logits
        at = S._forward_at(m, tr, X.expand(3, -1, -1), "embedding_output").logits
        moved = S._forward_at(m, tr, 0.5 * X, "embedding_output").logits
    torch.testing.assert_close(at, own.expand(3, -1), rtol=0, atol=1e-12)
    assert (moved - own).abs().max() > 1e-6  # the hook does replace the input


def test_gradients_match_central_differences(case):
    m, tr, _ = case
    target = int(tr.logits.reshape(-1).argmin())  # not the argmax: any class differentiates
    g, X = S._gradients(m, tr, target, 0, "embedding_output")
    gen = torch.Generator().manual_seed(0)
    eps = 1e-5  # float64: truncation ~eps^2 |f'''|, rounding ~1e-16/eps; both far below the 1e-7 asked
    for j in (0, tr.n // 2, tr.n - 1):
        v = torch.zeros_like(X)
        v[j] = torch.randn(X.shape[1], generator=gen, dtype=X.dtype)
        with torch.no_grad():
            up = _prob(m, S._forward_at(m, tr, (X + eps * v)[None], "embedding_output"), target)
            down = _prob(m, S._forward_at(m, tr, (X - eps * v)[None], "embedding_output"), target)
        fd = float((up - down) / (2 * eps))
        assert abs(fd - float((g * v).sum())) <= 1e-7 * max(1.0, abs(fd)), (m.name, j)


def test_explain_runs_the_gradient_methods_at_layer0_input(case):
    m, tr, kwargs = case
    ex = ctxmix.explain(m, None, ["alti", *GRADS], **kwargs)
    n = tr.n
    assert ex.target == int(tr.logits.reshape(-1).argmax())
    assert ex.options["grad_at"] == "embedding_output" and ex.options["ig_baseline"] == "blank"
    assert ex.options["cat_mask_special"] is False
    for meth in GRADS:
        assert ex.saliency[meth].shape == (n,) and np.isfinite(ex.saliency[meth]).all(), meth
    g, X = S._gradients(m, tr, ex.target, 0, "embedding_output")
    np.testing.assert_allclose(ex.saliency["grad"], g.norm(dim=-1).numpy(), rtol=1e-10)
    np.testing.assert_allclose(ex.saliency["grad_x_input"], (g * X).norm(dim=-1).numpy(), rtol=1e-10)
    # IG from the blank input's layer-0 input sums to p(X) - p(blank) (completeness; checked with captum at many
    # steps), and explain's 50 steps are captum's
    from captum.attr import IntegratedGradients

    B = S._embedding_output(m, tr, None, blank=True)
    assert not torch.equal(B, X)
    with torch.no_grad():
        p1 = _prob(m, S._forward_at(m, tr, X[None], "embedding_output"), ex.target)
        p0 = _prob(m, S._forward_at(m, tr, B, "embedding_output"), ex.target)

    def f(x):
        return _prob(m, S._forward_at(m, tr, x, "embedding_output"), ex.target)

    with torch.enable_grad():
        attr = IntegratedGradients(f).attribute(X[None], baselines=B, n_steps=50)
        fine = IntegratedGradients(f).attribute(X[None], baselines=B, n_steps=400)
    assert abs(float(fine.sum() - (p1 - p0))) < 1e-4 * abs(float(p1 - p0)) + 1e-12
    np.testing.assert_allclose(ex.saliency["integrated_gradients"], attr[0].sum(-1).abs().numpy(), rtol=1e-8)
    # the class to explain and a foil are taken as on text: sigmoid(l_t - l_f), which with two classes is p_t itself
    two = m.hf.config.num_labels == 2
    other = (ex.target + 1) % m.hf.config.num_labels
    exf = ctxmix.explain(m, None, ["grad"], target=ex.target, foil=other, **kwargs)
    assert exf.foil == other
    assert np.allclose(exf.saliency["grad"], ex.saliency["grad"], rtol=1e-9, atol=0) == two


def test_what_an_image_or_a_clip_cannot_take(case):
    m, _, kwargs = case
    for call, says in [
        (lambda: ctxmix.explain(m, None, ["blank_out"], **kwargs), "read token ids"),
        (lambda: ctxmix.explain(m, None, ["grad"], grad_at="word", **kwargs), "layer 0's input"),
        (lambda: ctxmix.explain(m, None, ["integrated_gradients"], ig_baseline="pad", **kwargs), "blank, zero"),
        (lambda: ctxmix.explain(m, None, ["cat"], cat_mask_special=True, **kwargs), "mask no position"),
        (lambda: ctxmix.explain(m, None, ["alti"], target=0, **kwargs), "none was asked for"),
        (lambda: ctxmix.explain(m, None, ["grad"], target=7, **kwargs), "outside"),
    ]:
        with pytest.raises(BadInput, match=says):
            call()


def test_a_backbone_has_no_class_to_differentiate():
    m = vision_model("vit")
    with pytest.raises(BadInput, match="no class to differentiate"):
        ctxmix.explain(m, None, ["grad"], image=photo())


def test_cli_scores_a_classifiers_class_on_an_image(tmp_path, capsys):
    from PIL import Image

    from ctxmix.cli import main

    m = vision_model("vit-classifier")
    m.hf.save_pretrained(tmp_path / "model")
    Image.fromarray(photo()).save(tmp_path / "p.png")
    args = ["explain", "--image", str(tmp_path / "p.png"), "--model", str(tmp_path / "model")]
    main([*args, "--method", "alti", "grad", "--target", "LABEL_2", "--foil", "LABEL_0"])
    out = capsys.readouterr().out
    assert "alti (row 0: [CLS])" in out and "grad (class LABEL_2 minus LABEL_0)" in out
    assert main([*args, "--method", "blank_out"]) == 2
    assert "read token ids" in capsys.readouterr().err


def test_show_draws_an_image_or_a_clip_explanation(case, tmp_path):
    """show()'s default for an image or a clip: the row over the picture (held in memory), aggregated or of one layer;
    a saved explanation draws the heat alone, or over the picture given back (checked by its sha256)."""
    from ctxmix.engine.inputs import audio_input, image_input

    m, tr, kwargs = case
    ex = ctxmix.explain(m, None, ["alti", "grad"], **kwargs)
    kind = "image" if "image" in kwargs else "clip"
    fig = ex.show("alti")
    assert kind in ctxmix.export.notebook.available_kinds(ex)
    heat = [t for t in fig.data if t.type in ("heatmap", "bar")][-1]
    values = np.asarray(heat.z if kind == "image" else heat.y, dtype=float).ravel()
    prefix = ex.options["image"]["prefix"] if kind == "image" else 0
    np.testing.assert_allclose(values, ex.global_maps["alti"][-1][0][prefix:], rtol=1e-12)
    pictures = [t.type for t in fig.data if t.type in ("image", "scatter")]
    assert pictures == (["image"] if kind == "image" else ["scatter"])  # the photograph; the waveform
    # layer= without a method: the first method that has layer maps, not a gradient method listed first
    assert "alti" in ctxmix.explain(m, None, ["grad", "alti"], **kwargs).show(layer=1).layout.title.text
    one = ex.show("alti", layer=1, position=2)
    assert "layer 1" in one.layout.title.text and ex.tokens[2] in one.layout.title.text
    assert "score" in ex.show("grad").layout.title.text
    ex.save(tmp_path / "e.npz")
    back = ctxmix.load_explanation(tmp_path / "e.npz")
    assert back.inputs is None and len(back.show("alti").data) >= 1
    given = image_input(m, kwargs["image"]) if kind == "image" else audio_input(m, clip(), 16000)
    assert len(back.show("alti", inputs=given).data) == len(fig.data)
    other = image_input(m, photo(seed=5)) if kind == "image" else audio_input(m, clip(seed=5), 16000)
    with pytest.raises(BadInput, match="sha256"):
        back.show("alti", inputs=other)
    with pytest.raises(BadInput, match="no map"):
        ex.show("grad", position=3)
