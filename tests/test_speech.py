"""Speech encoders (wav2vec2 and HuBERT: post-LN base, pre-LN large): a clip's frames are the positions, and every
decomposition reconstructs the model's own states (float64, 1e-8) on tiny random models, as for text."""

import numpy as np
import pytest
import torch
import transformers as T
from conftest import randomise_norms
from scipy.io import wavfile
from test_reconstruction import TOL, _check

import ctxmix
from ctxmix.engine.arch import spec_for
from ctxmix.engine.inputs import NOT_AN_ID, audio_input, trace_audio
from ctxmix.engine.layer import norm_family_pieces, value_zeroing_columns
from ctxmix.errors import BadInput, UnsupportedArchitecture
from ctxmix.methods.mixing import value_zeroing_maps
from ctxmix.methods.registry import MIXING_METHODS

# frames 80 samples apart (5 ms at 16 kHz), each reading 150 samples
SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(10, 8),
    conv_kernel=(10, 15),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
)
STABLE = dict(do_stable_layer_norm=True, feat_extract_norm="layer")
SPEECH = {
    "wav2vec2": (T.Wav2Vec2Model, T.Wav2Vec2Config(**SMALL)),
    "wav2vec2-large": (T.Wav2Vec2Model, T.Wav2Vec2Config(**SMALL, **STABLE)),
    "hubert": (T.HubertModel, T.HubertConfig(**SMALL)),
    "hubert-large": (T.HubertModel, T.HubertConfig(**SMALL, **STABLE)),
    "wav2vec2-classifier": (T.Wav2Vec2ForSequenceClassification, T.Wav2Vec2Config(**SMALL, num_labels=2)),
}


def speech_model(name: str):
    torch.manual_seed(0)
    cls, cfg = SPEECH[name]
    hf = cls._from_config(cfg).to(torch.float64).eval()
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, name=f"tiny-{name}")


def clip(seconds: float = 0.25, rate: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return 0.5 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) + 0.05 * noise


@pytest.fixture(scope="module", params=list(SPEECH))
def speech(request):
    return speech_model(request.param)


def test_the_layers_rebuilt_from_weights_give_the_models_states(speech):
    tr = trace_audio(speech, clip(), sampling_rate=16000)
    assert tr.reconstruction_error < TOL
    assert speech.spec.position == ("pre" if "large" in speech.name else "post")
    inp = tr.inputs
    assert tr.n == inp.frames == (4000 - 150) // 80 + 1
    assert tr.input_ids == [NOT_AN_ID] * tr.n
    assert tr.tokens[:3] == ["0.000s", "0.005s", "0.010s"] and inp.span(2) == (0.01, (160 + 150) / 16000)


def test_every_scope_reconstructs_on_a_clip(speech):
    tr = trace_audio(speech, clip(), sampling_rate=16000)
    for factorised in (True, False):
        for lw, errs in _check(tr, factorised=factorised):
            assert errs and max(errs.values()) < TOL, (speech.name, lw.index, errs)
    for lw, st in zip(speech.layers, tr.states):
        P = norm_family_pieces(lw, st, torch.arange(tr.n))
        assert float((P["norm_res"].sum(1) + lw.bo - st.r1).abs().max()) < TOL


def test_value_zeroing_factorised_equals_straightforward_on_a_clip(speech):
    tr = trace_audio(speech, clip(0.1), sampling_rate=16000)
    fast, slow = value_zeroing_maps(tr), value_zeroing_maps(tr, factorised=False)
    np.testing.assert_allclose(fast.sum(-1), 1.0, atol=1e-12)
    # the two routes round y_i differently by ~eps relative; a distance D = 1 - cos then carries ~eps / D relative
    # error (a random model's distances are small: 1e-7 here), which the row normalisation keeps
    D = min(
        float(value_zeroing_columns(lw, st, torch.arange(tr.n), factorised=False).min())
        for lw, st in zip(speech.layers, tr.states)
    )
    assert D > 0
    np.testing.assert_allclose(fast, slow, rtol=64 * np.finfo(np.float64).eps / D, atol=0)


def test_explain_a_clip_with_every_mixing_method(speech):
    scopes = ["AtbLnFfRes"] if "large" in speech.name else ["AtbFfResLn"]
    methods = [m for m in MIXING_METHODS if not m.startswith("Atb")] + scopes
    ex = ctxmix.explain(speech, None, methods, audio=clip(0.1), sampling_rate=16000)
    n = (1600 - 150) // 80 + 1
    assert ex.position == 0 and len(ex.tokens) == n and ex.reconstruction_error < TOL
    for m in methods:
        assert ex.layer_maps[m].shape == (2, n, n) and np.isfinite(ex.layer_maps[m]).all(), m
    for m in ("attention", "alti", "value_zeroing"):
        np.testing.assert_allclose(ex.layer_maps[m].sum(-1), 1.0, atol=1e-8, err_msg=m)
    assert ex.options["audio"] == {
        "sampling_rate": 16000,
        "stride": 80,
        "receptive": 150,
        "offset": 0,
        "samples": 1600,
        "frames": n,
        "valid_frames": n,
        "sha256": audio_input(speech, clip(0.1), 16000).fingerprint(),
    }
    if speech.kind == "classifier":
        assert set(ex.prediction["probabilities"]) == {"LABEL_0", "LABEL_1"}


