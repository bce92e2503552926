"""The chunk loops' reused temporaries (ctxmix.engine.workspace): same bits as fresh tensors, on every family."""

import pytest
import torch
import transformers.activations as hf_act
from conftest import FAMILIES, tiny_model

from ctxmix.engine.layer import cosine_distances, first_receiving_rows, scope_pieces, value_zeroing_columns
from ctxmix.engine.trace import trace_ids
from ctxmix.engine.workspace import Workspace, act_into, in_place_act

IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]


@pytest.mark.parametrize("family", FAMILIES)
def test_in_place_activation_is_the_modules_own_kernel(tokenizer, family):
    """Where ctxmix applies a family's activation in place, it gives the module's bits exactly (the families
    cover GELU, GELU-tanh, SiLU and ReLU); elsewhere it calls the module."""
    act = tiny_model(family, tokenizer).layers[0].act
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(3, 7, 40, dtype=dtype) * 4
        want = act(x)
        y = x.clone()
        got = act_into(act, y)
        assert torch.equal(got, want), family
        if in_place_act(act) is not None:
            assert got.data_ptr() == y.data_ptr()  # written into the input: no fresh temporary


def test_in_place_activation_declines_what_it_does_not_know():
    assert in_place_act(hf_act.NewGELUActivation()) is None  # a formula in Python, not one kernel
    assert in_place_act(hf_act.GELUActivation(use_gelu_python=True)) is None
    assert in_place_act(torch.nn.Tanh()) is None
    x = torch.randn(50)
    assert torch.equal(act_into(hf_act.NewGELUActivation(), x.clone()), hf_act.NewGELUActivation()(x))


