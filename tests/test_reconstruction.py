"""Every decomposition reconstructs the hidden states the model computed (float64, 1e-8),
on a tiny random model of every supported family."""

import numpy as np
import pytest
import torch

import ctxmix
from ctxmix.engine.layer import layer_forward, norm_family_pieces, scope_pieces  # noqa: F401
from ctxmix.engine.trace import trace_ids
from ctxmix.methods.registry import scope_names

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]
TOL = 1e-8


def test_layer_recomputation_matches_model(tiny):
    """The layer rebuilt from weights gives the model's own hidden states. Llama's RMSNorm
    casts to float32 inside the model even when it runs in float64, so there the model itself
    is only float32-exact; the decompositions below are checked at 1e-8 against the rebuilt layer."""
    tr = trace_ids(tiny, IDS)
    if tiny.spec.norm == "rmsnorm":  # float32 inside the model: relative to the states' size
        scale = max(float(h.abs().max()) for h in tr.hidden)
        assert tr.reconstruction_error < 1e-6 * max(1.0, scale)
    else:
        assert tr.reconstruction_error < TOL


def _check(tr, res2="exact", factorised=True):
    n = tr.n
    rows = torch.arange(n)
    for lw, st in zip(tr.model.layers, tr.states):
        pieces = scope_pieces(lw, st, rows, res2=res2, next_ln=True, factorised=factorised)
        expect = {  # the real vector each scope must sum to
            "post": {"Atb": st.z, "AtbFf": st.ff, "AtbFfRes": st.r2, "AtbFfResLn": st.y},
            "pre": {"Atb": st.r1, "AtbLn": st.z, "AtbLnFf": st.ff, "AtbLnFfRes": st.y,
                    "AtbLnFfResLn": lw.next_norm(st.y) if lw.next_norm is not None else None},
            "sandwich": {"Atb": st.r1, "AtbLn": st.z, "AtbLnFf": st.ff,
                         "AtbLnFfLn": lw.post_ff_norm(st.ff) if lw.post_ff_norm is not None else None,
                         "AtbLnFfLnRes": st.y,
                         "AtbLnFfLnResLn": lw.next_norm(st.y) if lw.next_norm is not None else None},
            "parallel": {"Atb": st.attn, "AtbFf": st.attn + st.ff, "AtbFfRes": st.y,
                         "AtbFfResLn": lw.next_norm(st.y) if lw.next_norm is not None else None},
        }[lw.position]
        assert set(scope_names(lw.position)) <= set(pieces)
        errs = {}
        for name, (F, b) in pieces.items():
            if expect.get(name) is not None:
                errs[name] = float((F.sum(1) + b - expect[name]).abs().max())
        yield lw, errs


def test_every_scope_reconstructs(tiny):
    tr = trace_ids(tiny, IDS)
    for lw, errs in _check(tr):
        assert max(errs.values()) < TOL, (tiny.name, lw.index, errs)


def test_straightforward_ff_product_reconstructs_too(tiny):
    tr = trace_ids(tiny, IDS)
    for lw, errs in _check(tr, factorised=False):
        assert max(errs.values()) < TOL, (tiny.name, lw.index, errs)


def test_factorised_equals_straightforward(tiny):
    """The optimised FF path (W_1 on per-head vectors, mixed afterwards) gives the same maps."""
    from ctxmix.methods.mixing import scope_layer_maps

    tr = trace_ids(tiny, IDS)
    fast, slow = scope_layer_maps(tr), scope_layer_maps(tr, factorised=False)
    for k in fast:
        np.testing.assert_allclose(fast[k], slow[k], rtol=0, atol=1e-10)


def test_printed_res2_is_not_exact(tiny):
    """The FF paper's printed Eq. 57 (diagonal-only RES2) does not reconstruct: the option exists
    to reproduce the paper, and this test keeps the two from being silently swapped."""
    if tiny.spec.position == "parallel":
        with pytest.raises(ValueError, match="parallel"):
            list(_check(trace_ids(tiny, IDS), res2="diagonal"))
        return
    tr = trace_ids(tiny, IDS)
    worst = 0.0
    for lw, errs in _check(tr, res2="diagonal"):
        key = {"post": "AtbFfRes", "pre": "AtbLnFfRes", "sandwich": "AtbLnFfLnRes"}[lw.position]
        worst = max(worst, errs[key])
    assert worst > 1e-3


