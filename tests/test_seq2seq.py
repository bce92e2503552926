"""Encoder-decoder models: exact decoder recomputation and ALTI+ (Ferrando et al., EMNLP 2022) on
tiny random models of BART, Marian (post-LN), M2M-100 and mBART (pre-LN)."""

import json

import numpy as np
import pytest
import torch
import transformers as T
from conftest import V, randomise_norms

import ctxmix
from ctxmix.engine.seq2seq import decoder_weights, encode_target, trace_seq2seq
from ctxmix.methods.alti_plus import alti_plus_pieces, source_contribution

SRC = "the cat sat on the mat"
TGT = "le chat est assis"

CLASSES = {
    "bart": (T.BartForConditionalGeneration, T.BartConfig),
    "marian": (T.MarianMTModel, T.MarianConfig),
    "m2m_100": (T.M2M100ForConditionalGeneration, T.M2M100Config),
    "mbart": (T.MBartForConditionalGeneration, T.MBartConfig),
}


def tiny_seq2seq(kind: str, tokenizer, dtype=torch.float64):
    """Different layer and head counts in encoder and decoder, so a mix-up cannot pass."""
    torch.manual_seed(0)
    cls, cfg_cls = CLASSES[kind]
    cfg = cfg_cls(
        vocab_size=V,
        d_model=24,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=40,
        decoder_ffn_dim=36,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        decoder_start_token_id=102,
        init_std=0.2,
    )
    hf = cls._from_config(cfg, attn_implementation="eager").to(dtype).eval()
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, tokenizer, name=f"tiny-{kind}")


@pytest.fixture(scope="module", params=list(CLASSES))
def s2s(request, tokenizer):
    return tiny_seq2seq(request.param, tokenizer)


@pytest.fixture(scope="module")
def bart(tokenizer):
    return tiny_seq2seq("bart", tokenizer)


def test_family_and_kind(s2s):
    assert s2s.kind == "seq2seq" and s2s.spec.encoder_decoder
    assert s2s.spec.position == ("post" if s2s.config.model_type in ("bart", "marian") else "pre")
    assert len(decoder_weights(s2s)) == 3 and s2s.n_layers == 2
    assert decoder_weights(s2s)[0][0].n_heads == 2 and s2s.layers[0].n_heads == 4


def test_decoder_recomputed_exactly(s2s):
    src, _ = s2s.encode(SRC)
    dec, _, _ = encode_target(s2s, TGT)
    tr = trace_seq2seq(s2s, src, dec)
    assert tr.reconstruction_error < 1e-10
    assert tr.encoder.reconstruction_error < 1e-10


def test_alti_plus_blocks_decompose_exactly(s2s):
    """Each block's pieces plus its bias give the block's real output, in every decoder layer."""
    src, _ = s2s.encode(SRC)
    dec, _, _ = encode_target(s2s, TGT)
    tr = trace_seq2seq(s2s, src, dec)
    T_ = len(dec)
    for (sw, cw), st in zip(decoder_weights(s2s), tr.decoder):
        P = alti_plus_pieces(sw, cw, st, torch.arange(T_))
        for F, b, real in P.values():
            assert (F.sum(-2) + b - real).abs().max() < 1e-10
        # causal: no piece from a later target token
        F_self = P["self"][0][0]
        later = torch.triu(torch.ones(T_, T_, dtype=torch.bool), 1)
        assert F_self[later].abs().max() == 0
        assert P["cross"][0].shape[-2] == len(src) + 1


def _reference_rollout(M_layers: np.ndarray, R_enc: np.ndarray, S: int) -> np.ndarray:
    """The ALTI+ repository's recursion, written out independently: R^1 = [C_enc R_enc | C_tgt],
    R^l = [C_tgt R^{l-1}_src + C_enc R_enc | C_tgt R^{l-1}_tgt], rows renormalised."""
    out = []
    prev = None
    for M in M_layers:
        C_enc, C_tgt = M[S:, :S], M[S:, S:]
        if prev is None:
            new = np.concatenate([C_enc @ R_enc, C_tgt], 1)
        else:
            new = np.concatenate([C_tgt @ prev[:, :S] + C_enc @ R_enc, C_tgt @ prev[:, S:]], 1)
            new = new / new.sum(-1, keepdims=True)
        out.append(new)
        prev = new
    return np.stack(out)


