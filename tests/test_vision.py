"""Vision Transformers (ViT, DINOv2 with its layer scale, SwiGLU and registers, CLIP's vision tower): an image's
class token and patches are the positions, and every decomposition reconstructs the model's own states
(float64, 1e-8) on tiny random models, as for text."""

import io

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as T
from conftest import randomise_norms
from PIL import Image
from test_reconstruction import TOL, _check

import ctxmix
from ctxmix.engine.arch import families_table, spec_for
from ctxmix.engine.inputs import NOT_AN_ID, image_input, trace_image
from ctxmix.engine.layer import norm_family_pieces, value_zeroing_columns
from ctxmix.errors import BadInput
from ctxmix.methods.mixing import value_zeroing_maps
from ctxmix.methods.registry import MIXING_METHODS

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32)
VISION = {
    "vit": (T.ViTModel, T.ViTConfig(patch_size=8, **SMALL)),
    "vit-classifier": (T.ViTForImageClassification, T.ViTConfig(patch_size=8, num_labels=3, **SMALL)),
    "dinov2": (T.Dinov2Model, T.Dinov2Config(patch_size=8, **SMALL)),
    "dinov2-swiglu": (T.Dinov2Model, T.Dinov2Config(patch_size=8, use_swiglu_ffn=True, **SMALL)),
    "dinov2-registers": (
        T.Dinov2WithRegistersModel,
        T.Dinov2WithRegistersConfig(patch_size=8, num_register_tokens=2, **SMALL),
    ),
    "clip-vision": (T.CLIPVisionModel, T.CLIPVisionConfig(patch_size=8, **SMALL)),
}


def vision_model(name: str, dtype=torch.float64):
    torch.manual_seed(0)
    cls, cfg = VISION[name]
    hf = cls._from_config(cfg).to(dtype).eval()
    randomise_norms(hf)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # DINOv2's layer scale away from its constant init: the fold into W_O and W_2 must show
        for pname, p in hf.named_parameters():
            if pname.endswith("lambda1"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype))
    return ctxmix.model_from_hf(hf, name=f"tiny-{name}")


def photo(h: int = 40, w: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=list(VISION))
def vision(request):
    return vision_model(request.param)


def test_the_layers_rebuilt_from_weights_give_the_models_states(vision):
    tr = trace_image(vision, photo())
    assert tr.reconstruction_error < TOL
    inp = tr.inputs
    assert tr.n == inp.n == inp.prefix + 16 and inp.grid == (4, 4)
    assert tr.input_ids == [NOT_AN_ID] * tr.n
    assert tr.tokens[0] == "[CLS]" and tr.tokens[inp.prefix] == "r0c0" and tr.tokens[-1] == "r3c3"
    if "registers" in vision.name:
        assert tr.tokens[1:3] == ["[REG1]", "[REG2]"]
    assert inp.cell(0) is None and inp.cell(inp.prefix + 5) == (1, 1)


def test_every_scope_reconstructs_on_images(vision):
    tr = trace_image(vision, photo())
    for factorised in (True, False):
        for lw, errs in _check(tr, factorised=factorised):
            assert errs and max(errs.values()) < TOL, (vision.name, lw.index, errs)


def test_norm_family_pieces_sum_to_the_residual_stream(vision):
    tr = trace_image(vision, photo())
    rows = torch.arange(tr.n)
    for lw, st in zip(vision.layers, tr.states):
        P = norm_family_pieces(lw, st, rows)
        assert float((P["norm_res"].sum(1) + lw.bo - st.r1).abs().max()) < TOL


def test_layer_scale_is_folded_into_the_projections():
    """DINOv2's lambda multiplies the attention and FF outputs: without the fold the rebuilt layer would be off."""
    m = vision_model("dinov2")
    lam = m.hf.encoder.layer[0].layer_scale1.lambda1
    assert float((lam - 1).abs().max()) > 0.1
    Wo = m.hf.encoder.layer[0].attention.o_proj.weight.T
    torch.testing.assert_close(m.layers[0].Wo, Wo * lam, rtol=0, atol=0)
    assert spec_for(VISION["dinov2-swiglu"][1]).gated and not spec_for(VISION["dinov2"][1]).gated


