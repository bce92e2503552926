"""Whisper: an encoder over a log-mel spectrogram (mBART's pre-LN layers) and a decoder explained by ALTI+.

On tiny random models in float64 the encoder's every decomposition and the decoder's two blocks reconstruct the
model's own states (1e-8), the positions are the encoder's frames with the padding marked, and the transcript's
ALTI+ maps are complete; on the embedded whisper-tiny-en (see test_whisper_tiny_en.py) the same holds on speech."""

import numpy as np
import pytest
import torch
import transformers as T
from conftest import randomise_norms
from test_reconstruction import TOL, _check

import ctxmix
from ctxmix.engine.inputs import NOT_AN_ID, audio_input, trace_audio
from ctxmix.engine.layer import value_zeroing_columns
from ctxmix.engine.seq2seq import decoder_weights, trace_seq2seq
from ctxmix.engine.transcribe import transcribe
from ctxmix.errors import BadInput
from ctxmix.methods.alti_plus import alti_plus_pieces, source_contribution
from ctxmix.methods.mixing import value_zeroing_maps
from ctxmix.methods.registry import MIXING_METHODS

# 50 positions 20 ms apart: a window of 1 s (100 mel frames of 8 bins)
SMALL = dict(
    vocab_size=60,
    num_mel_bins=8,
    encoder_layers=2,
    encoder_attention_heads=4,
    decoder_layers=2,
    decoder_attention_heads=2,
    d_model=32,
    encoder_ffn_dim=64,
    decoder_ffn_dim=48,
    max_source_positions=50,
    max_target_positions=12,
    decoder_start_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    bos_token_id=1,
    begin_suppress_tokens=[2],
    suppress_tokens=[3],
)


@pytest.fixture(scope="module")
def whisper():
    torch.manual_seed(0)
    hf = T.WhisperForConditionalGeneration(T.WhisperConfig(**SMALL)).to(torch.float64).eval()
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, name="tiny-whisper")


def clip(seconds: float = 0.5, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.5 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) + 0.05 * np.random.default_rng(0).normal(
        size=t.size
    )


def test_the_encoders_positions_are_frames_with_the_padding_marked(whisper):
    assert whisper.spec.family == "Whisper" and whisper.kind == "seq2seq" and whisper.spec.position == "pre"
    inp = audio_input(whisper, clip(0.5), 16000)
    assert tuple(inp.input_values.shape) == (1, 8, 100) and inp.feature == "input_features"
    assert inp.n == 50 and inp.n_valid == 25  # 8,000 samples, 320 per position
    labels = inp.labels()
    assert labels[:2] == ["0.000s", "0.020s"] and labels[24] == "0.480s" and labels[25] == "0.500s pad"
    # position k's centred receptive field: mel frames 2k - 2 .. 2k + 2, each 400 samples around its hop
    assert inp.span(0) == (0.0, 520 / 16000) and inp.span(10) == ((3200 - 520) / 16000, (3200 + 520) / 16000)
    assert inp.record()["valid_frames"] == 25 and inp.record()["samples"] == 8000
    longer = audio_input(whisper, clip(0.99), 16000)
    assert longer.n_valid == 50


def test_a_clip_and_the_clip_with_trailing_silence_are_two_inputs(whisper):
    """Their log-mel features are equal (Whisper pads with zeros), their valid frames are not: the fingerprint (the
    results cache's key, the saved sha256) tells them apart."""
    a = audio_input(whisper, clip(0.5), 16000)
    b = audio_input(whisper, np.concatenate([clip(0.5), np.zeros(4000)]), 16000)
    assert a.n_valid != b.n_valid and a.fingerprint() != b.fingerprint()


def test_a_clip_longer_than_the_window_is_refused_not_cut(whisper):
    with pytest.raises(BadInput, match="cut the clip"):
        audio_input(whisper, clip(1.5), 16000)


def test_the_encoder_is_exact(whisper):
    tr = trace_audio(whisper, clip(), 16000)
    assert tr.reconstruction_error < TOL and tr.input_ids == [NOT_AN_ID] * 50
    for factorised in (True, False):
        for lw, errs in _check(tr, factorised=factorised):
            assert errs and max(errs.values()) < TOL, (lw.index, errs)
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    # the two routes round y_i differently by ~eps relative; a cosine distance D = 1 - cos then carries ~eps / D
    # relative error, and zeroing one frame of a smooth clip moves the big pre-LN stream very little (small D)
    D = min(
        float(value_zeroing_columns(lw, st, torch.arange(tr.n), factorised=False).min())
        for lw, st in zip(whisper.layers, tr.states)
    )
    assert D > 0
    np.testing.assert_allclose(fast, slow, rtol=64 * np.finfo(np.float64).eps / D, atol=0)


def test_explain_runs_every_mixing_method_on_the_encoder_and_transcribes(whisper):
    from ctxmix.methods.registry import scope_names

    methods = [m for m, i in MIXING_METHODS.items() if i.group != "scope" or m in scope_names("pre")]
    ex = ctxmix.explain(whisper, None, methods, audio=clip(), sampling_rate=16000)
    assert len(ex.tokens) == 50 and ex.tokens[-1].endswith("pad") and ex.reconstruction_error < TOL
    for m in ("attention", "alti", "value_zeroing"):
        np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=1e-8, err_msg=m)
    assert ex.transcript == transcribe(whisper, audio_input(whisper, clip(), 16000)).text
    assert ex.options["audio"]["valid_frames"] == 25


