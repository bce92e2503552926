"""The optimised paths that bench/perf.py times give the same maps as the straightforward ones,
in float32 (the default dtype) as well as float64, and with the work split into several chunks."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAMILIES, tiny_model

import ctxmix.engine.workspace
import ctxmix.methods.mixing
from ctxmix.engine.trace import trace_ids
from ctxmix.methods.mixing import scope_layer_maps, value_zeroing_maps

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]


def _bench_perf():
    path = Path(__file__).resolve().parents[1] / "bench" / "perf.py"
    spec = importlib.util.spec_from_file_location("ctxmix_bench_perf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


perf = _bench_perf()


PACKERS = {"mkl": ctxmix.engine.workspace.MKL_PACKING, "onednn": ctxmix.engine.workspace.ONEDNN_PACKING}


@pytest.fixture(params=["one chunk", "many chunks, MKL packed", "many chunks, oneDNN packed", "single rows"])
def chunking(request, monkeypatch):
    """How the work is split, and which packed product the chunks after the first run on: each packer on any CPU
    that has it (not only where `Workspace.product` picks it), so both are checked on every family here."""
    workspace = ctxmix.engine.workspace
    if request.param.startswith("many chunks"):  # a few rows (or zeroed tokens) per chunk
        monkeypatch.setattr(ctxmix.methods.mixing, "CHUNK_ELEMENTS", 3 * len(IDS) * 40 * 3)
        packer = "mkl" if "MKL" in request.param else "onednn"
        if not PACKERS[packer]:
            pytest.skip(f"this torch has no {packer} packed product")
        monkeypatch.setattr(workspace, "PACKER", packer)
        monkeypatch.setattr(workspace, "ONEDNN_PACK_FIRST_ROWS", 1)  # oneDNN packs on a weight's first use too
    if request.param == "single rows":  # one row (or zeroed token) per chunk: views of one row must stay views
        monkeypatch.setattr(ctxmix.methods.mixing, "CHUNK_ELEMENTS", 1)
        # oneDNN where this torch has it (its fresh-tensor product with one token per chunk), else MKL
        monkeypatch.setattr(workspace, "PACKER", next((p for p in ("onednn", "mkl") if PACKERS[p]), None))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_batched_value_zeroing_equals_the_per_token_loop(tokenizer, family, dtype, chunking):
    m = tiny_model(family, tokenizer, dtype=dtype)
    loop = perf.value_zeroing_loop(m, IDS)
    fast = value_zeroing_maps(trace_ids(m, IDS))
    assert loop.shape == fast.shape == (m.n_layers, len(IDS), len(IDS))
    np.testing.assert_allclose(fast.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(fast, loop, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_factorised_value_zeroing_equals_straightforward(tokenizer, family, chunking):
    """Every family (pre-LN, RMSNorm, gated FF, causal row skipping), float32, against the
    path that applies the FF input projection to every perturbed vector."""
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    tr = trace_ids(m, IDS)
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    assert np.abs(slow).max() > 0.05
    np.testing.assert_allclose(fast.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-5, err_msg=family)
    if m.spec.causal:
        assert np.abs(np.triu(fast, 1)).max() == 0.0  # a token never mixes later tokens in


@pytest.mark.parametrize("family", FAMILIES)
def test_factorised_scope_maps_equal_straightforward_in_float32(tokenizer, family, chunking):
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    tr = trace_ids(m, IDS)
    fast, slow = scope_layer_maps(tr, next_ln=True), scope_layer_maps(tr, next_ln=True, factorised=False)
    assert fast.keys() == slow.keys()
    for k in fast:
        assert np.abs(slow[k]).max() > 0.1, k  # non-trivial maps
        np.testing.assert_allclose(fast[k], slow[k], rtol=0, atol=1e-5, err_msg=f"{family} {k}")


def test_loop_baseline_refuses_other_families(tokenizer):
    with pytest.raises(ValueError, match="BERT-like"):
        perf.value_zeroing_loop(tiny_model("gpt2", tokenizer), IDS)


def test_perf_table_helpers():
    assert perf.ids_for(5) == [101, 1000, 1007, 1014, 102]
    r = perf.row("x", "1 s", "3 s", 3.0, ">= 3x", True)
    assert list(r) == ["target", "measured", "baseline", "ratio", "goal", "pass"]
    assert r["ratio"] == "3.00" and r["pass"] == "yes"
    assert perf.row("y", "-")["pass"] == "-"


SALIENCY = ["grad", "grad_x_input", "integrated_gradients", "blank_out", "cat", "attcat"]


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_saliency_only_explain_rebuilds_no_layer(tokenizer, family, monkeypatch):
    """explain with only gradient / perturbation methods traces the logits alone (one forward pass,
    no attention weights, no layer rebuilt) and gives exactly the saliency of the full trace."""
    import ctxmix
    import ctxmix.engine.trace as T
    from ctxmix.methods.saliency import saliency_scores

    m = tiny_model(family, tokenizer)
    full = trace_ids(m, IDS)
    pos = 0 if family == "bert" else len(IDS) - 1
    foil = 1 - int(full.logits.argmax()) if family == "bert" else 3  # the other class; a token id
    want_target, want = saliency_scores(m, full, SALIENCY, position=pos, foil=foil, ig_steps=8)
    rebuilt = []
    monkeypatch.setattr(T, "layer_forward", lambda *a, **k: rebuilt.append(1) or full.states[0])
    ex = ctxmix.explain(m, None, SALIENCY, input_ids=IDS, foil=foil, ig_steps=8)
    assert rebuilt == []  # the old path rebuilt every layer here
    assert ex.target == want_target and ex.reconstruction_error == 0.0  # nothing recomputed, nothing to check
    for k in SALIENCY:
        np.testing.assert_array_equal(ex.saliency[k], want[k])
    assert ex.prediction == ctxmix.explain(m, None, ["attention"], input_ids=IDS).prediction  # the same logits
    # a mixing method still gets the full trace
    rebuilt.clear()
    ctxmix.explain(m, None, ["grad", "attention"], input_ids=IDS)
    assert len(rebuilt) == m.n_layers


@pytest.mark.slow
def test_gpu_check_rate_rows_dry_run_on_the_cpu():
    """bench/gpu_check.py --rate, the GPU-rate issue's prepared run, works end to end (here as its CPU dry run):
    every line is JSON, the value-zeroing rows agree with the loop, and the profile's categories add up to a
    positive time with the products' rate reported."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rate", "--tiny", "--only", "vz", "profile"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines[-1]["row"] == "summary"
    vz = [r for r in lines if r.get("section") == "vz"]
    assert any("max |map difference|" in r["target"] and r["pass"] == "yes" for r in vz)
    prof = [r for r in lines if r.get("section") == "profile"]
    assert [r["target"].split()[1] for r in prof] == ["scope_maps", "value_zeroing"]
    for r in prof:
        assert r["matrix products"] > 0 and 0 < r["whole call / matmul rate"] <= r["products alone / matmul rate"]
    assert not any("error" in r for r in lines)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_kept_weight_products_follow_an_in_place_weight_edit(tokenizer, family):
    """The products of weights kept with them (head_ff_maps, the FF input constants) are made again when a weight
    is edited in place (a notebook's ablation): value zeroing then equals the straightforward path on the edited
    model, never the old weights' numbers."""
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    value_zeroing_maps(trace_ids(m, IDS))  # the kept products of the unedited weights
    lw = m.layers[0]
    norm = lw.ln1 if lw.position == "post" else lw.ln2
    with torch.no_grad():
        (lw.Wg if lw.gated else lw.W1).mul_(-1.5)
        norm.gamma.mul_(0.5)
        if norm.beta is not None:
            norm.beta.add_(0.3)
    tr = trace_ids(m, IDS)
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-5)
    # an edit through .data bypasses the version counters: Model.weights_changed() drops what was kept
    (lw.Wu if lw.gated else lw.W1).data.mul_(0.25)
    norm.gamma.data.mul_(3.0)
    (norm.beta if norm.beta is not None else lw.Wo).data.add_(0.2)
    m.weights_changed()
    tr = trace_ids(m, IDS)
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-5)