def test_value_zeroing_factorised_equals_straightforward_on_images(vision):
    tr = trace_image(vision, photo())
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    np.testing.assert_allclose(fast.sum(-1), 1.0, atol=1e-12)
    # the two routes round y_i differently by ~eps relative; a distance D = 1 - cos then carries ~eps / D relative
    # error (a random model's distances are small: 1e-7 here), which the row normalisation keeps
    D = min(
        float(value_zeroing_columns(lw, st, torch.arange(tr.n), factorised=False).min())
        for lw, st in zip(vision.layers, tr.states)
    )
    assert D > 0
    np.testing.assert_allclose(fast, slow, rtol=64 * np.finfo(np.float64).eps / D, atol=0)


def test_explain_an_image_with_every_mixing_method(vision):
    methods = [m for m in MIXING_METHODS if not m.startswith("Atb")] + ["AtbLnFfRes"]
    ex = ctxmix.explain(vision, None, methods, image=photo())
    n = 1 + 16 + (2 if "registers" in vision.name else 0)
    assert ex.position == 0 and len(ex.tokens) == n
    assert ex.reconstruction_error < TOL
    for m in methods:
        assert ex.layer_maps[m].shape == (2, n, n), m
        assert np.isfinite(ex.layer_maps[m]).all(), m
    for m in ("attention", "alti", "value_zeroing"):  # the methods whose rows are shares
        np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=1e-8, err_msg=m)
    assert ex.options["image"]["grid"] == [4, 4] and ex.options["image"]["patch"] == 8
    assert len(ex.options["image"]["sha256"]) == 64
    if vision.kind == "classifier":
        assert set(ex.prediction["probabilities"]) == {"LABEL_0", "LABEL_1", "LABEL_2"}


def test_an_image_file_a_pil_image_and_an_array_read_the_same(tmp_path):
    m = vision_model("vit")
    arr = photo()
    path = tmp_path / "photo.png"
    Image.fromarray(arr).save(path)
    want = image_input(m, arr).pixel_values
    for given in (path, str(path), Image.fromarray(arr), arr.astype(np.float64) / 255):
        got = image_input(m, given)
        torch.testing.assert_close(got.pixel_values, want, rtol=0, atol=1e-6)
    assert image_input(m, arr[..., 0]).pixel_values.shape == want.shape  # greyscale becomes RGB
    assert image_input(m, arr).fingerprint() == image_input(m, arr.copy()).fingerprint()
    assert image_input(m, arr).fingerprint() != image_input(m, photo(seed=1)).fingerprint()


def test_bad_image_calls_say_what_is_wrong(tmp_path, tokenizer):
    m = vision_model("vit")
    cases = [
        (lambda: ctxmix.explain(m, None, ["alti"], image=np.zeros((4, 4, 5))), "channels"),
        (lambda: ctxmix.explain(m, None, ["alti"], image=np.full((8, 8, 3), 2.0)), "[0, 1]"),
        (lambda: ctxmix.explain(m, None, ["alti"], image=tmp_path / "missing.png"), "no image file"),
        (lambda: ctxmix.explain(m, None, ["grad"], image=photo()), "mixing methods"),
        (lambda: ctxmix.explain(m, None, ["alti"], image=photo(), target=1), "target"),
        (lambda: ctxmix.explain(m, "a cat", ["alti"]), "reads images"),
        (lambda: ctxmix.explain(m, None, ["alti"], image=photo(), position=99), "outside"),
    ]
    (tmp_path / "text.png").write_text("not an image")
    cases.append((lambda: ctxmix.explain(m, None, ["alti"], image=tmp_path / "text.png"), "not an image"))
    text = ctxmix.model_from_hf(T.BertModel(T.BertConfig(**{**SMALL, "vocab_size": 30522})), tokenizer)
    cases.append((lambda: ctxmix.explain(text, None, ["alti"], image=photo()), "reads text"))
    for call, words in cases:
        with pytest.raises(BadInput, match=None) as err:
            call()
        assert words in str(err.value), (words, str(err.value))
    with pytest.raises(BadInput, match="tokenizer"):
        ctxmix.model_from_hf(T.BertModel(T.BertConfig(**{**SMALL, "vocab_size": 30522})))


def test_the_families_table_lists_the_vision_families():
    rows = {r["family"]: r for r in families_table()}
    for family in ("ViT", "DINOv2", "CLIP vision"):
        assert rows[family]["norms"] == "pre-LN" and rows[family]["attention"] == "bidirectional"


