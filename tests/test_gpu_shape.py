"""The engine's shape for large devices: what is computed once per layer or per call instead of per
chunk, what stays on the device, and how large the chunks are. Each result equals the old path's."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.engine.budget import MIN_CHUNK_ROWS, chunk_rows
from ctxmix.engine.trace import trace_ids
from ctxmix.methods.explain import prediction_of
from ctxmix.methods.mixing import flush_layer, layer_targets, rollout, rollout_tensor, scope_layer_maps
from ctxmix.methods.prediction import alti_trace_back
from ctxmix.methods.registry import MIXING_METHODS

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]


class _CountingFloat64(torch.Tensor):
    """A tensor that records the shape of every float64 tensor made from it."""

    made: list[tuple[int, ...]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            cls.made.append(tuple(out.shape))
        return out


def test_prediction_reads_the_row_before_float64():
    """A language model's prediction converts one (V,) row to float64, never the (n, V) logits
    (4 GB at 4,096 tokens with a 128k vocabulary)."""
    n, V = 16, 128_256
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0)).as_subclass(_CountingFloat64)
    tokens = lambda ids: [str(i) for i in ids]  # noqa: E731
    model = SimpleNamespace(kind="causal_lm", spec=SimpleNamespace(causal=True), tokens=tokens)
    _CountingFloat64.made = []
    pred = prediction_of(model, SimpleNamespace(logits=logits), position=5)
    assert _CountingFloat64.made and all(np.prod(s) <= V for s in _CountingFloat64.made)
    p = torch.softmax(logits.as_subclass(torch.Tensor)[5].double(), -1)
    assert pred["index"] == int(p.argmax())
    assert abs(sum(pred["probabilities"].values()) - float(p.topk(5).values.sum())) < 1e-12


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gated FFs: pre-LN (factorised) and sandwich (straight)
@pytest.mark.parametrize("factorised", [True, False])
def test_gated_ig_weights_once_per_layer(family, factorised, tokenizer, monkeypatch):
    """The gated FF's IG weights depend only on the totals: one quadrature per layer, however many row
    chunks, and the same maps as one quadrature per chunk (elementwise on the same totals)."""
    import ctxmix.engine.layer as layer
    import ctxmix.methods.mixing as mixing

    model = tiny_model(family, tokenizer)
    tr = trace_ids(model, IDS)
    monkeypatch.setattr(mixing, "CHUNK_ELEMENTS", 1)  # one output row per chunk: n chunks per layer
    calls = []
    real = layer.gated_ig_weights

    def counted(g, act, nodes=64):
        calls.append(tuple(g.shape))
        return real(g, act, nodes)

    monkeypatch.setattr(layer, "gated_ig_weights", counted)
    got = scope_layer_maps(tr, factorised=factorised)
    assert len(calls) == model.n_layers and all(s[-2] == len(IDS) for s in calls)
    per_chunk = layer.layer_gated_ig_weights
    monkeypatch.setattr(
        layer, "layer_gated_ig_weights", lambda lw, st, rows, cache, nodes=64: per_chunk(lw, st, rows, None, nodes)
    )
    calls.clear()
    ref = scope_layer_maps(tr, factorised=factorised)
    # factorised, the bias's share is computed once per layer for every row (`ff_bias`): one more quadrature
    # (sandwich and parallel layers run the straightforward product)
    once_more = factorised and model.spec.position in ("pre", "post")
    assert len(calls) == model.n_layers * (len(IDS) + once_more)
    for s in ref:
        # float64 model: the same elementwise quadrature on the same totals, a few roundings apart at most
        np.testing.assert_allclose(got[s], ref[s], rtol=0, atol=64 * 2.0**-52 * max(1.0, np.abs(ref[s]).max()))


def test_chunk_rows_for_a_wide_ff_on_an_80gb_card():
    """At d' = 14336 and 4,096 tokens, 1/64 of an 80 GB card holds less than one row (332M words
    against 352M per row): the chunks get MIN_CHUNK_ROWS rows while a quarter of the card holds them,
    and stay sized by the elements where those allow more, or on a CPU (no card)."""
    card = 80 * 10**9 // 4  # float32 words of an 80 GB card's share
    elements = card // 64  # chunk_elements on that card
    per_row = 4096 * 14336 * 6
    assert elements // per_row == 0  # the old sizing: one row per chunk
    assert chunk_rows(4096, 14336, 6, 1, elements, card) == MIN_CHUNK_ROWS == 8  # 11.3 GB of temporaries
    assert 8 * per_row * 4 <= 80 * 10**9 // 4
    assert chunk_rows(16384, 14336, 6, 1, elements, card) == 3  # what a quarter of the card holds at 16k
    assert chunk_rows(65536, 14336, 6, 1, elements, card) == 1  # never below one row
    assert chunk_rows(4096, 1536, 6, 1, elements, card) == elements // (4096 * 1536 * 6)  # narrow: elements rule
    assert chunk_rows(4096, 14336, 6, 1, 2**25, None) == 1  # a CPU keeps its cache-sized chunks
    assert chunk_rows(16, 64, 6, 1, 2**25, None) == 16  # at most n


def _numpy_rollout(maps, row_normalise=False):
    """The former host rollout (numpy float64), kept as the reference."""
    M = np.asarray(maps, dtype=np.float64)
    out = np.empty_like(M)
    for l in range(len(M)):
        m = M[l]
        if row_normalise:
            m = m / np.clip(m.sum(-1, keepdims=True), np.finfo(np.float64).tiny, None)
        out[l] = m if l == 0 else m @ out[l - 1]
    return out


@pytest.mark.parametrize("row_normalise", [False, True])
def test_rollout_on_the_device_equals_the_host_rollout(row_normalise):
    """rollout_tensor (float64 on the maps' device) equals the numpy rollout, and rows of a rollout of
    row-stochastic maps sum to 1. Bound: each layer's product sums n non-negative float64 products of
    entries <= 1 whose row sums are 1, so each rounds by at most n 2^-53 and L layers add up."""
    L, n = 6, 64
    g = torch.Generator().manual_seed(0)
    M = torch.rand(L, n, n, generator=g, dtype=torch.float64)
    if not row_normalise:
        M = M / M.sum(-1, keepdim=True)
    tol = L * n * 2.0**-53
    got = rollout_tensor(M, row_normalise=row_normalise)
    assert got.dtype == torch.float64 and got.device == M.device
    np.testing.assert_allclose(got.numpy(), _numpy_rollout(M.numpy(), row_normalise), rtol=0, atol=tol)
    np.testing.assert_allclose(got.sum(-1).numpy(), 1.0, rtol=0, atol=tol)
    np.testing.assert_allclose(rollout(M.numpy(), row_normalise=row_normalise), got.numpy(), rtol=0, atol=0)
    # float32 maps are rolled out in float64; row-stochastic ones (0.5 S + 0.5 I, S's rows summing to 1), as the
    # bound assumes: an un-normalised M (row sums ~n/2) grows its rollout to ~(n/2)^L, far past any absolute bound
    S = (M / M.sum(-1, keepdim=True)).float()
    half = rollout_tensor(S, add_identity=True)
    ref = _numpy_rollout(0.5 * S.double().numpy() + 0.5 * np.eye(n))
    np.testing.assert_allclose(half.numpy(), ref, rtol=0, atol=tol)


def test_explain_rollouts_equal_the_host_rollout(tokenizer):
    """explain's global maps (rolled out on the device now) equal the numpy rollout of its layer maps."""
    model = tiny_model("llama", tokenizer)
    methods = ["attention", "attention_rollout", "alti", "norm_res"]
    ex = ctxmix.explain(model, None, methods, input_ids=IDS)
    L, n = model.n_layers, len(IDS)
    for m in methods:
        ref = _numpy_rollout(ex.layer_maps[m], MIXING_METHODS[m].rollout_normalise)
        np.testing.assert_allclose(ex.global_maps[m], ref, rtol=0, atol=L * n * 2.0**-52 * max(1.0, np.abs(ref).max()))
    np.testing.assert_allclose(ex.global_maps["alti"].sum(-1), 1.0, rtol=0, atol=L * n * 2.0**-52)


def _loop_trace_back(D, C):
    """The former ALTI-Logit trace-back: an L^2 loop of vector-matrix products (the reference)."""
    out = np.empty_like(D)
    for l in range(D.shape[-2]):
        v = D[..., l, :]
        for k in range(l - 1, -1, -1):
            v = v @ C[k]
        out[..., l, :] = v
    return out


def test_alti_trace_back_equals_the_loop():
    """The trace-back as one product per layer (on the maps' device) equals the L^2 loop: each row
    meets the same maps in the same order; float64 rounding of n-term sums, L deep."""
    L, n = 5, 24
    g = torch.Generator().manual_seed(1)
    C = torch.rand(L, n, n, generator=g, dtype=torch.float64)
    C = C / C.sum(-1, keepdim=True)
    D = torch.randn(2, 3, L, n, generator=g, dtype=torch.float64).numpy()
    ref = _loop_trace_back(D, C.numpy())
    scale = np.abs(D).sum(-1).max()
    for maps in (C, C.numpy(), C.float()):
        got = alti_trace_back(D, maps)
        assert got.shape == D.shape and got.dtype == np.float64
        Cd = torch.as_tensor(maps).double().numpy()
        np.testing.assert_allclose(got, _loop_trace_back(D, Cd), rtol=0, atol=L * n * 2.0**-52 * scale)
    np.testing.assert_allclose(alti_trace_back(D, C), ref, rtol=0, atol=L * n * 2.0**-52 * scale)


@pytest.mark.parametrize("family", ["bert", "llama"])  # bidirectional and causal (rows before t unchanged)
def test_value_zeroing_reads_the_first_rows_once_per_layer(family, tokenizer, monkeypatch):
    """Value zeroing's first receiving row comes from one host read per layer, not one per chunk, and
    the maps equal those of the per-chunk search (the same rows are computed)."""
    import ctxmix.methods.mixing as mixing
    from ctxmix.engine import layer

    model = tiny_model(family, tokenizer)
    tr = trace_ids(model, IDS)
    monkeypatch.setattr(mixing, "CHUNK_ELEMENTS", 1)  # one zeroed token per chunk
    calls = []
    real = layer.first_receiving_rows

    def counted(alpha):
        calls.append(tuple(alpha.shape))
        return real(alpha)

    monkeypatch.setattr(mixing, "first_receiving_rows", counted)
    monkeypatch.setattr(layer, "first_receiving_rows", counted)  # a search per chunk would count here
    got = mixing.value_zeroing_maps(tr)
    assert len(calls) == model.n_layers
    cols = mixing.value_zeroing_columns
    monkeypatch.setattr(mixing, "value_zeroing_columns", lambda *a: cols(*a[:-1], None))  # search per chunk
    ref = mixing.value_zeroing_maps(tr)
    np.testing.assert_array_equal(got, ref)
    first = real(tr.states[0].alpha.unsqueeze(0))
    if model.spec.causal:
        assert first == list(range(len(IDS)))  # row t is the first to see token t
    else:
        assert first == [0] * len(IDS)


def test_layer_targets_buffer_a_layer_on_the_device():
    """Maps on the host computed on another device are written into one device buffer per layer (one
    copy back per layer), maps on the computing device directly."""
    host = {"a": torch.zeros(1, 8, 8, dtype=torch.float64)}
    assert layer_targets(host, "cpu") is host
    on_meta = layer_targets(host, "meta")
    assert on_meta["a"].device.type == "meta" and on_meta["a"].shape == host["a"].shape
    assert on_meta["a"].dtype == torch.float64
    buf = {"a": torch.full((1, 8, 8), 2.0, dtype=torch.float64)}
    flush_layer(host, buf)
    assert float(host["a"].sum()) == 128.0
    flush_layer(host, host)  # the maps themselves: nothing to copy
