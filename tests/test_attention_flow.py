"""Attention flow (ctxmix.methods.flow; Abnar & Zuidema 2020, §3) against a toy case worked by hand, a
networkx reference and the two-layer closed form."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from conftest import tiny_model

from ctxmix.errors import BadInput
from ctxmix.methods.flow import (
    FLOW_ROW_MAX_TOKENS,
    FLOW_SCALE,
    attention_flow,
    augmented_attention,
    check_flow_cost,
    flow_cost_seconds,
    flow_error_bound,
    flow_graph,
    scaled_capacities,
)

A1 = np.array([[0.6, 0.2, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
A2 = np.array([[0.2, 0.5, 0.3], [0.3, 0.3, 0.4], [0.5, 0.25, 0.25]])
TOY = np.stack([A1, A2])[:, None]  # (L=2, H=1, n=3, n=3)
TOY_AHAT = [
    [[0.8, 0.1, 0.1], [0.05, 0.9, 0.05], [0.15, 0.15, 0.7]],
    [[0.6, 0.25, 0.15], [0.15, 0.65, 0.2], [0.25, 0.125, 0.625]],
]
TOY_RAW = [[0.8, 0.5, 0.3], [0.35, 0.9, 0.35], [0.45, 0.375, 0.775]]
TOY_FLOW = [[0.5, 0.3125, 0.1875], [0.21875, 0.5625, 0.21875], [0.28125, 0.234375, 0.484375]]


def softmax_attention(L: int, H: int, n: int, seed: int, causal: bool = False, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(L, H, n, n)) * scale
    if causal:
        x = np.where(np.tril(np.ones((n, n), dtype=bool)), x, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def nx_flows(ahat: np.ndarray, layer: int, pos: int) -> np.ndarray:
    """A reference: the graph written edge by edge, one networkx max-flow per input token."""
    G = nx.DiGraph()
    n = ahat.shape[-1]
    for l in range(1, layer + 1):
        for i in range(n):
            for j in range(n):
                if ahat[l - 1][i, j] > 0:
                    G.add_edge((l, i), (l - 1, j), capacity=float(ahat[l - 1][i, j]))
    flow_func = nx.algorithms.flow.preflow_push if layer % 2 else nx.algorithms.flow.edmonds_karp
    return np.array(
        [nx.maximum_flow_value(G, (layer, pos), (0, j), flow_func=flow_func) if (0, j) in G else 0.0 for j in range(n)]
    )


def test_toy_oracle():
    ahat = augmented_attention(TOY)
    np.testing.assert_allclose(ahat, TOY_AHAT, atol=1e-15)
    np.testing.assert_allclose(augmented_attention(TOY, residual=0.2), 0.2 * np.eye(3) + 0.8 * TOY[:, 0], atol=1e-15)
    raw = attention_flow(TOY, normalise=False)
    norm = attention_flow(TOY)
    bound = flow_error_bound(3, 2)
    np.testing.assert_allclose(raw[1], TOY_RAW, rtol=0, atol=bound)
    np.testing.assert_allclose(norm[1], TOY_FLOW, rtol=0, atol=4 * bound)
    # layer 1: the flow from (1, i) to (0, j) is the single edge's capacity
    np.testing.assert_allclose(raw[0], TOY_AHAT[0], rtol=0, atol=bound)
    np.testing.assert_allclose(norm[0], np.array(TOY_AHAT[0]) / np.sum(TOY_AHAT[0], -1, keepdims=True), atol=4 * bound)
    # the head-averaged (L, n, n) input is the same
    np.testing.assert_array_equal(attention_flow(TOY[:, 0]), norm)


def test_super_sink_is_not_attention_flow():
    """One max-flow to a super-sink joined to every input token is NOT the per-pair flow."""
    ahat = np.array(TOY_AHAT)
    G = nx.DiGraph()
    for l in (1, 2):
        for i in range(3):
            for j in range(3):
                G.add_edge((l, i), (l - 1, j), capacity=ahat[l - 1][i, j])
    for j in range(3):
        G.add_edge((0, j), "sink", capacity=np.inf)
    value, flow = nx.maximum_flow(G, (2, 0), "sink", flow_func=nx.algorithms.flow.edmonds_karp)
    shares = np.array([flow[(0, j)]["sink"] for j in range(3)])
    assert value == pytest.approx(1.0)  # the super-sink flow is the source's out-capacity
    raw = attention_flow(TOY, rows=[0], layers=[1], normalise=False)[1, 0]
    assert raw.sum() == pytest.approx(1.6, abs=1e-8)  # per-pair flows share edges: they sum to more
    assert np.abs(shares / value - attention_flow(TOY)[1, 0]).max() > 0.1


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_equals_networkx(causal):
    att = softmax_attention(3, 2, 6, seed=1 if causal else 0, causal=causal, scale=2.0)
    ahat = augmented_attention(att)
    raw = attention_flow(att, normalise=False)
    norm = attention_flow(att)
    assert not np.isnan(raw).any()
    bound = flow_error_bound(6, 3, causal=causal)
    assert bound < 1e-7  # tight enough that a wrong flow cannot hide in it
    for l in range(3):
        for i in range(6):
            ref = nx_flows(ahat, l + 1, i)
            np.testing.assert_allclose(raw[l, i], ref, rtol=0, atol=bound, err_msg=f"layer {l}, row {i}")
            np.testing.assert_allclose(norm[l, i], ref / ref.sum(), rtol=0, atol=7 * bound)
    if causal:  # nothing flows to a later token; the graph of row i holds only positions <= i
        assert np.all(np.triu(raw[-1], 1) == 0)
        graph, reached = flow_graph(scaled_capacities(ahat), 3, 2)
        assert reached.tolist() == [True] * 3 + [False] * 3
        assert set(graph.indices % 6) <= {0, 1, 2}


def two_layer_closed_form(ahat: np.ndarray) -> np.ndarray:
    """maxflow((2, u), (0, v)) = Σ_k min(Â²_uk, Â¹_kv): the 2-hop paths share no edge."""
    return np.minimum(ahat[1][:, :, None], ahat[0][None, :, :]).sum(1)


def test_two_layer_closed_form():
    att = softmax_attention(2, 3, 9, seed=2, scale=3.0)
    raw = attention_flow(att, normalise=False)
    ahat = augmented_attention(att)
    closed = two_layer_closed_form(ahat)
    np.testing.assert_allclose(raw[1], closed, rtol=0, atol=flow_error_bound(9, 2))
    # and it is not rollout (products), which a wrong solver could drift towards
    assert np.abs(closed - ahat[1] @ ahat[0]).max() > 0.05


def test_rows_fill_only_those_rows():
    att = softmax_attention(3, 2, 7, seed=3)
    full = attention_flow(att)
    one = attention_flow(att, rows=[4])
    assert np.isnan(np.delete(one, 4, axis=1)).all()
    np.testing.assert_array_equal(one[:, 4], full[:, 4])
    last = attention_flow(att, rows=[-1], layers=[2], normalise=False)
    assert np.isnan(last[:2]).all() and np.isnan(last[2, :6]).all()
    np.testing.assert_array_equal(last[2, 6], attention_flow(att, normalise=False)[2, 6])
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-12)


def test_progress_counts_max_flows():
    calls = []
    attention_flow(softmax_attention(2, 1, 4, seed=4), rows=[0, 3], progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (16, 16) and len(calls) == 4


def test_error_bound_and_cost():
    assert FLOW_SCALE == 2**30
    assert flow_error_bound(128, 12) == pytest.approx(12 * 128**2 * 0.5 / 2**30)  # 9.2e-5
    assert flow_cost_seconds(2 * FLOW_ROW_MAX_TOKENS, 6) > 60 >= flow_cost_seconds(FLOW_ROW_MAX_TOKENS, 6)
    check_flow_cost(FLOW_ROW_MAX_TOKENS, 6)
    with pytest.raises(BadInput, match=rf"would take about .* per row .* limited to {FLOW_ROW_MAX_TOKENS} tokens"):
        check_flow_cost(FLOW_ROW_MAX_TOKENS + 1, 6)


@pytest.mark.parametrize(
    "bad, kwargs, match",
    [
        (np.ones((3, 3)) / 3, {}, "shape"),
        (np.ones((2, 1, 3, 4)) / 4, {}, "shape"),
        (np.ones((2, 1, 1, 3, 3)) / 3, {}, "shape"),
        (TOY * np.array([1, 1, -1])[None, None, None, :] + 0.3, {}, ">= 0"),
        (TOY * 2, {}, "sum to 1"),
        (np.where(TOY > 0.45, np.nan, TOY), {}, "NaN"),
        (TOY, {"residual": 1.5}, "residual"),
        (TOY, {"rows": [3]}, "position 3"),
        (TOY, {"rows": [-4]}, "position -4"),
        (TOY, {"rows": [0.5]}, "whole numbers"),
        (TOY, {"layers": [2]}, "layer 2"),
    ],
)
def test_bad_input(bad, kwargs, match):
    with pytest.raises(BadInput, match=match):
        attention_flow(bad, **kwargs)


# ---------------------------------------------------------------------------------------------
# attention flow on causal models (the paper's §5): a caveat on the explanation, left out of the runner's "all"
# ---------------------------------------------------------------------------------------------


def test_flow_on_a_causal_model_carries_the_papers_caveat(tokenizer, tmp_path, monkeypatch):
    """The paper defines flow on encoders and warns of the bias towards early tokens on decoders: an
    explanation of a causal model says so (also through the dashboard's cache, with another method of
    the text cached first), an encoder's does not."""
    import ctxmix
    from ctxmix.methods.flow import CAUSAL_CAVEAT
    from ctxmix.service import cache

    gpt2, bert = tiny_model("gpt2", tokenizer), tiny_model("bert", tokenizer)
    assert CAUSAL_CAVEAT in ctxmix.explain(gpt2, "the keys are here", ["attention_flow"]).warnings
    assert CAUSAL_CAVEAT not in ctxmix.explain(bert, "the keys are here", ["attention_flow"]).warnings
    got = ctxmix.explain_batch(
        gpt2, ["the keys are here", "a dog"], ["attention_flow"], methods_per_text=[["attention_flow"], []]
    )
    assert CAUSAL_CAVEAT in got[0].warnings and CAUSAL_CAVEAT not in got[1].warnings
    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path))
    cache.mem_clear()
    try:
        cache.cached_explain(gpt2, "the keys are here", ["attention"])
        ex = cache.cached_explain(gpt2, "the keys are here", ["attention", "attention_flow"])
        assert ex.warnings.count(CAUSAL_CAVEAT) == 1
    finally:
        cache.mem_clear()


def test_the_runners_all_leaves_flow_out_on_causal_models(tokenizer):
    """`methods: all` adds attention flow for encoders only; named, it runs on a causal model too."""
    from ctxmix.benchmark.compute import applicable_methods

    gpt2, bert = tiny_model("gpt2", tokenizer), tiny_model("bert", tokenizer)
    assert "attention_flow" in applicable_methods(bert, ["all"], has_foil=False)[0]
    assert "attention_flow" not in applicable_methods(gpt2, ["all"], has_foil=False)[0]
    assert "decompx" in applicable_methods(gpt2, ["all"], has_foil=False)[0]  # the rest of "all" stays
    assert "attention_flow" in applicable_methods(gpt2, ["all", "attention_flow"], has_foil=False)[0]
    assert "attention_flow" in applicable_methods(gpt2, ["attention_flow"], has_foil=False)[0]