def test_cli_explains_an_image_file(tmp_path, capsys):
    from skimage import data

    from ctxmix.cli import main

    path = tmp_path / "coffee.png"
    Image.fromarray(data.coffee()).save(path)
    main(["explain", "--image", str(path), "--model", "dinov2-small", "--method", "alti"])
    out = capsys.readouterr().out
    assert "alti (row 0: [CLS]), over a 16 x 16 grid of patches:" in out
    grid = [line.split() for line in out.splitlines()[2:18]]
    assert len(grid) == 16 and all(len(row) == 16 for row in grid)
    main(["explain", "--image", str(path), "--model", "dinov2-small", "--out", str(tmp_path / "c.npz")])
    ex = ctxmix.load_explanation(tmp_path / "c.npz")
    assert ex.tokens[0] == "[CLS]" and ex.options["image"]["grid"] == [16, 16]
    assert main(["explain", "a text", "--image", str(path), "--model", "dinov2-small"]) == 2
    assert "not both" in capsys.readouterr().err


def test_patch_values_read_a_row_over_the_grid():
    from ctxmix.methods.images import patch_values, position_of

    m = vision_model("dinov2-registers")
    ex = ctxmix.explain(m, None, ["alti", "attention"], image=photo())
    prefix, grid = patch_values(ex, "alti")
    assert list(prefix) == ["[CLS]", "[REG1]", "[REG2]"] and grid.shape == (4, 4)
    row = ex.global_maps["alti"][-1][0]
    assert prefix["[CLS]"] == row[0] and grid[1, 2] == row[3 + 1 * 4 + 2]
    pos = position_of(ex, 3, 1)
    assert ex.tokens[pos] == "r3c1"
    _, layer2 = patch_values(ex, "attention", pos, layer=2)
    np.testing.assert_array_equal(layer2.reshape(-1), ex.layer_maps["attention"][1][pos][3:])
    for call, words in [
        (lambda: position_of(ex, 4, 0), "outside the 4 x 4 grid"),
        (lambda: patch_values(ex, "globenc"), "not computed"),
        (lambda: patch_values(ex, "alti", layer=3), "outside 1..2"),
        (lambda: patch_values(ex, "alti", position=99), "outside the 19 positions"),
    ]:
        with pytest.raises(BadInput, match=None) as err:
            call()
        assert words in str(err.value)


def test_the_image_as_the_model_read_it_comes_back_in_rgb():
    from ctxmix.engine.inputs import SAMPLE_IMAGES, sample_image

    m = vision_model("vit")  # ViT's processor: a resize to 32 x 32, normalised by 0.5 / 0.5
    flat = np.full((64, 64, 3), 200, dtype=np.uint8)
    inp = image_input(m, flat)
    assert inp.source_size == (64, 64) and inp.mean == (0.5, 0.5, 0.5)
    rgb = inp.rgb()
    assert rgb.shape == (32, 32, 3) and rgb.dtype == np.uint8 and np.abs(rgb.astype(int) - 200).max() <= 1
    buf = __import__("io").BytesIO()
    Image.fromarray(photo()).save(buf, format="PNG")
    torch.testing.assert_close(image_input(m, buf.getvalue()).pixel_values, image_input(m, photo()).pixel_values)
    with pytest.raises(BadInput, match="not an image"):
        image_input(m, b"not an image")
    assert [sample_image(k).shape[-1] for k in SAMPLE_IMAGES] == [3, 3, 3]
    with pytest.raises(BadInput, match="no bundled photograph"):
        sample_image("moon")


def test_image_caps_refuse_before_any_work():
    from ctxmix.service.limits import HOSTED, LOCAL, check_image

    m = vision_model("vit")
    check_image(LOCAL, image_input(m, photo(600, 800)))
    with pytest.raises(BadInput, match="max_image_pixels"):
        check_image(HOSTED, image_input(m, photo(2100, 2100)))
    with pytest.raises(BadInput, match="max_image_positions"):
        check_image(__import__("dataclasses").replace(HOSTED, max_image_positions=16), image_input(m, photo()))


def test_the_heat_figure_lays_the_patches_over_the_image():
    from ctxmix.export.plots import image_heat

    rgb = np.zeros((32, 48, 3), dtype=np.uint8)
    grid = np.arange(6, dtype=float).reshape(2, 3)
    fig = image_heat(rgb, grid, title="t")
    img, heat = fig.data
    assert img.type == "image" and heat.type == "heatmap"
    np.testing.assert_allclose(heat.x, [8, 24, 40])  # patch centres: 16 pixels wide
    np.testing.assert_allclose(heat.y, [8, 24])
    assert heat.colorscale[0][1] != "rgb(5,48,97)"  # unsigned shares: not the diverging scale
    signed = image_heat(rgb, grid - 2.5)
    assert signed.data[1].zmid == 0


