"""TF32 under torch's two APIs: the legacy flags (`torch.backends.cuda.matmul.allow_tf32`,
`torch.set_float32_matmul_precision`) and the fp32_precision settings (`torch.backends.fp32_precision`,
which transformers' `enable_tf32` sets, and the per-backend ones). Once a new setting contradicts the
legacy flags torch refuses to read them; ctxmix must run under either, set TF32 through the one in use
without mixing them, and leave every setting as it found it. TF32 is a process-wide switch that acts
on CUDA only, so the switches are checked here on a CPU with device="cuda"; every test restores
torch's global state (the `torch_tf32_state` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.engine import trace as trace_mod
from ctxmix.engine.precision import engine_precision, tf32_api, tf32_now, tf32_switches

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"), reason="torch < 2.9 has only the legacy TF32 API"
)

TEXT = "the quick brown fox jumps over the lazy dog and runs far away"
NODES = [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("mkldnn", "all"), ("mkldnn", "matmul")]


def _settings() -> dict:
    """Every fp32_precision setting as torch answers it (inherited values resolved) and the legacy
    reading, or "refused" where torch refuses it (a mix of the two APIs)."""
    out = {n: torch._C._get_fp32_precision_getter(*n) for n in NODES}
    try:
        out["legacy"] = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        out["legacy"] = "refused"
    return out


def _reset() -> None:
    """torch's defaults: nothing set through the new API, the legacy flag at "highest"."""
    torch.set_float32_matmul_precision("highest")
    for n in [("cuda", "matmul"), ("mkldnn", "matmul"), ("cuda", "all"), ("mkldnn", "all"), ("generic", "all")]:
        torch._C._set_fp32_precision_setter(*n, "none")


@pytest.fixture
def torch_tf32_state():
    """Puts torch's TF32 settings back as the test found them (torch's defaults, checked first)."""
    before = _settings()
    _reset()
    assert _settings() == before, "the test process does not start from torch's default TF32 settings"
    yield
    _reset()
    assert _settings() == before


SETUPS = {
    "defaults": lambda: None,
    "legacy flag on": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "legacy medium": lambda: torch.set_float32_matmul_precision("medium"),
    "new generic tf32 (enable_tf32)": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "new generic ieee": lambda: setattr(torch.backends, "fp32_precision", "ieee"),
    "new matmul leaf tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new generic tf32, matmul ieee": lambda: (
        setattr(torch.backends, "fp32_precision", "tf32"),
        setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"),
    ),
    "new CUDA-wide tf32": lambda: setattr(torch.backends.cudnn, "fp32_precision", "tf32"),
}

# changes a user may make afterwards: a setting ctxmix put back as explicit where it was inherited
# would no longer follow them
LATER = {
    "none": lambda: None,
    "generic ieee": lambda: setattr(torch.backends, "fp32_precision", "ieee"),
    "generic tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "CUDA-wide ieee": lambda: setattr(torch.backends.cudnn, "fp32_precision", "ieee"),
}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_engine_precision_sets_tf32_through_the_api_in_use_and_restores_it(torch_tf32_state, setup, precision):
    want = precision == "tf32"
    for later in LATER.values():
        _reset()  # the reference: what the settings are, and become, without ctxmix
        SETUPS[setup]()
        api, before = tf32_api(), _settings()
        later()
        reference = _settings()
        _reset()
        SETUPS[setup]()
        with engine_precision(precision, "cuda"):
            assert tf32_now() is want
            assert (torch._C._get_fp32_precision_getter("cuda", "matmul") == "tf32") is want
            if api == "legacy":  # set through the legacy flags: torch reads them, never a mix
                assert _settings()["legacy"] == ("high" if want else "highest", want) or (
                    want and before["legacy"] == ("medium", True)
                )
            with engine_precision("float32" if want else "tf32", "cuda"):  # nested: the lock is re-entrant
                assert tf32_now() is not want
            assert tf32_now() is want
        assert tf32_api() == api and _settings() == before
        later()
        assert _settings() == reference


@pytest.mark.parametrize("setup", SETUPS)
def test_a_rebuild_runs_under_the_switch_its_forward_pass_ran_with(torch_tf32_state, setup):
    """What a streamed trace records (`tf32_now`) and sets again (`tf32_switches`) under either API."""
    SETUPS[setup]()
    before, ran_with = _settings(), tf32_now()
    with engine_precision("float32" if ran_with else "tf32", "cuda"):  # another call in between
        with tf32_switches(ran_with, "cuda"):
            assert tf32_now() is ran_with
    assert _settings() == before
    with tf32_switches(not ran_with, "cpu"):  # nothing to set on a CPU
        assert _settings() == before


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


@pytest.mark.parametrize(
    "set_new_api",
    [
        lambda: setattr(torch.backends, "fp32_precision", "tf32"),  # what transformers' enable_tf32 does
        lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    ],
    ids=["generic", "cuda matmul"],
)
def test_routes_and_a_streamed_explain_run_under_the_new_tf32_api(torch_tf32_state, llama, monkeypatch, set_new_api):
    """Streamed traces record the TF32 switch of their forward pass: under the new API they run, and
    give what they give without it (float64 here, which TF32 never touches: the same bits)."""
    monkeypatch.setattr(trace_mod, "streams", lambda model, n: True)
    methods = ["alti", "value_zeroing", "logit", "alti_logit"]

    def run():
        ex = ctxmix.explain(llama, TEXT, methods)
        r = ctxmix.routes(llama, TEXT, threshold=0.05)
        return ex, r

    ref_ex, ref_r = run()
    set_new_api()
    assert tf32_api() == "new"
    settings = _settings()
    ex, r = run()
    assert _settings() == settings
    assert set(ref_ex.saliency) >= {"logit", "alti_logit"} and set(ref_ex.layer_maps) >= {"alti", "value_zeroing"}
    for m in ref_ex.layer_maps:
        np.testing.assert_array_equal(ex.layer_maps[m], ref_ex.layer_maps[m], err_msg=m)
    for m in ref_ex.saliency:
        np.testing.assert_array_equal(ex.saliency[m], ref_ex.saliency[m], err_msg=m)
    assert list(r.edges["source"]) == list(ref_r.edges["source"]) and len(r.edges) > 0
    np.testing.assert_array_equal(r.edges["weight"].to_numpy(), ref_r.edges["weight"].to_numpy())
