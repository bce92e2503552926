"""Information flow routes (Ferrando & Voita 2024): the LM Transparency Tool's value tests
(`routes/test_contributions.py`, transcribed) and two cases worked by hand, R1/R2; on a tiny random model of
every family, the lazy top-down routes equal a dense reference written here (every part of every node built
one position at a time, checked against the node's real vector, then the full graph and its reachability, as
the tool); at threshold 0 each residual node's incoming weights sum to one; the outputs (frames, networkx,
JSON, figure) and the refusals."""

import json

import networkx as nx
import numpy as np
import pytest
import torch
from conftest import FAMILIES, tiny_model

import ctxmix
from ctxmix.engine.layer import head_vectors, value_bias_rows
from ctxmix.engine.trace import trace
from ctxmix.errors import BadInput
from ctxmix.methods.routes import (
    _attention_node,
    _Collector,
    _LayerParts,
    attention_importance,
    ffn_importance,
    part_importance,
    routes_from_trace,
    threshold_renormalise,
)

TEXT = "the keys to the old cabinet are on"
t64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731


def _attn_parts(alpha, vo, x_prev, x_mid) -> _LayerParts:
    """A layer whose attention node is x_mid = x_prev + sum alpha vo (pre-LN, no map)."""
    n, d = t64(x_prev).shape
    z = torch.zeros(n, d, dtype=torch.float64)
    return _LayerParts(
        alpha=t64(alpha),
        vo=t64(vo),
        sub_scale=None,
        res=t64(x_prev),
        whole_a=t64(x_mid),
        ffn=z,
        ffn_res=z,
        whole_i=z,
        parallel=False,
    )


# ---------------------------------------------------------------- the tool's tests (atol 1e-4, as there)


def test_tool_mlp_contributions():
    P = _LayerParts(
        alpha=None,
        vo=None,
        sub_scale=None,
        res=None,
        whole_a=None,
        ffn=t64([[1.0, 1.0]]),
        ffn_res=t64([[0.0, 0.0]]),
        whole_i=t64([[1.0, 1.0]]),
        parallel=False,
    )
    c_mlp, c_res = ffn_importance(P, [0], p=1, eps=1e-5)
    assert c_mlp.item() == pytest.approx(1.0, abs=1e-4) and c_res.item() == pytest.approx(0.0, abs=1e-4)
    assert c_mlp.item() == pytest.approx(0.999995, abs=1e-6)  # the exact value with the tool's clip


def test_tool_decomposed_attn_contributions_l2():
    """resid_pre [2, 1], resid_mid [2, 2], head parts [1, 1] and [-1, 0]: 0.43613 / 0 and 0.56387 (L2)."""
    P = _attn_parts([[[1.0]], [[1.0]]], [[[1.0, 1.0]], [[-1.0, 0.0]]], [[2.0, 1.0]], [[2.0, 2.0]])
    sub, res, _ = attention_importance(P, [0], causal=True, p=2, eps=1e-5, device_chunk=1 << 20)
    assert sub.shape == (1, 1, 2) and res.shape == (1,)
    np.testing.assert_allclose(sub[0, 0].numpy(), [0.43613, 0.0], atol=1e-4)
    assert res.item() == pytest.approx(0.56387, abs=1e-4)


@pytest.mark.parametrize(
    "pre, post, neurons, want, want_res",
    [
        ([10, 10], [-10, 10], [[0, 1], [1, 0], [-21, -1]], [1, 0, 0], 0.0),  # test_decomposed_mlp_contributions
        ([1, 1], [4, 4], [[1, 1], [2, 2]], [0.25, 0.5], 0.25),  # ..._single_direction
    ],
)
def test_tool_decomposed_mlp_contributions_l2(pre, post, neurons, want, want_res):
    c = part_importance(t64(neurons + [pre]), t64(post), p=2, eps=1e-5)
    np.testing.assert_allclose(c[:-1].numpy(), want, atol=1e-4)
    assert c[-1].item() == pytest.approx(want_res, abs=1e-4)