def test_alti_plus_maps(s2s):
    ex = ctxmix.explain(s2s, SRC, ["alti"], decoder_text=TGT)
    S, n = ex.segments.count(0), len(ex.tokens)
    T_ = n - S
    assert ex.segments == [0] * S + [1] * T_ and ex.options["method_variant"] == "ALTI+"
    M, R = ex.layer_maps["alti"], ex.global_maps["alti"]
    assert M.shape == R.shape == (3, n, n)
    np.testing.assert_allclose(M.sum(-1), 1, atol=1e-12)
    np.testing.assert_allclose(R.sum(-1), 1, atol=1e-12)
    assert (M >= 0).all() and (R >= -1e-15).all()
    # target row t never draws on a later target token
    assert np.abs(np.triu(M[:, S:, S:], 1)).max() == 0 and np.abs(np.triu(R[:, S:, S:], 1)).max() == 0
    # source rows: the encoder's own ALTI rollout, as explain gives it on the encoder alone
    enc = ctxmix.explain(s2s, SRC, ["alti"])
    np.testing.assert_allclose(R[-1, :S, :S], enc.global_maps["alti"][-1], atol=1e-12)
    np.testing.assert_allclose(R[:, S:], _reference_rollout(M, enc.global_maps["alti"][-1], S), atol=1e-12)
    share = source_contribution(ex)
    assert share.shape == (3, T_) and ((share > 0) & (share < 1)).all()
    np.testing.assert_allclose(share, R[:, S:, :S].sum(-1))
    assert ex.position == n - 1 and ex.prediction["what"] == f"next token after position {n - 1}"
    np.testing.assert_allclose(ex.saliency["alti"], R[-1, n - 1])


def test_alti_plus_hand_checkable_combination(bart):
    """One layer's joint row is [C_cross_enc | c_res * C_self]: check it from the two blocks' ALTI."""
    from ctxmix.engine.layer import alti_layer
    from ctxmix.methods.alti_plus import alti_plus_layer

    src, _ = bart.encode(SRC)
    dec, _, _ = encode_target(bart, TGT)
    tr = trace_seq2seq(bart, src, dec)
    (sw, cw), st = decoder_weights(bart)[1], tr.decoder[1]
    P = alti_plus_pieces(sw, cw, st, torch.arange(len(dec)))
    C_self = alti_layer(P["self"][0], P["self"][2])[0]
    C_cross = alti_layer(P["cross"][0], P["cross"][2])[0]
    joint = alti_plus_layer(sw, cw, st)[0]
    S = len(src)
    assert torch.allclose(joint[:, :S], C_cross[:, :S])
    assert torch.allclose(joint[:, S:], C_cross[:, S:] * C_self)
    # the first target token reads only itself: its target share is all residual
    assert torch.allclose(joint[0, S], C_cross[0, S])


def test_encoder_alone_runs_every_mixing_method(s2s):
    from ctxmix.methods.registry import scope_names

    methods = [
        m for m, info in ctxmix.MIXING_METHODS.items() if info.group != "scope" or m in scope_names(s2s.spec.position)
    ]
    ex = ctxmix.explain(s2s, SRC, methods)
    assert ex.reconstruction_error < 1e-10 and ex.prediction is None
    for m in methods:
        info = ctxmix.MIXING_METHODS[m]
        assert ex.layer_maps[m].shape == (2, len(ex.tokens), len(ex.tokens))
        if info.rows_sum_to_one:
            np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1, atol=1e-8)
    maps = ctxmix.scope_maps(s2s, SRC)
    assert all(v.shape[0] == 2 for v in maps.values())


def test_clear_errors(bart, tokenizer):
    from conftest import tiny_model

    with pytest.raises(ctxmix.BadInput, match="encoder-decoder"):
        ctxmix.explain(tiny_model("bert", tokenizer), SRC, ["alti"], decoder_text=TGT)
    with pytest.raises(ctxmix.BadInput, match="ALTI\\+"):
        ctxmix.explain(bart, SRC, ["globenc"], decoder_text=TGT)
    with pytest.raises(ctxmix.BadInput, match="gradient and perturbation"):
        ctxmix.explain(bart, SRC, ["integrated_gradients"])
    with pytest.raises(ctxmix.BadInput, match="gradient and perturbation"):
        ctxmix.explain_batch(bart, [SRC], ["alti", "blank_out"])
    with pytest.raises(ctxmix.BadInput, match="decoder_text must be"):
        ctxmix.explain(bart, SRC, ["alti"], decoder_text="  ")
    with pytest.raises(ctxmix.BadInput, match="position"):
        ctxmix.explain(bart, SRC, ["alti"], decoder_text=TGT, position=99)
    with pytest.raises(ctxmix.BadInput, match="foil"):
        ctxmix.explain(bart, SRC, ["alti"], decoder_text=TGT, foil=3)


def test_saved_and_reopened(bart, tmp_path):
    ex = ctxmix.explain(bart, SRC, ["alti"], decoder_text=TGT)
    back = ctxmix.load_explanation(ex.save(tmp_path / "s2s"))
    np.testing.assert_array_equal(source_contribution(back), source_contribution(ex))
    assert back.segments == ex.segments and back.options["decoder_text"] == TGT
    with pytest.raises(ctxmix.BadInput, match="decoder_text"):
        source_contribution(ctxmix.explain(bart, SRC, ["alti"]))


def test_verify_passes_and_catches_a_changed_decoder(tokenizer):
    from ctxmix.verify import verify

    m = tiny_seq2seq("m2m_100", tokenizer)
    df = verify(m, SRC, decoder_text=TGT)
    assert df["passed"].all(), df
    assert any("ALTI+" in c for c in df["check"]) and any(c.startswith("decoder layers") for c in df["check"])
    cw = decoder_weights(m)[1][1]
    cw.Wv = cw.Wv * 1.05  # ctxmix's copy of a cross-attention W_V, changed after loading
    bad = verify(m, SRC, decoder_text=TGT).set_index("check")
    assert not bad.loc["decoder layers recomputed from the weights = the model's hidden states", "passed"]
    assert bad.drop(index="decoder layers recomputed from the weights = the model's hidden states")["passed"].all()


