"""The engine's precision option and half-precision models: measured against float32 maps."""

import numpy as np
import pytest
import torch

import ctxmix
from ctxmix.engine.precision import engine_precision
from ctxmix.engine.trace import trace
from ctxmix.errors import BadInput
from ctxmix.methods.mixing import compute_maps

TEXT = "The keys to the cabinet are on the table , and the cat that the dogs chase sleeps on the mat ."
MIXING = ["attention", "norm", "norm_res", "norm_res_ln", "globenc", "alti", "value_zeroing"]
SCOPES = ["Atb", "AtbFf", "AtbFfRes", "AtbFfResLn"]


def _rel(a, ref) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def reference(minilm):
    return {m: lm for m, (lm, _) in compute_maps(trace(minilm, TEXT), MIXING + SCOPES).items()}


def test_tf32_on_cpu_is_float32(minilm, reference):
    got = compute_maps(trace(minilm, TEXT), ["value_zeroing"] + SCOPES, precision="tf32")
    for m, (lm, _) in got.items():
        np.testing.assert_array_equal(lm, reference[m])


def test_bf16_products_stay_within_5e_3_of_float32(minilm, reference):
    """bf16 products with float32 accumulation, on the same float32 weights: every map within
    5e-3 of its float32 map's largest entry, and really computed in bf16 (not identical)."""
    got = compute_maps(trace(minilm, TEXT), ["value_zeroing"] + SCOPES, precision="bf16")
    errs = {m: _rel(lm, reference[m]) for m, (lm, _) in got.items()}
    assert max(errs.values()) < 5e-3, errs
    assert errs["AtbFf"] > 0 and errs["value_zeroing"] > 0, errs
    np.testing.assert_allclose(got["value_zeroing"][0].sum(-1), 1.0, atol=1e-10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_are_decomposed_in_float32(reference, dtype):
    """A model loaded in half precision: activations and weights upcast for the decompositions,
    so its maps differ from the float32 model's only by what its rounded weights and its own
    half-precision forward pass change (within 2e-2 of the largest entry)."""
    m = ctxmix.load_model("minilm", device="cpu", dtype=dtype)
    assert m.work_dtype == torch.float32 and m.layers[0].W2.dtype == torch.float32
    ex = ctxmix.explain(m, TEXT, MIXING)
    errs = {k: _rel(ex.layer_maps[k], reference[k]) for k in MIXING}
    assert max(errs.values()) < 2e-2, errs
    assert ex.reconstruction_error < (5e-2 if dtype == "bfloat16" else 1e-2)  # the model's own rounding


def test_precision_is_checked_and_kept_as_the_models_default(minilm):
    with pytest.raises(BadInput, match="precision must be one of"):
        ctxmix.explain(minilm, TEXT, ["norm"], precision="fp8")
    with pytest.raises(BadInput, match="precision must be one of"):
        ctxmix.load_model("minilm", device="cpu", precision="half")
    from ctxmix.service.cache import model_fingerprint

    m = ctxmix.load_model("minilm", device="cpu", precision="bf16")
    assert m.precision == "bf16"
    assert model_fingerprint(m) != model_fingerprint(minilm)
    a = ctxmix.scope_maps(m, TEXT)["AtbFf"]
    b = ctxmix.scope_maps(m, TEXT, precision="float32")["AtbFf"]
    assert 0 < np.abs(a - b).max() < 5e-3 * np.abs(b).max()


def test_tf32_switch_is_set_per_call_and_restored():
    """On CUDA the TF32 switch is process-wide: the engine sets it for its own call only."""
    flag = torch.backends.cuda.matmul.allow_tf32
    with engine_precision("tf32", "cuda"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        with engine_precision("float32", "cuda"):  # a nested float32 call sees no TF32
            assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 == flag
