"""Sentence pairs: tokenised as the tokenizer pairs them, token_type_ids in every forward pass
(trace, gradients, IG, CAT, blank-out, deletion metrics, the runner), segments right, and the
A→B / B→A mixing summary."""

import json
import sqlite3

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import tiny_model

import ctxmix
from ctxmix import benchmark as runner
from ctxmix.analyses.pairs import cross_segment_mixing, segment_shares
from ctxmix.benchmark.metrics import TargetProbability, deletion_metrics, perturb
from ctxmix.errors import BadInput

A, B = "the keys to the cabinet are on the table .", "a key is in the drawer ."
SAL = ["grad", "grad_x_input", "integrated_gradients", "blank_out", "cat", "attcat"]
MIX = ["attention", "norm", "globenc", "alti", "value_zeroing"]


@pytest.fixture(scope="module")
def bert(tokenizer):
    return tiny_model("bert", tokenizer)


def test_pair_is_tokenised_as_the_tokenizer_pairs_it(bert, tokenizer):
    enc = tokenizer(A, B)
    ex = ctxmix.explain(bert, (A, B), ["attention"])
    assert ex.input_ids == enc["input_ids"]
    sep = tokenizer.sep_token_id
    first_sep = enc["input_ids"].index(sep)
    want = [-1] + [0] * (first_sep - 1) + [-1] + [1] * (len(enc["input_ids"]) - first_sep - 2) + [-1]
    assert ex.segments == want
    assert ctxmix.explain(bert, A, ["attention"]).segments == [-1] + [0] * (len(tokenizer(A)["input_ids"]) - 2) + [-1]


