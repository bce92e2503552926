"""Saved explanations: save -> load gives back everything, exactly; damaged or foreign files get a message."""

import json

import numpy as np
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput

TEXT = "the keys to the cabinet are on the table ."
METHODS = ["attention", "globenc", "alti", "value_zeroing", "grad_x_input", "integrated_gradients", "AtbFf"]


@pytest.fixture(scope="module")
def ex(tokenizer):
    m = tiny_model("bert", tokenizer)
    return ctxmix.explain(m, TEXT, METHODS, target=1, ig_steps=8)


def test_round_trip_is_exact(ex, tmp_path):
    p = ex.save(tmp_path / "ex")
    assert p.suffix == ".npz" and p.exists()
    back = ctxmix.load_explanation(p)
    for field in (
        "tokens",
        "input_ids",
        "methods",
        "prediction",
        "position",
        "target",
        "model_name",
        "reconstruction_error",
        "warnings",
        "options",
        "provenance",
    ):
        assert getattr(back, field) == getattr(ex, field), field
    for kind in ("layer_maps", "global_maps", "saliency"):
        a, b = getattr(ex, kind), getattr(back, kind)
        assert set(a) == set(b), kind
        for m in a:
            np.testing.assert_array_equal(a[m], b[m], err_msg=f"{kind} {m}")
    assert back.options["ig_steps"] == 8 and back.options["precision"] == "float32"
    assert back.provenance["ctxmix_version"] == ctxmix.__version__ and back.provenance["model"] == "tiny-bert"


def test_the_file_opens_without_pickle(ex, tmp_path):
    p = ex.save(tmp_path / "ex.npz")
    with np.load(p, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        assert meta["format"] == "ctxmix-explanation" and z["layer/alti"].shape == (2, len(ex.tokens), len(ex.tokens))


def test_half_precision_for_viewing(ex, tmp_path):
    full, half = ex.save(tmp_path / "full.npz"), ex.save(tmp_path / "half.npz", half=True)
    assert half.stat().st_size < full.stat().st_size
    back = ctxmix.load_explanation(half)
    for m, a in ex.layer_maps.items():
        np.testing.assert_allclose(back.layer_maps[m], a, rtol=1e-3, atol=1e-3 * np.abs(a).max())
    for m, a in ex.saliency.items():
        np.testing.assert_array_equal(back.saliency[m], a)  # saliency stays exact


def test_damaged_and_foreign_files(ex, tmp_path):
    from ctxmix.service.limits import HOSTED

    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(BadInput, match="could not be read"):
        ctxmix.load_explanation(tmp_path / "text.npz")
    np.savez(tmp_path / "foreign.npz", x=np.ones(3))
    with pytest.raises(BadInput, match="not a saved ctxmix explanation"):
        ctxmix.load_explanation(tmp_path / "foreign.npz")
    good = ex.save(tmp_path / "good.npz")
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["layer/alti"] = arrays["layer/alti"][:, :3, :3]
    np.savez(tmp_path / "shape.npz", **arrays)
    with pytest.raises(BadInput, match="does not fit"):
        ctxmix.load_explanation(tmp_path / "shape.npz")
    meta = json.loads(str(arrays["meta"]))
    arrays["meta"] = np.array(json.dumps({**meta, "version": 99}))
    np.savez(tmp_path / "newer.npz", **arrays)
    with pytest.raises(BadInput, match="this version can read"):
        ctxmix.load_explanation(tmp_path / "newer.npz")
    with pytest.raises(BadInput, match="no such file"):
        ctxmix.load_explanation(tmp_path / "missing.npz")
    ctxmix.load_explanation(good, limits=HOSTED)  # within the hosted archive caps


def test_the_cli_writes_a_saved_explanation(tmp_path):
    from ctxmix.cli import main

    out = tmp_path / "cli.npz"
    assert (
        main(["explain", TEXT, "--model", "minilm", "--device", "cpu", "--method", "alti", "norm", "--out", str(out)])
        == 0
    )
    back = ctxmix.load_explanation(out)
    assert back.methods == ["alti", "norm"] and back.layer_maps["alti"].shape[0] == 6
    np.testing.assert_allclose(back.layer_maps["alti"].sum(-1), 1.0, atol=1e-6)