def test_norm_family_sums(tiny):
    """GlobEnc's N_Res pieces plus b_O (b_V spread through alpha) give the real pre-norm vector;
    the LN1-decomposed pieces plus the bias give the LN1 output (post-LN)."""
    tr = trace_ids(tiny, IDS)
    rows = torch.arange(tr.n)
    for lw, st in zip(tr.model.layers, tr.states):
        P = norm_family_pieces(lw, st, rows)
        assert float((P["norm_res"].sum(1) + lw.bo - st.r1).abs().max()) < TOL
        if lw.position == "post":
            s1 = lw.ln1.scale(st.r1)
            b = lw.ln1.decompose_bias(lw.bo.expand(tr.n, -1), s1)
            assert float((P["norm_res_ln"].sum(1) + b - st.z).abs().max()) < TOL


def test_scope_maps_api_shapes(tiny):
    maps = ctxmix.scope_maps(tiny, input_ids=IDS)
    assert tuple(maps) == scope_names(tiny.spec.position)
    for m in maps.values():
        assert m.shape == (tiny.n_layers, len(IDS), len(IDS))
        assert np.all(m >= 0)
    if tiny.spec.causal:  # no token attends to later ones, so later tokens contribute nothing
        for m in maps.values():
            assert np.allclose(np.triu(m[0], 1), 0)


def test_chunked_equals_whole(tiny, monkeypatch):
    """Chunking the n x n x d' pieces over output rows changes nothing."""
    import ctxmix.methods.mixing as M

    whole = ctxmix.scope_maps(tiny, input_ids=IDS)
    monkeypatch.setattr(M, "CHUNK_ELEMENTS", 1)  # one output row per chunk
    chunked = ctxmix.scope_maps(tiny, input_ids=IDS)
    for k in whole:
        np.testing.assert_allclose(chunked[k], whole[k], rtol=0, atol=1e-12)


def test_reconstruction_error_covers_the_decompositions_computed(tokenizer, monkeypatch):
    """An explanation's reconstruction_error is the largest error of the recomputed layers and of
    the scope decompositions it computed: a scope whose pieces stop summing to its vector shows."""
    from conftest import tiny_model

    import ctxmix.methods.mixing as M

    m = tiny_model("bert", tokenizer)
    plain = ctxmix.explain(m, None, ["alti"], input_ids=IDS)
    exact = ctxmix.explain(m, None, ["AtbFf", "alti"], input_ids=IDS)
    assert exact.reconstruction_error < TOL and plain.reconstruction_error < TOL
    real = M.scope_pieces

    def broken(*a, **k):
        out = real(*a, **k)
        F, b = out["AtbFf"]
        out["AtbFf"] = (F, b + 1e-3)
        return out

    monkeypatch.setattr(M, "scope_pieces", broken)
    assert ctxmix.explain(m, None, ["AtbFf"], input_ids=IDS).reconstruction_error == pytest.approx(1e-3, rel=1e-6)
    assert ctxmix.explain(m, None, ["alti"], input_ids=IDS).reconstruction_error < TOL  # no scope asked: none checked


def test_norm_family_row_maps_equal_the_pieces_norms(tiny):
    """The maps' fast path (head vectors once per layer, norms of decomposed pieces as weighted sums of
    squares, a causal model's later columns skipped) equals the norms of `norm_family_pieces`, and ALTI's
    rows from its pieces, on every family in float64; any row chunking gives the same maps."""
    from ctxmix.engine.layer import alti_layer, head_vectors, norm_family_row_maps

    tr = trace_ids(tiny, IDS)
    names = ["norm", "norm_res", "norm_res_ln", "globenc", "alti"]
    n = tr.n
    for lw, st in zip(tr.model.layers, tr.states):
        b = st.as_batch()
        rows = torch.arange(n)
        P = norm_family_pieces(lw, b, rows)
        y = b.z if lw.position == "post" else b.r1
        want = {m: (alti_layer(P["alti_T"], y) if m == "alti" else P[m].norm(dim=-1))[0] for m in names}
        f = head_vectors(lw, b.x if lw.position == "post" else b.x1, with_bias=True)
        for chunk in (rows, rows[:5], rows[5:]):
            J = int(chunk[-1]) + 1 if tiny.spec.causal else n
            got = norm_family_row_maps(lw, b, chunk, names, f, J)
            for m in names:
                w = want[m][chunk]
                assert float(w[:, J:].abs().sum()) == 0.0, m  # what is skipped is zero
                torch.testing.assert_close(got[m][0], w[:, :J], rtol=0, atol=TOL * float(w.abs().max()), msg=m)