def test_a_wav_file_and_other_rates_read_as_the_array_does(tmp_path):
    m = speech_model("wav2vec2")
    x = clip()
    path = tmp_path / "clip.wav"
    wavfile.write(path, 16000, (x * 32767 / np.abs(x).max()).astype(np.int16))
    from_file = audio_input(m, path)
    assert from_file.sampling_rate == 16000 and from_file.frames == audio_input(m, x, 16000).frames
    wavfile.write(tmp_path / "stereo.wav", 16000, np.stack([x, x], 1).astype(np.float32))
    torch.testing.assert_close(
        audio_input(m, tmp_path / "stereo.wav").input_values, audio_input(m, x, 16000).input_values
    )
    at_8k = audio_input(m, x[::2], 8000)  # resampled to 16 kHz: as many samples as the 16 kHz clip
    assert at_8k.input_values.shape[-1] == 4000 and at_8k.frames == from_file.frames


def test_bad_audio_calls_say_what_is_wrong(tmp_path, tokenizer):
    m = speech_model("wav2vec2")
    (tmp_path / "text.wav").write_text("not audio")
    cases = [
        (lambda: ctxmix.explain(m, None, ["alti"], audio=clip()), "sampling_rate"),
        (lambda: ctxmix.explain(m, None, ["alti"], audio=np.zeros(100), sampling_rate=16000), "at least 150"),
        (lambda: ctxmix.explain(m, None, ["alti"], audio=np.full(4000, np.nan), sampling_rate=16000), "finite"),
        (lambda: ctxmix.explain(m, None, ["alti"], audio=tmp_path / "none.wav"), "no audio file"),
        (lambda: ctxmix.explain(m, None, ["alti"], audio=tmp_path / "text.wav"), "not a WAV file"),
        (lambda: ctxmix.explain(m, None, ["grad"], audio=clip(), sampling_rate=16000), "mixing methods"),
        (lambda: ctxmix.explain(m, None, ["alti"], audio=clip(), image=np.zeros((8, 8, 3))), "not both"),
        (lambda: ctxmix.explain(m, "words", ["alti"]), "reads audio"),
        (lambda: ctxmix.explain(m, None, ["alti"], image=np.zeros((8, 8, 3))), "not image"),
    ]
    text = ctxmix.model_from_hf(
        T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)),
        tokenizer,
    )
    cases.append((lambda: ctxmix.explain(text, None, ["alti"], audio=clip(), sampling_rate=16000), "not audio"))
    for call, words in cases:
        with pytest.raises(BadInput) as err:
            call()
        assert words in str(err.value), (words, str(err.value))


def test_adapters_are_refused_by_name():
    with pytest.raises(UnsupportedArchitecture, match="adapter_attn_dim"):
        spec_for(T.Wav2Vec2Config(**SMALL, adapter_attn_dim=8))


def test_contextualization_change_over_a_folder_of_clips(tmp_path, capsys):
    """The FF paper's 1 - rho per layer over clips: the API on arrays' AudioInputs, the CLI on a folder of WAVs."""
    m = speech_model("wav2vec2")
    clips = [audio_input(m, clip(0.1, seed=k), 16000) for k in range(3)]
    df = ctxmix.contextualization_change(m, clips, progress=False)
    assert set(df["layer"]) == {1, 2} and (df["n"] == 3).all() and df["change"].between(0, 2).all()
    with pytest.raises(BadInput, match="mask_rate"):
        ctxmix.contextualization_change(m, clips, mask_rate=0.1, progress=False)
    m.hf.save_pretrained(tmp_path / "model")
    (tmp_path / "clips").mkdir()
    for k in range(2):
        wavfile.write(tmp_path / "clips" / f"{k}.wav", 16000, (clip(0.1, seed=k) * 20000).astype(np.int16))
    (tmp_path / "clips" / "notes.txt").write_text("not a clip")
    from ctxmix.cli import main

    out = tmp_path / "change.csv"
    main(["change", "--audio-dir", str(tmp_path / "clips"), "--model", str(tmp_path / "model"), "--out", str(out)])
    import pandas as pd

    got = pd.read_csv(out)
    assert set(got["layer"]) == {1, 2} and (got["n"] == 2).all()
    assert main(["change", "--audio-dir", str(tmp_path / "none"), "--model", str(tmp_path / "model")]) == 2
    assert "no folder" in capsys.readouterr().err