@pytest.mark.slow
def test_folder_load_and_cli(tmp_path, bart_folder, capsys):
    """A saved BART folder loads through load_model (AutoModelForSeq2SeqLM) and the CLI explains and
    verifies it (in this process: `python -m ctxmix` itself is run by tests/test_models_cli.py)."""
    import ctxmix.cli

    loaded = ctxmix.load_model(str(bart_folder), device="cpu")
    assert loaded.kind == "seq2seq"
    out = tmp_path / "ex.json"
    explain = ["explain", SRC, "--model", str(bart_folder), "--method", "alti", "--decoder-text", TGT]
    assert ctxmix.cli.main([*explain, "--out", str(out)]) in (0, None)
    d = json.loads(out.read_text())
    assert d["segments"].count(1) == len(encode_target(loaded, TGT)[0])
    capsys.readouterr()
    assert ctxmix.cli.main(explain) in (0, None)
    assert "source contribution" in capsys.readouterr().out
    assert ctxmix.cli.main(["verify", "--model", str(bart_folder)]) in (0, None)
    assert "ALTI+" in capsys.readouterr().out


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("models") / "bart"
    m = tiny_seq2seq("bart", tokenizer, dtype=torch.float32)
    m.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_explain_page_with_a_target_text(bart_folder, tmp_path, monkeypatch):
    """The Explain page on an encoder-decoder: the target box gives ALTI+ maps over source and target
    and the source-contribution plot; without a target the encoder's maps; no traceback either way."""
    import shlex
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from ctxmix.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path / "results"))
    monkeypatch.chdir(root)
    at = AppTest.from_file(str(root / "app.py"), default_timeout=300)
    at.query_params["model"] = str(bart_folder)
    at.query_params["text"] = SRC
    at.query_params["method"] = ["alti", "globenc"]
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    assert not any("ALTI+" in h.value for h in at.subheader)
    at.text_input(key="decoder").set_value(TGT)
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    assert any("ALTI+" in h.value for h in at.subheader)
    assert at.query_params["decoder"] in (TGT, [TGT])
    cmd = next(c.value for c in at.code if "ctxmix explain" in c.value)
    args = build_parser().parse_args(shlex.split(cmd)[3:])
    assert args.decoder_text == TGT and args.method == ["alti"]


def test_encoder_batched_equals_one_at_a_time(s2s):
    texts = [SRC, "a much longer source sentence , padded against the short one in the batch"]
    methods = ["alti", "globenc", "value_zeroing", "norm"]
    batched = ctxmix.explain_batch(s2s, texts, methods)
    for text, b in zip(texts, batched):
        one = ctxmix.explain(s2s, text, methods)
        for m in methods:
            np.testing.assert_allclose(b.layer_maps[m], one.layer_maps[m], atol=1e-10)


def test_alti_plus_float32_meets_float64(tokenizer):
    """The float32 model's ALTI+ maps equal the float64 model's up to float32 rounding."""
    m64 = tiny_seq2seq("m2m_100", tokenizer)
    import copy

    m32 = ctxmix.model_from_hf(copy.deepcopy(m64.hf).float(), tokenizer, name="tiny-m2m_100-float32")
    a = ctxmix.explain(m64, SRC, ["alti"], decoder_text=TGT)
    b = ctxmix.explain(m32, SRC, ["alti"], decoder_text=TGT)
    np.testing.assert_allclose(b.global_maps["alti"], a.global_maps["alti"], atol=1e-4)
    assert b.reconstruction_error < 1e-4


def test_half_precision_decoder_is_read_one_layer_at_a_time(tokenizer, monkeypatch):
    """A bf16 encoder-decoder keeps no float32 copy of its decoder: `decoder_weights` reads a layer when it is
    reached, nothing is cached on the model, and ALTI+ equals what the whole decoder read at once gives."""
    from ctxmix.engine import seq2seq

    m = tiny_seq2seq("bart", tokenizer, dtype=torch.bfloat16)
    layers = decoder_weights(m)
    assert isinstance(layers, seq2seq.DecoderLayers) and len(layers) == 3
    sw, cw = layers[1]
    assert sw.W2.dtype == torch.float32 and cw.n_heads == 2
    got = ctxmix.explain(m, SRC, ["alti"], decoder_text=TGT)
    assert getattr(m, "_decoder_weights", None) is None
    whole = list(seq2seq.DecoderLayers(m))
    monkeypatch.setattr(seq2seq, "decoder_weights", lambda model: whole)
    monkeypatch.setattr("ctxmix.methods.alti_plus.decoder_weights", lambda model: whole, raising=False)
    ref = ctxmix.explain(m, SRC, ["alti"], decoder_text=TGT)
    np.testing.assert_array_equal(got.layer_maps["alti"], ref.layer_maps["alti"])
    np.testing.assert_array_equal(got.global_maps["alti"], ref.global_maps["alti"])