def test_tool_contribution_shapes():
    """batch 4, tokens 5, heads 6, d_model 10 as the tool's fixtures: (targets, sources, heads) and (targets,)."""
    g = torch.Generator().manual_seed(123)
    n, H, d = 5, 6, 10
    alpha = torch.softmax(torch.randn(H, n, n, generator=g, dtype=torch.float64), -1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    vo = torch.randn(H, n, d, generator=g, dtype=torch.float64)
    mid = x + torch.einsum("htj,hjd->td", alpha, vo)
    P = _LayerParts(
        alpha=alpha, vo=vo, sub_scale=None, res=x, whole_a=mid, ffn=x, ffn_res=mid, whole_i=mid + x, parallel=False
    )
    sub, res, _ = attention_importance(P, list(range(n)), causal=False, p=1, eps=1e-5, device_chunk=1 << 20)
    assert sub.shape == (n, n, H) and res.shape == (n,)
    f, r = ffn_importance(P, list(range(n)), p=1, eps=1e-5)
    assert f.shape == r.shape == (n,)
    torch.testing.assert_close(sub.sum((1, 2)) + res, torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)


def test_tool_renormalizing_threshold():
    b, r = threshold_renormalise(t64([[0.05, 0.15], [0.05, 0.05]]), t64([0.8, 0.9]), 0.1)
    np.testing.assert_allclose(b.numpy(), [[0, 0.157894], [0, 0]], atol=1e-4)
    np.testing.assert_allclose(r.numpy(), [0.842105, 1.0], atol=1e-4)


# ---------------------------------------------------------------- cases worked by hand


def _node(P, t, tau, mode):
    col = _Collector()
    sub, res, _ = attention_importance(P, [t], causal=True, p=1, eps=1e-5, device_chunk=1 << 20)
    _attention_node(col, 0, t, f"A0_{t}", lambda j: f"X0_{j}", sub[0], float(res[0]), None, tau, mode, False)
    e, _ = col.frames()
    return sub[0], float(res[0]), e.groupby("source")["weight"].sum().to_dict()


def test_r1_node_contributions_and_both_modes():
    """R1 (T = 2, H = 2): dec[pos, key, head] = alpha * vo (the paper's Eq. 4)."""
    alpha = [[[1.0, 0.0], [5.0, 1.0]], [[1.0, 0.0], [-1.5, 1.0]]]  # [head][pos][key]
    vo = [[[0.1, 0.1], [0.2, 0.0]], [[0.0, 0.2], [0.1, 0.4]]]  # [head][key]
    P = _attn_parts(alpha, vo, [[0.3, -0.2], [1.0, 0.0]], [[0.4, 0.1], [1.8, 0.6]])
    sub, res, _ = _node(P, 1, 0.04, "subedge_renorm")
    np.testing.assert_allclose(sub.numpy(), [[0.370369, 0.000004], [0.074074, 0.185185]], atol=2e-6)
    assert res == pytest.approx(0.370369, abs=2e-6)
    _, _, w = _node(P, 1, 0.04, "subedge_renorm")
    assert w["X0_0"] == pytest.approx(0.370370, abs=2e-6) and w["X0_1"] == pytest.approx(0.629630, abs=2e-6)
    _, _, w = _node(P, 1, 0.2, "subedge_renorm")
    assert w["X0_0"] == pytest.approx(0.5, abs=2e-6) and w["X0_1"] == pytest.approx(0.5, abs=2e-6)
    _, _, w = _node(P, 1, 0.2, "summed_edge")
    assert w["X0_0"] == pytest.approx(0.370372, abs=2e-6) and w["X0_1"] == pytest.approx(0.629628, abs=2e-6)


def test_r2_modes_give_different_graphs():
    alpha = [[[1.0, 0.0], [0.6, 0.0]], [[0.0, 0.0], [0.6, 0.0]]]
    vo = [[[0.5, 0.0], [0.0, 0.0]], [[0.0, 0.5], [0.0, 0.0]]]
    P = _attn_parts(alpha, vo, [[1.0, 0.0], [0.0, 1.0]], [[1.5, 0.0], [0.3, 1.3]])
    sub, res, w = _node(P, 1, 0.2, "summed_edge")
    np.testing.assert_allclose(sub[0].numpy(), [0.1875, 0.1875], atol=1e-4)
    assert res == pytest.approx(0.624992, abs=2e-5)
    assert w["X0_0"] == pytest.approx(0.374996, abs=2e-5)  # summed, kept
    _, _, w = _node(P, 1, 0.2, "subedge_renorm")
    assert "X0_0" not in w and w["X0_1"] == pytest.approx(1.0)  # each head below tau: dropped


# ---------------------------------------------------------------- every family against a dense reference


def _centre(v, norm):
    return v - v.mean(-1, keepdim=True) if norm.kind == "layernorm" else v


def _scale(norm, real):
    return norm.gamma / norm.scale(real)


def _prox(z, y, eps=1e-5):
    return max(float(y.abs().sum() - (y - z).abs().sum()), eps)


def dense_layer(lw, st):
    """Every node of one layer built densely, one target at a time, each checked against its real vector:
    returns per target t: (parts[j][h] (d,), residual, ffn-or-None, whole) for the attention (or parallel)
    node and (ffn, residual, whole) for the FFN node."""
    n = st.x.shape[0]
    H = lw.n_heads
    src = st.x if lw.position == "post" else lw.ln1(st.x)
    f = head_vectors(lw, src, with_bias=False)  # (H, n, d)
    vb = value_bias_rows(lw, None, st.alpha)  # sum_h (sum_j alpha) b_V W_O: nobody's, as the tool
    bias_attn = vb + lw.bo
    A, F = [], []
    for t in range(n):
        dec = [[st.alpha[h, t, j] * f[h, j] for h in range(H)] for j in range(n)]
        if lw.position == "post":
            m = _scale(lw.ln1, st.r1[t])
            parts = [[_centre(v, lw.ln1) * m for v in row] for row in dec]
            res, whole = _centre(st.x[t], lw.ln1) * m, lw.ln1(st.r1[t])
            bias = _centre(bias_attn[t], lw.ln1) * m + lw.ln1.beta
            ffn_p = None
        elif lw.position == "sandwich":
            na = lw.post_attn_norm
            m = _scale(na, st.attn[t])
            parts = [[_centre(v, na) * m for v in row] for row in dec]
            res, whole = st.x[t], st.x[t] + na(st.attn[t])
            bias = _centre(bias_attn[t], na) * m + (na.beta if na.beta is not None else 0)
            ffn_p = None
        elif lw.position == "parallel":
            parts, res, whole, bias = dec, st.x[t], st.y[t], bias_attn[t]
            ffn_p = st.ff[t]
        else:
            parts, res, whole, bias = dec, st.x[t], st.x[t] + st.attn[t], bias_attn[t]
            ffn_p = None
        total = res + sum(v for row in parts for v in row) + (0 if ffn_p is None else ffn_p)
        torch.testing.assert_close(total + bias, whole, rtol=0, atol=1e-10 * float(whole.abs().max()))
        A.append((parts, res, ffn_p, whole))
        if lw.position == "post":
            m2 = _scale(lw.ln2, st.r2[t])
            fp, fr = _centre(st.ff[t], lw.ln2) * m2, _centre(st.z[t], lw.ln2) * m2
            F.append((fp, fr, lw.ln2(st.r2[t])))
            torch.testing.assert_close(
                fp + fr + lw.ln2.beta, F[-1][2], rtol=0, atol=1e-10 * float(F[-1][2].abs().max())
            )
        elif lw.position != "parallel":
            fp = lw.post_ff_norm(st.ff[t]) if lw.position == "sandwich" else st.ff[t]
            F.append((fp, st.r1[t], st.y[t]))
            torch.testing.assert_close(fp + st.r1[t], st.y[t], rtol=0, atol=1e-10 * float(st.y[t].abs().max()))
    return A, F


def _renorm(vals: dict, tau: float) -> dict:
    kept = {k: v for k, v in vals.items() if v > tau}
    z = sum(kept.values()) or 1.0
    return {k: v / z for k, v in kept.items()}


def reference_routes(model, tr, position, tau):
    """The tool's way: the full graph (every node of every layer, mode R), then what reaches the start node."""
    G = nx.DiGraph()
    n, L = tr.n, model.n_layers
    causal = model.spec.causal
    for l, (lw, st) in enumerate(zip(model.layers, tr.states)):
        A, F = dense_layer(lw, st)
        src = (lambda j, l=l: f"I{l - 1}_{j}") if l > 0 else (lambda j: f"X0_{j}")
        H = lw.n_heads
        for t in range(n):
            parts, res, ffn_p, whole = A[t]
            prox = {(j, h): _prox(parts[j][h], whole) for j in range(n) for h in range(H)}
            prox["res"] = _prox(res, whole)
            if ffn_p is not None:
                prox["ffn"] = _prox(ffn_p, whole)
            Z = sum(prox.values())
            imp = {k: v / Z for k, v in prox.items() if not (causal and k not in ("res", "ffn") and k[0] > t)}
            kept = _renorm(imp, tau)
            node = f"I{l}_{t}" if ffn_p is not None else f"A{l}_{t}"
            w: dict = {}
            for k, v in kept.items():
                if k == "ffn":
                    G.add_edge(src(t), f"M{l}_{t}", weight=v)
                    G.add_edge(f"M{l}_{t}", node, weight=v)
                else:
                    j = t if k == "res" else k[0]
                    w[j] = w.get(j, 0.0) + v
            for j, v in w.items():
                G.add_edge(src(j), node, weight=v)
            if ffn_p is None:
                fp, fr, fw = F[t]
                p_f, p_r = _prox(fp, fw), _prox(fr, fw)
                kept = _renorm({"ffn": p_f / (p_f + p_r), "res": p_r / (p_f + p_r)}, tau)
                if "ffn" in kept:
                    G.add_edge(f"A{l}_{t}", f"M{l}_{t}", weight=kept["ffn"])
                    G.add_edge(f"M{l}_{t}", f"I{l}_{t}", weight=kept["ffn"])
                if "res" in kept:
                    G.add_edge(f"A{l}_{t}", f"I{l}_{t}", weight=kept["res"])
    start = f"I{L - 1}_{position}"
    R = G.reverse(copy=False)
    seen = {(v, u) for u, v in nx.edge_dfs(R, start)}  # edges of the reversed graph, back in the original order
    return {e: G.edges[e]["weight"] for e in seen}


@pytest.mark.parametrize("family", FAMILIES)
def test_routes_equal_the_dense_reference(family, tokenizer):
    m = tiny_model(family, tokenizer)
    if m.spec.encoder_decoder:
        pytest.skip("encoder-decoders are out of scope")
    tr = trace(m, TEXT)
    position = tr.n - 1 if m.spec.causal else 0
    for tau in (0.04, 0.1):
        r = routes_from_trace(m, tr, position, threshold=tau)
        got = {(s, t): w for s, t, w in zip(*(r.graph_edges()[c] for c in ("source", "target", "weight")))}
        want = reference_routes(m, tr, position, tau)
        assert set(got) == set(want), (family, tau, set(got) ^ set(want))
        for e, w in want.items():
            assert got[e] == pytest.approx(w, abs=1e-10), (family, tau, e)


@pytest.mark.parametrize("family", FAMILIES)
def test_threshold_zero_incoming_weights_sum_to_one(family, tokenizer):
    """Every residual node (A, I) of the routes at tau = 0: its incoming edges (heads, residual, FFN) sum
    to one; an FFN node's single incoming edge carries the FFN's share (exempt)."""
    m = tiny_model(family, tokenizer)
    r = ctxmix.routes(m, TEXT, threshold=0.0)
    sums = r.edges.groupby("target")["weight"].sum()
    for node, s in sums.items():
        if node[0] in "AI":
            assert s == pytest.approx(1.0, abs=1e-12), (node, s)
    if m.spec.causal:  # nothing reaches a decoder's position from a later token
        assert r.nodes["position"].max() <= r.position
        src, dst = (r.edges[c].map(lambda s: int(s.split("_")[1])) for c in ("source", "target"))
        assert (src <= dst).all()


def test_outputs_and_side_panels(tokenizer, tmp_path):
    m = tiny_model("llama", tokenizer)
    r = ctxmix.routes(m, TEXT, position=-2, threshold=0.04)
    assert r.position == len(r.tokens) - 2 and r.start == f"I{m.n_layers - 1}_{r.position}"
    assert {"source", "target", "weight", "kind", "layer", "head"} <= set(r.edges.columns)
    assert set(r.edges["kind"]) <= {"attention", "residual", "ffn"}
    assert r.edges.loc[r.edges["kind"] == "attention", "head"].notna().all()
    G = r.to_networkx()
    assert isinstance(G, nx.DiGraph) and r.start in G and G.number_of_edges() == len(r.graph_edges())
    assert all(nx.has_path(G, u, r.start) for u in G.nodes)  # every node reaches the prediction node
    data = json.loads(r.to_json())
    assert data["threshold"] == 0.04 and len(data["edges"]) == len(r.edges) and data["tokens"] == r.tokens
    fig = r.figure()
    assert fig.data and "τ = 0.04" in fig.layout.title.text
    a_node = next(s for s in r.nodes["node"] if s.startswith("A"))
    d = r.node_detail(a_node)
    assert {"attention", "residual"} <= set(d["kind"]) and d["importance"].is_monotonic_decreasing
    i_node = r.start
    shares = r.node_detail(i_node).set_index("kind")["importance"]
    assert shares["ffn"] + shares["residual"] == pytest.approx(1.0)
    hi = r.head_importance()
    assert {"layer", "head", "importance", "activated"} <= set(hi.columns) and hi["activated"].any()
    # L2 and the paper's clip give other numbers, not errors
    assert len(ctxmix.routes(m, TEXT, p=2, eps=0.0).edges)


def test_value_bias_options_and_refusals(tokenizer):
    m = tiny_model("qwen2", tokenizer)  # Qwen2 has a value bias: the option matters
    a = ctxmix.routes(m, TEXT, threshold=0.0)
    b = ctxmix.routes(m, TEXT, threshold=0.0, value_bias="distribute")
    assert not np.allclose(a.incoming["importance"].to_numpy()[:50], b.incoming["importance"].to_numpy()[:50])
    for kw, msg in [
        ({"threshold": 1.5}, "threshold"),
        ({"mode": "dense"}, "mode"),
        ({"p": 0.5}, "p "),
        ({"value_bias": "twice"}, "value_bias"),
        ({"position": 99}, "outside"),
    ]:
        with pytest.raises(BadInput, match=msg):
            ctxmix.routes(m, TEXT, **kw)
    with pytest.raises(BadInput, match="not on these routes"):
        a.node_detail("A0_999")


def test_summed_edge_mode_and_paper_clip(tokenizer):
    """summed_edge: a head is activated only by a sub-edge above tau, the residual is kept only with its
    self edge, and every kept summed edge's weight is above tau; eps = 0 (the paper's clip) gives no NaN;
    the FFN bypass keeps its own kind in the graph."""
    m = tiny_model("gpt2", tokenizer)
    r = ctxmix.routes(m, TEXT, threshold=0.1, mode="summed_edge")
    assert (r.graph_edges()["weight"] > 0.1).all()
    hi = r.head_importance()
    att = r.incoming[r.incoming["kind"] == "attention"]
    layer = att["node"].map(lambda s: int(s[1:].split("_")[0]))
    above = {(int(l), int(h)) for l, h, v in zip(layer, att["head"], att["importance"]) if v > 0.1}
    assert {(int(l), int(h)) for l, h, a in zip(hi["layer"], hi["head"], hi["activated"]) if a} == above
    res = r.incoming[r.incoming["kind"] == "residual"]
    for node, w in zip(res["node"], res["weight"]):
        if w > 0:  # a kept residual sits on a kept self edge
            t = node.split("_")[1]
            assert ((r.edges["target"] == node) & r.edges["source"].str.endswith("_" + t)).any()
    paper = ctxmix.routes(m, TEXT, eps=0.0, threshold=0.0)
    assert np.isfinite(paper.incoming[["importance", "weight"]].to_numpy(dtype=float)).all()
    kinds = set(r.graph_edges()["kind"])
    assert kinds <= {"attention", "residual", "ffn"}
    bypass = r.graph_edges()[
        r.graph_edges()["source"].str.startswith("A") & r.graph_edges()["target"].str.startswith("I")
    ]
    assert set(bypass["kind"]) <= {"residual"} and len(bypass)
    with pytest.raises(BadInput, match="finite"):
        ctxmix.routes(m, TEXT, p=float("inf"))
