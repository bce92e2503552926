"""TF32 under torch's two APIs: the legacy flags (`torch.backends.cuda.matmul.allow_tf32`,
`torch.set_float32_matmul_precision`) and the fp32_precision settings (`torch.backends.fp32_precision`,
which transformers' `enable_tf32` sets, and the per-backend ones). TF32 is a process-wide setting of torch, so
ctxmix never writes it: a call's precision is carried by the call (`ctxmix.engine.layer.big_matmul`), one
session's tf32 never reaches another's float32 call, and no lock serialises them. ctxmix only reads it, under
either API, to warn a float32 call that the user's own TF32 is on. Checked here on a CPU with device="cuda"
(the settings exist without a GPU); every test restores torch's global state (the `torch_tf32_state` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.engine import precision as prec
from ctxmix.engine import trace as trace_mod
from ctxmix.engine.precision import engine_precision, tf32_now

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
@pytest.mark.parametrize("precision", ["float32", "tf32", "bf16"])
def test_engine_precision_never_writes_a_tf32_setting(torch_tf32_state, setup, precision, monkeypatch):
    """Whatever the user set, through either API: every setting is the same inside a call of any precision (nested
    too) and after it, and later changes of the user's reach torch as they would without ctxmix."""
    monkeypatch.setattr(prec, "_TF32_WARNED", True)  # the warning is its own test
    for later in LATER.values():
        _reset()  # the reference: what the settings are, and become, without ctxmix
        SETUPS[setup]()
        before = _settings()
        later()
        reference = _settings()
        _reset()
        SETUPS[setup]()
        with engine_precision(precision, "cuda"):
            assert _settings() == before
            with engine_precision("float32" if precision != "float32" else "tf32", "cuda"):
                assert _settings() == before
        assert _settings() == before
        later()
        assert _settings() == reference


@pytest.mark.parametrize("setup", ["defaults", "legacy flag on", "new generic tf32 (enable_tf32)"])
def test_a_float32_call_under_the_users_tf32_warns_once(torch_tf32_state, setup, monkeypatch):
    """The user's TF32 makes a float32 call's products TF32: said once per process, where it is on, read under
    either API; nothing said where it is off, nor on a CPU, nor for a tf32 call (finer than TF32 anyway)."""
    import warnings

    monkeypatch.setattr(prec, "_TF32_WARNED", False)
    SETUPS[setup]()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for precision, device in (("tf32", "cuda"), ("float32", "cpu"), ("float32", "cuda"), ("float32", "cuda")):
            with engine_precision(precision, device):
                pass
    said = [w for w in seen if "TF32 is on" in str(w.message)]
    assert len(said) == (0 if setup == "defaults" else 1), [str(w.message) for w in seen]
    assert tf32_now() is (setup != "defaults")


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
    """Under the new API, streamed traces and routes run and give what they give without it (float64 here, which
    TF32 never touches: the same bits), and leave every setting as it was."""
    monkeypatch.setattr(trace_mod, "streams", lambda model, n: True)
    methods = ["alti", "value_zeroing", "logit", "alti_logit"]

    def run():
        ex = ctxmix.explain(llama, TEXT, methods)
        r = ctxmix.routes(llama, TEXT, threshold=0.05)
        return ex, r

    ref_ex, ref_r = run()
    set_new_api()
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