def test_greedy_transcription_follows_the_decoding_rules(whisper):
    script = transcribe(whisper, audio_input(whisper, clip(), 16000))
    assert script.prompt == [1] and 2 not in script.ids[:1] and 3 not in script.ids
    assert len(script.decoder_ids) <= 12 and len(script.target_ids) == len(script.decoder_ids)
    # greedy: each token is the argmax of the model's own logits, with the suppressed tokens masked
    inp = audio_input(whisper, clip(), 16000)
    with torch.no_grad():
        logits = whisper.hf(
            **inp.forward_kwargs("cpu", torch.float64), decoder_input_ids=torch.tensor([script.decoder_ids])
        ).logits[0]
    logits[:, 3] = -np.inf
    logits[0, 2] = -np.inf
    assert logits.argmax(-1)[:-1].tolist() == script.ids
    if script.ended:
        assert int(logits[-1].argmax()) == 2


def test_the_decoders_blocks_decompose_exactly_on_frames(whisper):
    inp = audio_input(whisper, clip(), 16000)
    dec = transcribe(whisper, inp).decoder_ids
    tr = trace_seq2seq(whisper, inp, dec)
    assert tr.reconstruction_error < TOL and tr.n_source == 50 and tr.encoder.inputs is inp
    for (sw, cw), st in zip(decoder_weights(whisper), tr.decoder):
        for F, b, real in alti_plus_pieces(sw, cw, st, torch.arange(len(dec))).values():
            assert float((F.sum(-2) + b - real).abs().max()) < TOL


def test_alti_plus_over_frames_and_the_models_transcript(whisper):
    ex = ctxmix.explain(whisper, None, ["alti"], audio=clip(), sampling_rate=16000, decoder_text=True)
    S = ex.options["n_source"]
    n = len(ex.tokens)
    assert S == 50 and ex.segments == [0] * S + [1] * (n - S) and ex.options["method_variant"] == "ALTI+"
    M, R = ex.layer_maps["alti"], ex.global_maps["alti"]
    assert M.shape == R.shape == (2, n, n) and ex.reconstruction_error < TOL
    np.testing.assert_allclose(R.sum(-1), 1.0, atol=1e-8)
    np.testing.assert_array_equal(M[:, :S, :S], np.broadcast_to(np.eye(S), (2, S, S)))
    share = source_contribution(ex)
    assert share.shape == (2, n - S) and ((share >= -1e-12) & (share <= 1 + 1e-12)).all()
    assert ex.position == n - 1 and ex.transcript is not None
    fig = ex.show()  # the last decoder input's row over the frames, under the log-mel spectrogram, with the words
    spectrogram, bars = fig.data
    assert spectrogram.type == "heatmap" and spectrogram.z.shape[0] == whisper.config.num_mel_bins
    np.testing.assert_allclose(np.asarray(bars.y), R[-1, -1, :S][: len(bars.y)], rtol=1e-12)
    assert len(fig.layout.shapes) >= len(ex.options["words"])  # a band per word (and the padding's)


def test_whisper_calls_that_cannot_work_say_why(whisper):
    cases = [
        (
            lambda: ctxmix.explain(whisper, None, ["globenc"], audio=clip(), sampling_rate=16000, decoder_text=True),
            "ALTI+",
        ),
        (
            lambda: ctxmix.explain(whisper, None, ["alti"], audio=clip(), sampling_rate=16000, decoder_text="words"),
            "tokenizer",
        ),
        (
            lambda: ctxmix.explain(whisper, None, ["alti"], audio=clip(), sampling_rate=16000, decoder_text=" "),
            "non-empty",
        ),
        (lambda: ctxmix.explain(whisper, "words", ["alti"]), "reads audio"),
    ]
    for call, words in cases:
        with pytest.raises(BadInput, match=words):
            call()


def test_dtw_finds_the_cheapest_monotonic_path():
    from ctxmix.methods.speech import dtw_path

    cost = np.array([[0, 0, 9, 9], [9, 9, 0, 9], [9, 9, 9, 0]], dtype=float)
    rows, cols = dtw_path(cost)
    assert rows.tolist() == [0, 0, 1, 2] and cols.tolist() == [0, 1, 2, 3]
    rows, cols = dtw_path(np.zeros((3, 3)))  # ties: the diagonal
    assert rows.tolist() == cols.tolist() == [0, 1, 2]


def test_the_transcripts_words_lie_in_order_on_the_clip(whisper):
    ex = ctxmix.explain(whisper, None, ["alti"], audio=clip(), sampling_rate=16000, decoder_text=True)
    words = ex.options["words"]
    script_len = len(ex.tokens) - ex.options["n_source"] - 1  # the prompt is one token here
    assert sum(len(w["tokens"]) for w in words) == script_len
    firsts = [w["frames"][0] for w in words]
    assert firsts == sorted(firsts) and all(0 <= w["frames"][0] < w["frames"][1] <= 25 for w in words)
    assert all(w["start"] == w["frames"][0] * 0.02 and w["end"] == w["frames"][1] * 0.02 for w in words)
    from ctxmix.methods.speech import word_shares

    shares = word_shares(ex)
    frames_share = ex.global_maps["alti"][-1][ex.position][: ex.options["n_source"]].sum()
    assert len(shares) == len(words) and sum(s["share"] for s in shares) <= frames_share + 1e-12
    with pytest.raises(BadInput, match="transcript"):
        word_shares(ctxmix.explain(whisper, None, ["alti"], audio=clip(), sampling_rate=16000))