def test_token_types_reach_the_trace(bert, tokenizer):
    """The traced states are the model's with the pair's token types (and not without them)."""
    from ctxmix.engine.trace import trace

    enc = tokenizer(A, B, return_tensors="pt")
    tr = trace(bert, (A, B))
    assert tr.token_type_ids == enc["token_type_ids"][0].tolist() and 1 in tr.token_type_ids
    with torch.no_grad():
        want = bert.hf(**enc, output_hidden_states=True).hidden_states
        zero = bert.hf(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(tr.hidden[1], want[1][0], rtol=0, atol=1e-10)
    assert (tr.hidden[1] - zero[1][0]).abs().max() > 1e-3
    assert tr.reconstruction_error < 1e-8
    np.testing.assert_allclose(tr.logits.numpy(), bert.hf(**enc).logits[0].detach().numpy(), atol=1e-12)


def test_every_saliency_method_reads_the_token_types(bert, tokenizer):
    """A pair equals its ids with the pair's token types, and differs, method by method, from the
    same ids read as one segment: so every gradient and perturbation pass gets them."""
    enc = tokenizer(A, B)
    pair = ctxmix.explain(bert, (A, B), SAL + MIX, target=1, ig_steps=8)
    same = ctxmix.explain(
        bert, None, SAL + MIX, target=1, ig_steps=8, input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"]
    )
    flat = ctxmix.explain(
        bert,
        None,
        SAL + MIX,
        target=1,
        ig_steps=8,
        input_ids=enc["input_ids"],
        token_type_ids=[0] * len(enc["input_ids"]),
    )
    for m in SAL + MIX:
        np.testing.assert_array_equal(pair.saliency[m], same.saliency[m], err_msg=m)
        assert np.abs(pair.saliency[m] - flat.saliency[m]).max() > 1e-6, m
    # blank-out by hand: p_1(pair) - p_1(pair with token 3 -> [UNK]), token types kept
    with torch.no_grad():
        x = torch.tensor([enc["input_ids"]])
        tt = torch.tensor([enc["token_type_ids"]])
        p = torch.softmax(bert.hf(input_ids=x, token_type_ids=tt).logits[0], -1)[1]
        x[0, 3] = tokenizer.unk_token_id
        q = torch.softmax(bert.hf(input_ids=x, token_type_ids=tt).logits[0], -1)[1]
    assert pair.saliency["blank_out"][3] == pytest.approx(float(p - q), abs=1e-12)


def test_segments_alone_give_berts_token_types(bert, tokenizer):
    enc = tokenizer(A, B)
    pair = ctxmix.explain(bert, (A, B), ["grad", "alti"], target=0)
    by_segments = ctxmix.explain(
        bert, None, ["grad", "alti"], target=0, input_ids=enc["input_ids"], segments=pair.segments
    )
    assert by_segments.segments == pair.segments
    for m in ("grad", "alti"):
        np.testing.assert_array_equal(by_segments.saliency[m], pair.saliency[m])
    with pytest.raises(BadInput, match="segments has"):
        ctxmix.explain(bert, None, ["alti"], input_ids=enc["input_ids"], segments=[0, 1])
    with pytest.raises(BadInput, match="go with input_ids"):
        ctxmix.explain(bert, (A, B), ["alti"], segments=pair.segments)
    with pytest.raises(BadInput, match="pair"):
        ctxmix.explain(bert, (A, B, A), ["alti"])
    with pytest.raises(BadInput, match="second text"):
        ctxmix.explain(bert, (A, "  "), ["alti"])


def test_models_without_token_types_take_pairs_by_segments(tokenizer):
    gpt = tiny_model("gpt2", tokenizer)  # GPT-2 would add word embeddings of token types: none are passed
    ex = ctxmix.explain(gpt, (A, B), ["alti", "grad"])
    assert set(ex.segments) == {-1, 0, 1} and ex.reconstruction_error < 1e-8
    with pytest.raises(BadInput, match="reads no token_type_ids"):
        ctxmix.explain(gpt, None, ["alti"], input_ids=ex.input_ids, token_type_ids=[0] * len(ex.input_ids))


def test_batched_pairs_equal_one_at_a_time(bert):
    texts = [(A, B), "a fine film .", (B, A)]
    got = ctxmix.explain_batch(bert, texts, ["alti", "value_zeroing", "grad"], targets=[1, 1, 1])
    for t, ex in zip(texts, got):
        one = ctxmix.explain(bert, t, ["alti", "value_zeroing", "grad"], target=1)
        assert ex.segments == one.segments
        for m in ("alti", "value_zeroing", "grad"):
            np.testing.assert_allclose(ex.saliency[m], one.saliency[m], rtol=1e-9, atol=1e-12, err_msg=m)


def test_scope_maps_of_a_pair_read_the_token_types(bert, tokenizer):
    enc = tokenizer(A, B)
    a = ctxmix.scope_maps(bert, (A, B))
    b = ctxmix.scope_maps(bert, input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"])
    c = ctxmix.scope_maps(bert, input_ids=enc["input_ids"])
    np.testing.assert_array_equal(a["AtbFfResLn"], b["AtbFfResLn"])
    assert np.abs(a["AtbFfResLn"] - c["AtbFfResLn"]).max() > 1e-6


def test_deletion_moves_the_segment_boundary(bert, tokenizer):
    assert perturb([1, 2, 3, 4], [1], "delete", 0, 3, [0, 0, 1, 1]) == ([1, 3, 4], 2, [0, 1, 1])
    assert perturb([1, 2, 3, 4], [1], "pad", 0, 3, [0, 0, 1, 1]) == ([1, 0, 3, 4], 3, [0, 0, 1, 1])
    enc = tokenizer(A, B)
    ids, types = enc["input_ids"], enc["token_type_ids"]
    predict = TargetProbability(bert, 1)
    got = predict([ids, ids[:5] + ids[7:]], [0, 0], [types, types[:5] + types[7:]])
    with torch.no_grad():
        want = [
            torch.softmax(bert.hf(input_ids=torch.tensor([i]), token_type_ids=torch.tensor([t])).logits[0], -1)[1]
            for i, t in ((ids, types), (ids[:5] + ids[7:], types[:5] + types[7:]))
        ]
    np.testing.assert_allclose(got, [float(w) for w in want], atol=1e-12)
    sal = {"m": np.arange(len(ids), dtype=float)}
    with_types, p0 = deletion_metrics(predict, ids, sal, ["aopc", "comprehensiveness"], token_type_ids=types)
    without, q0 = deletion_metrics(predict, ids, sal, ["aopc", "comprehensiveness"])
    assert p0 == pytest.approx(float(want[0]), abs=1e-12) and abs(p0 - q0) > 1e-6
    assert with_types["m"]["aopc"] != without["m"]["aopc"]


def test_segment_shares_by_hand():
    segs = [-1, 0, 0, -1, 1, -1]
    M = np.zeros((6, 6))
    M[4] = [1, 2, 1, 0, 4, 0]  # B's token: 3/8 from A, 4/8 own, 1/8 special
    M[1] = [0, 1, 1, 1, 1, 0]  # A's tokens: 1/4 from B, 2/4 own, 1/4 special
    M[2] = [2, 0, 0, 0, 0, 2]  # 0 from B, 0 own, 1 special
    sh = segment_shares(M, segs)
    assert sh["A→B"] == pytest.approx({"other": 3 / 8, "own": 4 / 8, "special": 1 / 8})
    assert sh["B→A"] == pytest.approx({"other": 1 / 8, "own": 1 / 4, "special": 5 / 8})


def test_cross_segment_mixing_rows_sum_to_one(bert):
    ex = ctxmix.explain(bert, (A, B), ["attention", "alti", "globenc", "grad"], target=0)
    df = cross_segment_mixing(ex)
    L = bert.n_layers
    assert len(df) == 3 * 2 * L * 2 and set(df["method"]) == {"attention", "alti", "globenc"}
    np.testing.assert_allclose(df[["other", "own", "special"]].sum(1), 1.0, atol=1e-12)
    assert (df["other"] > 0).all()
    from ctxmix.export.plots import cross_mixing_figure

    fig = cross_mixing_figure(df)
    assert len(fig.data) == 3 * 2 * 2
    with pytest.raises(BadInput, match="not of a sentence pair"):
        cross_segment_mixing(ctxmix.explain(bert, A, ["alti"]))


def test_saved_pair_keeps_its_segments(bert, tmp_path):
    ex = ctxmix.explain(bert, (A, B), ["alti"])
    back = ctxmix.load_explanation(ex.save(tmp_path / "p.npz"))
    assert back.segments == ex.segments
    pd.testing.assert_frame_equal(cross_segment_mixing(back), cross_segment_mixing(ex))


def _saliency(db, method):
    with sqlite3.connect(str(db)) as c:
        return {
            r[0]: json.loads(r[1])
            for r in c.execute(
                "SELECT example_id, values_json FROM saliency WHERE method=? ORDER BY example_id", (method,)
            )
        }


def test_runner_reads_pairs_with_token_types_unless_told_not_to(tmp_path, tokenizer):
    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.save_pretrained(tmp_path / "bert", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "bert")
    data = tmp_path / "nli.csv"
    pd.DataFrame({"premise": [A, "a fine film ."], "hypothesis": [B, "it was long ."], "label": [1, 0]}).to_csv(
        data, index=False
    )
    out = {}
    for flag in (True, False):
        c = {
            "name": f"pairs-{flag}",
            "models": [str(tmp_path / "bert")],
            "token_type_ids": flag,
            "datasets": [
                {
                    "id": "nli",
                    "source": "file",
                    "path": str(data),
                    "text_field": "premise",
                    "text_pair_field": "hypothesis",
                }
            ],
            "methods": ["grad", "alti"],
            "metrics": ["aopc"],
            "target": "gold",
        }
        p = tmp_path / f"{c['name']}.yaml"
        p.write_text(yaml.safe_dump(c))
        db = tmp_path / f"{flag}.sqlite"
        runner.run_bench(p, db=db, quiet=True)
        out[flag] = _saliency(db, "grad")
    ex = ctxmix.explain(m, (A, B), ["grad"], target=1)
    np.testing.assert_allclose(out[True]["000000"], ex.saliency["grad"], rtol=1e-5, atol=1e-8)
    enc = tokenizer(A, B)
    flat = ctxmix.explain(
        m, None, ["grad"], target=1, input_ids=enc["input_ids"], token_type_ids=[0] * len(enc["input_ids"])
    )
    np.testing.assert_allclose(out[False]["000000"], flat.saliency["grad"], rtol=1e-5, atol=1e-8)
    # the default keeps the config hash of configs written before the option existed
    base = {
        "name": "h",
        "models": ["minilm"],
        "datasets": [{"id": "pl", "source": "pang_lee"}],
        "methods": ["alti"],
        "metrics": ["aopc"],
    }
    h0 = runner.validate_config(base).config_hash()
    assert runner.validate_config({**base, "token_type_ids": True}).config_hash() == h0
    assert runner.validate_config({**base, "token_type_ids": False}).config_hash() != h0
    with pytest.raises(BadInput, match="token_type_ids must be"):
        runner.validate_config({**base, "token_type_ids": "yes"})