def test_contextualization_change_over_a_folder_of_images(tmp_path):
    m = vision_model("vit")
    df = ctxmix.contextualization_change(m, [photo(seed=k) for k in range(3)], progress=False)
    assert (df["n"] == 3).all() and df["change"].between(0, 2).all()
    files = []  # the dashboard's uploads: a file's bytes
    for k in range(3):
        buf = io.BytesIO()
        Image.fromarray(photo(seed=k)).save(buf, format="PNG")
        files.append(buf.getvalue())
    pd.testing.assert_frame_equal(ctxmix.contextualization_change(m, files, progress=False), df)
    m.hf.save_pretrained(tmp_path / "model")
    (tmp_path / "images").mkdir()
    for k in range(2):
        Image.fromarray(photo(seed=k)).save(tmp_path / "images" / f"{k}.png")
    from ctxmix.cli import main

    out = tmp_path / "change.csv"
    main(["change", "--image-dir", str(tmp_path / "images"), "--model", str(tmp_path / "model"), "--out", str(out)])

    got = pd.read_csv(out)
    assert (got["n"] == 2).all() and set(got["layer"]) == set(df["layer"])


def test_patches_gather_into_regions():
    from ctxmix.methods.images import patch_values, region_values

    m = vision_model("dinov2-registers")
    ex = ctxmix.explain(m, None, ["alti"], image=photo())
    _, grid = patch_values(ex, "alti")  # 4 x 4
    quads = region_values(ex, "alti", (2, 2))
    np.testing.assert_allclose(quads[0, 1], grid[:2, 2:].sum(), rtol=1e-12)
    np.testing.assert_allclose(quads.sum(), grid.sum(), rtol=1e-12)
    thirds = region_values(ex, "alti", (3, 1))  # rows split 2 / 1 / 1
    np.testing.assert_allclose(thirds[:, 0], [grid[:2].sum(), grid[2].sum(), grid[3].sum()], rtol=1e-12)
    assert region_values(ex, "alti", (4, 4)).tolist() == grid.tolist()
    with pytest.raises(BadInput, match="regions"):
        region_values(ex, "alti", (5, 1))


def test_clip_joint_model_explains_its_image_tower(tmp_path):
    """A CLIPModel (wrapped, or a folder of one) is explained through its image tower (`vision_model`, keys
    vision_model.*): the same maps as that tower alone, its text tower neither read nor loaded."""
    torch.manual_seed(0)
    vc = {k: v for k, v in SMALL.items()} | {"patch_size": 8}
    tc = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)
    joint = T.CLIPModel(T.CLIPConfig(vision_config=vc, text_config=tc, projection_dim=16)).to(torch.float64).eval()
    randomise_norms(joint)
    joint.save_pretrained(tmp_path / "clip")
    wrapped = ctxmix.model_from_hf(joint, name="tiny-clip")
    assert wrapped.spec.family == "CLIP vision" and wrapped.hf is joint.vision_model
    ex = ctxmix.explain(wrapped, None, ["alti", "norm_res_ln"], image=photo())
    assert ex.reconstruction_error < TOL and len(ex.tokens) == 17
    loaded = ctxmix.load_model(str(tmp_path / "clip"), dtype="float64")
    assert type(loaded.hf).__name__ == "CLIPVisionModel"
    assert not any("text" in n for n, _ in loaded.hf.named_parameters())
    again = ctxmix.explain(loaded, None, ["alti", "norm_res_ln"], image=photo())
    for m in ("alti", "norm_res_ln"):
        np.testing.assert_allclose(again.layer_maps[m], ex.layer_maps[m], rtol=0, atol=1e-12)
    from ctxmix.errors import UnsupportedArchitecture

    head = T.CLIPForImageClassification(T.CLIPConfig(vision_config=vc, text_config=tc, num_labels=2))
    with pytest.raises(UnsupportedArchitecture, match="CLIPForImageClassification is not supported"):
        ctxmix.model_from_hf(head)  # never silently its bare tower, head dropped
