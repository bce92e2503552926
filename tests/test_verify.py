"""`ctxmix.verify` and `python -m ctxmix verify`: the tests' checks on a user's model."""

import numpy as np
import pytest
from conftest import tiny_model

import ctxmix
import ctxmix.cli
from ctxmix.verify import value_zeroing_loop, verify

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]


def test_verify_passes_on_every_family(tiny):
    df = verify(tiny)
    assert list(df.columns) == ["check", "error", "tolerance", "passed", "detail"]
    assert len(df) >= 9 and df["passed"].all(), df[~df["passed"]].to_string()
    assert any(df["check"].str.startswith("value zeroing")) and any(df["check"].str.startswith("FF closed-form"))
    causal = tiny.kind == "causal_lm" and tiny.spec.position != "post"
    assert df["check"].str.startswith("alti_logit: tokens").any() == causal


def test_the_loop_is_the_official_algorithm_on_bert(tokenizer):
    """The hook-based loop (whole model, n zeroings a batch) equals the layer-call loop that
    bench/perf.py times, and ctxmix's batched value zeroing."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("perf", Path(__file__).parents[1] / "bench" / "perf.py")
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    m = tiny_model("bert", tokenizer)
    loop = value_zeroing_loop(m, IDS)
    np.testing.assert_allclose(loop, perf.value_zeroing_loop(m, IDS), atol=1e-12)
    np.testing.assert_allclose(
        ctxmix.explain(m, None, ["value_zeroing"], input_ids=IDS).layer_maps["value_zeroing"], loop, atol=1e-10
    )


def _altered(tokenizer):
    """A model whose decomposition weights no longer are the ones it runs with."""
    m = tiny_model("llama", tokenizer)
    lw = m.layers[0]
    lw.Wv = lw.Wv * 1.05  # ctxmix's copy of layer 0's W_V, changed after loading
    return m


def test_verify_fails_on_altered_weights(tokenizer):
    df = verify(_altered(tokenizer)).set_index("check")
    assert not df.loc["layers recomputed from the weights = the model's hidden states", "passed"]
    assert not df.loc["value zeroing = the per-token loop on the model", "passed"]
    assert not df.loc["logit: tokens + unattributed terms = the model's logit difference", "passed"]
    assert not df.loc["decompx: token parts summed = the model's state after each layer", "passed"]
    assert not df.loc["decompx: token parts summed = the model's logits", "passed"]
    assert not df.loc["alti_logit: tokens + unattributed terms = the model's logit difference", "passed"]


def test_cli_verify_exit_codes(tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(ctxmix.cli, "_load", lambda args: tiny_model("gpt2", tokenizer))
    assert ctxmix.cli.main(["verify"]) == 0
    assert "checks passed on tiny-gpt2" in capsys.readouterr().out
    monkeypatch.setattr(ctxmix.cli, "_load", lambda args: _altered(tokenizer))
    with pytest.raises(SystemExit) as e:
        ctxmix.cli.main(["verify"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "check(s) failed on tiny-llama" in out


def test_verify_refuses_long_texts(tokenizer):
    with pytest.raises(ctxmix.BadInput, match="short texts"):
        verify(tiny_model("bert", tokenizer), "word " * 100)
