"""Streamed traces (long inputs): the layers rebuilt on demand equal the stored trace's, on every
family, and every method reads them to the same numbers with maps filled on the host."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import ctxmix
from ctxmix.engine import streaming
from ctxmix.engine import trace as trace_mod
from ctxmix.engine.streaming import ReplayedStates
from ctxmix.engine.trace import trace_ids

TEXT = "the quick brown fox jumps over the lazy dog and runs far away"


@pytest.fixture
def ids(tokenizer):
    return tokenizer(TEXT)["input_ids"]


def test_streamed_states_equal_the_stored_ones(tiny, ids):
    stored = trace_ids(tiny, ids, streamed=False)
    streamed = trace_ids(tiny, ids, streamed=True)
    assert streamed.streamed and not stored.streamed
    assert streamed.reconstruction_error == pytest.approx(stored.reconstruction_error, rel=1e-9, abs=1e-15)
    for l in range(tiny.n_layers):
        for k, v in stored.states[l].__dict__.items():
            w = getattr(streamed.states[l], k)
            assert (v is None) == (w is None), k
            if v is not None:
                torch.testing.assert_close(w, v, rtol=0, atol=1e-12, msg=f"layer {l} {k}")
    for a, b in zip(stored.hidden, streamed.hidden, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    if stored.logits is not None:
        torch.testing.assert_close(streamed.logits, stored.logits, rtol=0, atol=1e-12)


def test_a_streamed_trace_holds_no_attention_probabilities(tiny, ids):
    """What makes it fit: no tensor the trace keeps has the H x n^2 (or n^2 x d) of a layer's probabilities."""
    tr = trace_ids(tiny, ids, streamed=True)
    n, H = len(ids), tiny.layers[0].n_heads
    tr.states._last = None  # the one rebuilt layer kept for consecutive reads is not part of the trace

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)
        elif isinstance(x, dict):
            for y in x.values():
                yield from tensors(y)

    held = list(tensors(tr.hidden)) + [t for _, a, kw in tr.states.calls for t in tensors([a, kw])]
    assert held and all(t.numel() < H * n * n for t in held if t.dim() >= 3 and t.shape[-1] == t.shape[-2] == n)
    assert all(t.numel() <= 2 * n * tiny.config.vocab_size for t in held)


def test_explain_reads_a_streamed_trace_to_the_same_numbers(tiny, ids, monkeypatch):
    methods = ["attention", "attention_rollout", "norm", "norm_res", "globenc", "alti", "value_zeroing"]
    if tiny.spec.causal:
        methods += ["logit", "alti_logit"]
    ref = ctxmix.explain(tiny, None, methods, input_ids=ids, per_head=True)
    monkeypatch.setattr(trace_mod, "streams", lambda model, n: True)
    got = ctxmix.explain(tiny, None, methods, input_ids=ids, per_head=True)
    for m in ref.layer_maps:
        np.testing.assert_allclose(got.layer_maps[m], ref.layer_maps[m], rtol=0, atol=1e-12, err_msg=m)
        np.testing.assert_allclose(got.global_maps[m], ref.global_maps[m], rtol=0, atol=1e-12, err_msg=m)
        assert got.layer_maps[m].dtype == np.float64
    for m in ref.head_maps:
        np.testing.assert_allclose(got.head_maps[m], ref.head_maps[m], rtol=0, atol=1e-12, err_msg=m)
    for m in ref.saliency:
        np.testing.assert_allclose(got.saliency[m], ref.saliency[m], rtol=0, atol=1e-12, err_msg=m)
    assert got.reconstruction_error == pytest.approx(ref.reconstruction_error, rel=1e-9, abs=1e-15)


def test_scope_maps_and_routes_read_a_streamed_trace_to_the_same_numbers(tiny, ids, monkeypatch):
    ref = ctxmix.scope_maps(tiny, input_ids=ids)
    ref_routes = ctxmix.routes(tiny, input_ids=ids, threshold=0.05) if tiny.spec.causal else None
    monkeypatch.setattr(trace_mod, "streams", lambda model, n: True)
    got = ctxmix.scope_maps(tiny, input_ids=ids)
    for s in ref:
        np.testing.assert_allclose(got[s], ref[s], rtol=0, atol=1e-12, err_msg=s)
    if ref_routes is not None:
        r = ctxmix.routes(tiny, input_ids=ids, threshold=0.05)
        a, b = ref_routes.edges, r.edges
        assert list(a["source"]) == list(b["source"]) and list(a["target"]) == list(b["target"])
        np.testing.assert_allclose(b["weight"].to_numpy(), a["weight"].to_numpy(), rtol=0, atol=1e-12)


def test_long_inputs_stream_by_the_budget(minilm, monkeypatch):
    """The switch is the budget's: a trace streams when its stored states would take over half of it."""
    ids = minilm.tokenizer("a short text")["input_ids"]
    assert not trace_ids(minilm, ids).streamed  # a short input under the real budget
    monkeypatch.setattr(streaming, "memory_budget", lambda device: 1000)
    tr = trace_ids(minilm, ids)
    assert tr.streamed and isinstance(tr.states, ReplayedStates)
    assert streaming.streams(minilm, len(ids))


def test_the_recording_hooks_are_inert_outside_a_streamed_trace(minilm):
    ids = minilm.tokenizer("hooks stay quiet")["input_ids"]
    trace_ids(minilm, ids, streamed=True)  # installs the hooks
    assert streaming.CALLS.get() is None
    seen = []

    def other_thread():  # another thread's stored trace of the same model records nothing into ours
        seen.append(trace_ids(minilm, ids, streamed=False).reconstruction_error)

    calls: list = [None] * minilm.n_layers
    token = streaming.CALLS.set(calls)
    try:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    finally:
        streaming.CALLS.reset(token)
    assert seen and calls == [None] * minilm.n_layers
    assert trace_ids(minilm, ids, streamed=False).reconstruction_error < 1e-4


def test_a_rebuild_writes_no_tf32_setting(minilm):
    """A streamed trace rebuilds its layers under the process's own TF32 setting, never switching it (one session's
    rebuild must not change another's float32 call): torch's setting is read before and after every layer."""
    from ctxmix.engine.precision import tf32_now

    ids = minilm.encode("the cat sat on the mat")[0]
    tr = trace_ids(minilm, ids, streamed=True)
    before = (tf32_now(), torch.backends.cuda.matmul.allow_tf32)
    for st in tr.states:
        assert st.y is not None and (tf32_now(), torch.backends.cuda.matmul.allow_tf32) == before
