"""The engine's precision option and half-precision models, with every tolerance derived from the
formats' unit roundoffs (`ctxmix.engine.precision`), never tuned on one CPU: these tests also run
with ATEN_CPU_CAPABILITY=default / avx2 (`make test-stored-isas`, with every other stored-number test)
and ONEDNN_MAX_CPU_ISA=AVX2 (`make test-precision-isas`). What moves between machines here: the order
of float32 reductions and the half-precision kernels (ATen's vectorised loops, MKL's and oneDNN's GEMM
paths); every reference is recomputed on the machine (float32 or float64), no number is stored, so each
bound covers any order of the reductions it names."""

import dataclasses

import numpy as np
import pytest
import torch

import ctxmix
from ctxmix.engine.layer import layer_forward
from ctxmix.engine.precision import (
    UNIT_ROUNDOFF,
    bf16_product_bound,
    float32_decomposition_bound,
    half_model_map_bound,
)
from ctxmix.engine.trace import trace
from ctxmix.errors import BadInput
from ctxmix.methods.mixing import compute_maps

pytestmark = pytest.mark.stored_numbers

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


def test_bf16_products_stay_within_their_rounding_bound(minilm, reference):
    """bf16 products with float32 accumulation, on the same float32 weights: every map within
    bf16_product_bound() (3 roundings of 2^-8 per product, two products deep: 0.023) of its float32
    map's largest entry, and really computed in bf16 (not identical)."""
    got = compute_maps(trace(minilm, TEXT), ["value_zeroing"] + SCOPES, precision="bf16")
    errs = {m: _rel(lm, reference[m]) for m, (lm, _) in got.items()}
    assert max(errs.values()) < bf16_product_bound(), errs
    assert errs["AtbFf"] > 0 and errs["value_zeroing"] > 0, errs
    np.testing.assert_allclose(got["value_zeroing"][0].sum(-1), 1.0, atol=1e-10)


def _float64_twin(half: ctxmix.Model, tr):
    """The trace of a half-precision model redone in float64 on the same inputs: the same rounded
    weights and the model's own half-precision layer inputs and attention probabilities."""
    m64 = ctxmix.load_model("minilm", device="cpu", dtype="float64")
    with torch.no_grad():
        for p64, ph in zip(m64.hf.parameters(), half.hf.parameters(), strict=True):
            p64.copy_(ph.double())
    states = [layer_forward(lw, st.x.double(), st.alpha.double()) for lw, st in zip(m64.layers, tr.states)]
    return dataclasses.replace(tr, model=m64, hidden=[s.x for s in states] + [states[-1].y], states=states)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_are_decomposed_in_float32(reference, dtype):
    """A model loaded in half precision: its activations and weights are upcast, and the decompositions
    run in float32. Compared against what the half-precision model itself computes (its own layer
    inputs and attention probabilities, its rounded weights) decomposed in float64, every map agrees
    to the float32 bound of a d_ff-long product chain, whatever the CPU's half-precision kernels."""
    m = ctxmix.load_model("minilm", device="cpu", dtype=dtype)
    assert m.work_dtype == torch.float32 and m.layers[0].W2.dtype == torch.float32
    tr = trace(m, TEXT)
    twin = _float64_twin(m, tr)
    got, exact = compute_maps(tr, MIXING + SCOPES), compute_maps(twin, MIXING + SCOPES)
    bound = float32_decomposition_bound(m.config.intermediate_size)  # 4 x 1536 x 2^-24 = 3.7e-4
    for k in MIXING + SCOPES:
        for mine, ref in zip(got[k], exact[k]):
            if ref is not None:
                assert _rel(mine, ref) < bound, (k, _rel(mine, ref))
    # the attention map is the model's own probabilities, only upcast
    np.testing.assert_array_equal(got["attention"][0], exact["attention"][0])

    # End to end against the float32 model: the half-precision forward pass moves the activations the
    # maps are built from, by at most u per rounding on its path (half_model_map_bound, first order:
    # 43 u = 0.17 for bfloat16, 0.021 for float16); a decomposition done in half precision would not
    # stay within it (its products of length 384-1536 carry errors of K u, over 1 for bfloat16).
    ex = ctxmix.explain(m, TEXT, MIXING)
    errs = {k: _rel(ex.layer_maps[k], reference[k]) for k in MIXING}
    assert max(errs.values()) < half_model_map_bound(getattr(torch, dtype), m.n_layers), errs
    # the layers rebuilt in float32 against the model's own outputs: the model rounds each layer's
    # path ROUNDINGS_PER_LAYER times, each by at most u of the largest activation
    top = max(float(h.abs().max()) for h in tr.hidden)
    assert ex.reconstruction_error < 7 * UNIT_ROUNDOFF[getattr(torch, dtype)] * top, (ex.reconstruction_error, top)


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
    assert 0 < np.abs(a - b).max() < bf16_product_bound() * np.abs(b).max()


def test_tf32_products_on_the_tensor_cores_are_within_their_bound():
    """precision="tf32" on CUDA runs each big product as three bfloat16 products of the operands' split parts
    (`split_bf16_matmul`, no process-wide switch): against float64, each entry within `split_product_bound` of the
    sum of |a_i W_ij| (3 x 2^-16 for the split, K 2^-24 for the accumulation), finer than TF32 (one rounding of
    each operand to 10 bits, 2^-11). The CPU path computes the same bfloat16 parts' products, exactly, in
    float32; CUDA accumulates them in float32 on the tensor cores in another order (the K 2^-24 term)."""
    from ctxmix.engine.layer import big_matmul, split_bf16_matmul
    from ctxmix.engine.precision import split_product_bound

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 384, generator=g) * torch.logspace(-3, 3, 384)  # magnitudes over six decades
    W = torch.randn(384, 96, generator=g)
    exact = a.double() @ W.double()
    scale = a.double().abs() @ W.double().abs()
    got = split_bf16_matmul(a, W)
    assert got.dtype == torch.float32 and got.shape == (64, 96)
    err = (got.double() - exact).abs()
    assert float((err - split_product_bound(384) * scale).max()) <= 0
    tf32 = (a.double().abs() @ W.double().abs()) * 2 * 2.0**-11  # TF32's operand rounding, for comparison
    assert float((err / tf32).max()) < 0.1
    # on a CPU the "tf32" precision is plain float32 (the split costs three products there for nothing)
    assert torch.equal(big_matmul(a, W, "tf32"), a @ W)