def test_workspace_buffers_grow_keep_names_apart_and_follow_a_layout():
    w = Workspace()
    a = w.take("a", (2, 3), torch.float32, "cpu")
    a.fill_(1.0)
    b = w.take("b", (2, 3), torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()
    assert w.take("a", (3,), torch.float32, "cpu").data_ptr() == a.data_ptr()  # smaller: the same memory
    big = w.take("a", (4, 5), torch.float32, "cpu")
    assert big.shape == (4, 5) and big.is_contiguous()
    assert w.take("a", (2,), torch.float64, "cpu").dtype == torch.float64
    t = torch.empty(5, 4, 3).transpose(0, 1)  # (4, 5, 3) laid out as (5, 4, 3)
    like = w.like("c", t)
    assert like.shape == t.shape and like.stride() == t.stride()
    assert w.nbytes() >= 4 * 5 * 3 * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_scope_pieces_in_a_shared_workspace_equal_fresh_ones(tokenizer, family):
    """Two chunks of rows through one workspace (the second reuses the first's buffers) give the pieces that
    fresh tensors give, bit for bit; each chunk is read before the next is made, as the chunk loop does."""
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    tr = trace_ids(m, IDS)
    work = Workspace()
    for lw, st in zip(m.layers, tr.states):
        st = st.as_batch()
        for rows in (torch.arange(0, 7), torch.arange(7, len(IDS))):
            fresh = scope_pieces(lw, st, rows, next_ln=True)
            shared = scope_pieces(lw, st, rows, next_ln=True, work=work)
            assert fresh.keys() == shared.keys()
            for k in fresh:
                assert torch.equal(fresh[k][0], shared[k][0]), (family, k)
                assert torch.equal(fresh[k][1], shared[k][1]), (family, k)


@pytest.mark.parametrize("family", FAMILIES)
def test_value_zeroing_in_a_shared_workspace_equals_fresh(tokenizer, family):
    m = tiny_model(family, tokenizer, dtype=torch.float32)
    tr = trace_ids(m, IDS)
    work = Workspace()
    for lw, st in zip(m.layers, tr.states):
        st = st.as_batch()
        first = first_receiving_rows(st.alpha)
        for cols in (torch.arange(0, 5), torch.arange(5, len(IDS))):
            f = min(first[int(cols[0]) : int(cols[-1]) + 1])
            fresh = value_zeroing_columns(lw, st, cols, first=f)
            shared = value_zeroing_columns(lw, st, cols, first=f, work=work)
            assert torch.equal(fresh, shared), family


def test_cosine_distances_match_torch_in_float64():
    """The fewer-pass cosine (a float32 vector read as it is, squared and multiplied in float64) against
    torch's cosine similarity of float64 copies: the same up to float64 rounding of sums over d terms."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 9, 64, generator=g)
    Y = y.unsqueeze(1) + 1e-3 * torch.randn(2, 5, 9, 64, generator=g)
    Y[0, 0, 0] = 0.0  # a zero vector has cosine 0
    want = 1 - torch.nn.functional.cosine_similarity(Y.double(), y.double().unsqueeze(1), dim=-1, eps=1e-8)
    for work in (None, Workspace()):
        got = cosine_distances(Y, y, work)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want.clamp(min=0), rtol=0, atol=64 * 2.0**-52)
        assert got[0, 0, 0] == 1.0


def test_row_chunks_are_even_and_cover_every_row_once():
    """The chunks split n rows into as many chunks as the budget asks, all of one size but the last, which is
    short by less than the number of chunks: never a thin remainder (a thin chunk runs a slow product)."""
    from ctxmix.methods.mixing import _chunks

    for n in (1, 5, 64, 127, 128, 129, 512):
        chunks = _chunks(n, 3072, copies=6)
        assert torch.equal(torch.cat(chunks), torch.arange(n))
        sizes = [len(c) for c in chunks]
        assert len(set(sizes[:-1])) <= 1 and sizes[0] - len(chunks) < sizes[-1] <= sizes[0]
    assert [len(c) for c in _chunks(128, 3072, copies=6)] == [13] * 9 + [11]  # not 14 x 9 + 2
    assert _chunks(0, 3072) == []


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "identity"])
def test_fast_scale_is_the_norms_scale(kind):
    """Norm.fast_scale (value zeroing's pre-LN path) equals Norm.scale, up to float32 rounding of a mean of d
    squares (a few ulp of s)."""
    from ctxmix.engine.arch import Norm

    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(2, 5, 7, 64, generator=g) + 1.5
    gamma = None if kind == "identity" else torch.randn(64, generator=g)
    beta = torch.randn(64, generator=g) if kind == "layernorm" else None
    for dtype, rtol in ((torch.float32, 8 * 2.0**-23), (torch.float64, 8 * 2.0**-52)):
        norm = Norm(kind, *(None if t is None else t.to(dtype) for t in (gamma, beta)), 1e-5)
        torch.testing.assert_close(norm.fast_scale(z.to(dtype)), norm.scale(z.to(dtype)), rtol=rtol, atol=0)


@pytest.mark.parametrize("packer", ["mkl", "onednn"])
def test_workspace_product_packs_once_and_never_serves_a_stale_weight(monkeypatch, packer):
    """Workspace.product is a @ W (plus `into` when given). With a packer (each on any CPU whose torch has it, not
    only where `PACKER` picks it), the second product with the same W (and, for MKL, the same M) runs on the packed
    copy; the result stays mm's within float32 rounding of K terms, and a weight changed in place, another weight
    or (for MKL) another M is never served from the old packed copy."""
    from ctxmix.engine import workspace

    if not {"mkl": workspace.MKL_PACKING, "onednn": workspace.ONEDNN_PACKING}[packer]:
        pytest.skip(f"this torch has no {packer} packed product")
    monkeypatch.setattr(workspace, "PACKER", packer)
    g = torch.Generator().manual_seed(0)
    K, N = 96, 40
    weight = torch.randn(N, K, generator=g)
    W = weight.t()  # (K, N), a view of an nn.Linear-style weight, as LayerWeights holds it

    def close(got, a, W, base=None):
        want = a.double() @ W.double() + (0 if base is None else base.double())
        bound = K * 2.0**-24 * (a.abs().double() @ W.abs().double()) + (0 if base is None else 2.0**-24 * want.abs())
        assert ((got.double() - want).abs() <= bound + 1e-30).all()

    w = Workspace()
    a = torch.randn(24, K, generator=g)
    for _ in range(3):  # plain, then packed, then packed again
        close(w.product("W", a, W), a, W)
    assert w._packed["W"][4] is not None  # the packed path ran
    base = torch.randn(24, N, generator=g)
    kept = base.clone()
    got = w.product("W", a, W, into=base)
    close(got, a, W, kept)
    weight.mul_(-2.0)  # changed in place: its version counter moves
    close(w.product("W", a, W), a, W)
    close(w.product("W", a, W), a, W)
    other = torch.randn(K, N, generator=g)
    close(w.product("W", a, other), a, other)
    a2 = torch.randn(7, K, generator=g)
    for _ in range(2):  # another M: MKL packs again, oneDNN's packed copy serves every M
        close(w.product("W", a2, W), a2, W)
    a64 = a.double()
    assert torch.equal(w.product("W", a64, W.double()), a64 @ W.double())  # not float32: the plain product
    # BERT-base's W_2 at a small M, where the packed kernels round differently from mm: still within the bound
    big = torch.randn(768, 3072, generator=g).t()
    a3 = torch.randn(384, 3072, generator=g)
    for _ in range(3):
        close(w.product("W2", a3, big), a3, big)
    # oneDNN packs a big product on the weight's first use (its reorder pays within one product)
    monkeypatch.setattr(workspace, "ONEDNN_PACK_FIRST_ROWS", 384)
    first = Workspace()
    close(first.product("W2", a3, big), a3, big)
    assert (first._packed["W2"][4] is not None) == (packer == "onednn")
    # a process whose float32 products run in bf16 (oneDNN) never packs: one layer's chunks keep one precision
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        lowered = Workspace()
        for _ in range(3):
            lowered.product("W", a, W)
        assert lowered._packed.get("W") is None
    finally:
        torch.set_float32_matmul_precision(before)
    # with no packer (ARM, CPUs where none was measured) nothing is packed, and the result is mm's
    monkeypatch.setattr(workspace, "PACKER", None)
    plain = Workspace()
    for _ in range(3):
        assert torch.equal(plain.product("W", a, W), a @ W)
    assert plain._packed.get("W") is None


def test_packing_is_on_where_it_was_measured_to_pay():
    """Workspace.product packs with MKL on Intel CPUs and with oneDNN on AMD CPUs with AVX-512 (where each was
    measured faster than mm), and not elsewhere; the vendor is /proc/cpuinfo's."""
    from ctxmix.engine import workspace

    assert workspace._packer("GenuineIntel") == ("mkl" if workspace.MKL_PACKING else None)
    assert workspace._packer("AuthenticAMD", {"avx512f"}) == ("onednn" if workspace.ONEDNN_PACKING else None)
    assert workspace._packer("AuthenticAMD", {"avx2"}) is None  # measured on Zen 4 (AVX-512) only
    assert workspace._packer("") is None and workspace._packer("ARM") is None
    assert workspace.PACKER == workspace._packer(workspace._cpu_vendor())
    try:
        with open("/proc/cpuinfo") as f:
            vendors = {line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")}
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if vendors:
        assert {workspace._cpu_vendor()} == vendors


def test_norm_fused_with_scale_takes_a_shift_into_beta():
    """fused_with_scale(z, shift) is the norm of z plus shift (value zeroing folds b_2 into LN1's beta)."""
    from ctxmix.engine.arch import Norm

    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 5, 64, generator=g)
    shift = torch.randn(64, generator=g)
    kept = z.clone()
    for kind, beta in (("layernorm", torch.randn(64, generator=g)), ("layernorm", None), ("rmsnorm", None)):
        norm = Norm(kind, torch.randn(64, generator=g), beta, 1e-5)
        out, s = norm.fused_with_scale(z, shift)
        torch.testing.assert_close(out, norm(z) + shift, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(s, norm.scale(z), rtol=8 * 2.0**-23, atol=0)
    out, s = Norm("identity", None, None, 1e-5).fused_with_scale(z, shift)
    assert torch.equal(out, z + shift) and torch.equal(s, torch.ones_like(s))
    assert torch.equal(z, kept)  # the input is never written


def test_columns_gathers_tokens_of_either_layout():
    """`_columns` takes tokens of a (B, n, H, k) tensor whether it is contiguous or a (t, h) view of (B, H, n, k)
    storage (project_heads' uncopied layout): the same values as plain indexing."""
    from ctxmix.engine.layer import _columns, token_index

    g = torch.Generator().manual_seed(2)
    heads_first = torch.randn(2, 3, 10, 8, generator=g)  # (B, H, n, k)
    cols = torch.tensor([1, 4, 5, 9])
    for t in (heads_first.transpose(1, 2), heads_first.transpose(1, 2).contiguous()):
        assert torch.equal(_columns(t, cols), t[:, cols])
        # consecutive tokens on the host are a slice: a view of the tensor itself, no copy
        span = token_index(torch.arange(3, 7), "cpu")
        assert span == slice(3, 7)
        assert torch.equal(_columns(t, span), t[:, 3:7]) and _columns(t, span).data_ptr() == t[:, 3:7].data_ptr()
    assert torch.equal(token_index(cols, "cpu"), cols)  # not consecutive: the index tensor
    assert isinstance(token_index(torch.tensor([2]), "cpu"), slice)
    assert torch.equal(token_index(torch.tensor([-2, -1]), "cpu"), torch.tensor([-2, -1]))  # from the end: no slice


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from mkldnn.flags()
@pytest.mark.parametrize("packer", ["onednn", None])
def test_linear_is_matmul_plus_bias_within_float32_rounding(monkeypatch, packer):
    """workspace.linear (the rebuilt layer's projections): x @ W + b within float32 rounding of K terms through
    oneDNN (forced on any CPU whose torch has it), bit for bit torch's matmul without it; with autograd on, with a
    weight not in nn.Linear's storage or in float64 it is torch's matmul."""
    from ctxmix.engine import workspace
    from ctxmix.engine.workspace import linear

    if packer == "onednn" and not workspace.ONEDNN_PACKING:
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(workspace, "PACKER", packer)
    g = torch.Generator().manual_seed(3)
    K, N = 200, 48
    W = torch.randn(N, K, generator=g).t()  # (K, N), a view of an nn.Linear-style weight
    b = torch.randn(N, generator=g)
    x = torch.randn(2, 5, K, generator=g)
    want = x.double() @ W.double() + b.double()
    got = linear(x, W, b)
    assert got.shape == (2, 5, N) and got.dtype == torch.float32
    bound = K * 2.0**-24 * (x.abs().double() @ W.abs().double()) + 2.0**-24 * want.abs()
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(linear(x, W), linear(x, W, torch.zeros(N)))
    if packer is None:
        assert torch.equal(got, x @ W + b)
    dense = W.contiguous()  # (K, N) storage (GPT-2's Conv1D): torch's matmul, no copy of W
    assert torch.equal(linear(x, dense, b), x @ dense + b)
    assert torch.equal(linear(x.double(), W.double(), b.double()), x.double() @ W.double() + b.double())
    xg = x.clone().requires_grad_(True)
    out = linear(xg, W, b)
    out.sum().backward()  # autograd: torch's matmul, whose gradient exists
    torch.testing.assert_close(xg.grad, W.sum(-1).expand(2, 5, K))
    bg = b.clone().requires_grad_(True)  # a bias with a gradient: kept (oneDNN's would drop it)
    linear(x, W, bg).sum().backward()
    torch.testing.assert_close(bg.grad, torch.full((N,), 10.0))
    strided = torch.randn(2 * N, generator=g)[::2]  # a strided bias: torch's matmul, not a misread one
    torch.testing.assert_close(linear(x, W, strided), x @ W + strided, rtol=0, atol=float(bound.max()) * 2)
    torch.testing.assert_close(linear(x, W, b[:1]), x @ W + b[:1], rtol=0, atol=float(bound.max()) * 2)  # broadcast
    tangent = torch.randn(2, 5, K, generator=g)
    _, jv = torch.func.jvp(lambda t: linear(t, W, b), (x,), (tangent,))  # forward mode: torch's matmul
    torch.testing.assert_close(jv, tangent @ W, rtol=0, atol=float(bound.max()) * 2)
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(linear(x, W, b), x @ W + b)  # the user switched oneDNN off


def test_full_float32_reads_either_precision_api():
    """_full_float32 (whether the packed products may run) follows torch's legacy matmul precision and the
    fp32_precision tree, and never raises where torch's legacy getter would (the CUDA leaf set to tf32)."""
    from ctxmix.engine.workspace import _full_float32

    before = torch.get_float32_matmul_precision()
    backends = torch.backends
    leaves = {
        "cuda": getattr(getattr(backends.cuda, "matmul", None), "fp32_precision", None),
        "mkldnn": getattr(getattr(backends.mkldnn, "matmul", None), "fp32_precision", None),
    }
    try:
        assert _full_float32()
        torch.set_float32_matmul_precision("medium")
        assert not _full_float32()
        torch.set_float32_matmul_precision("highest")
        assert _full_float32()
        if leaves["cuda"] is not None:
            backends.cuda.matmul.fp32_precision = "tf32"  # the CUDA leaf only: CPU products stay float32
            assert _full_float32()
            backends.mkldnn.matmul.fp32_precision = "bf16"
            assert not _full_float32()
    finally:
        if leaves["cuda"] is not None:
            backends.cuda.matmul.fp32_precision = leaves["cuda"]
            backends.mkldnn.matmul.fp32_precision = leaves["mkldnn"]
        torch.set_float32_matmul_precision(before)


def test_gemm_backends_table_runs_and_checks_each_backend(monkeypatch):
    """bench/gemm_backends.py (the table PACKER's gate is read from): every backend this torch has, on a small
    shape, each within K * 2^-24 of a float64 product (the script raises otherwise), torch.mm the baseline."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("ctxmix_bench_gemm", bench / "gemm_backends.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ctxmix_bench_gemm", mod)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "SHAPES", [(16, 64, 32, "small")])
    table = mod.measure(rounds=1)
    assert set(table["backend"]) == set(mod.backends())
    assert "torch.mm" in set(table["backend"])
    assert float(table.loc[table["backend"] == "torch.mm", "/ torch.mm"].iloc[0]) == 1.0
    assert (table["GFLOP/s (median)"] > 0).all()
