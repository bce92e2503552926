"""Speech: how a speech model's frames mix (Whisper's encoder, wav2vec2, HuBERT), and which frames Whisper's
transcript reads (ALTI+), with the text pages' exact methods."""

import pandas as pd
import streamlit as st

import ctxmix
from ctxmix.engine.inputs import SAMPLE_CLIPS, audio_input, sample_clip
from ctxmix.export import plots
from ctxmix.methods.explain import input_methods
from ctxmix.methods.speech import frame_values, word_shares
from ctxmix.service.cache import cached_explain
from ctxmix.service.limits import check_audio
from ctxmix_dashboard.ui import common
from ctxmix_dashboard.ui.input_corpus import change_section

common.page_setup()

st.title("Speech")
st.caption(
    "A speech model's positions are frames of the clip, 20 ms apart. Whisper reads a 30 s window: the positions past "
    "the clip hold the feature extractor's padding, shaded grey and counted apart. Every mixing method is exact "
    "here as on text; for Whisper's transcript, ALTI+ says which frames each token reads."
)
names = common.allowed_speech_models()
if not names:
    st.error("No speech model is allowed on this server (allowed_models in its secrets lists none).")
    st.stop()
name = st.sidebar.selectbox("Model", names, index=common.qp_index("speech_model", names), key="speech_model")
common.set_qp(speech_model=name)
model = common.load_or_stop(name)
lim = common.limits()
whisper = model.spec.encoder_decoder

source = st.radio("Clip", ["A bundled sentence", "Upload a WAV file"], horizontal=True, key="clip_source")
if source == "A bundled sentence":
    sample = st.selectbox(
        "Sentence (spoken by flite)", list(SAMPLE_CLIPS), format_func=lambda k: SAMPLE_CLIPS[k], key="clip"
    )
    common.set_qp(clip=sample)
    clip, label = sample_clip(sample), sample
else:
    up = st.file_uploader(
        "WAV (any rate: resampled to 16 kHz)",
        type=["wav"],
        key="clip_file",
        max_upload_size=max(1, int(lim["max_upload_mb"] + 0.999)),
    )
    if up is None:
        st.info("Upload a WAV file to explain it.")
        st.stop()
    clip, label = up.getvalue(), up.name

views = ["The transcript (ALTI+)", "The encoder's frames"] if whisper else ["The frames"]
view = st.radio("Explain", views, horizontal=True, key="speech_view")
transcript_view = view.startswith("The transcript")
if transcript_view:
    methods = ["alti"]
    st.caption("ALTI+ (Ferrando et al. 2022): the decoder's tokens over the encoder's frames and the earlier tokens.")
else:
    methods = st.multiselect(
        "Methods", input_methods(model), default=["alti", "attention_rollout"], key="speech_methods"
    )
    if not methods:
        st.info("Pick at least one method.")
        st.stop()
    slow = [m for m in methods if m == "value_zeroing" or m.startswith("Atb")]
    if slow and whisper:
        st.caption(
            f"{', '.join(slow)}: Whisper's encoder has 1,500 positions whatever the clip, so these take minutes on a "
            "CPU (value zeroing with ALTI and GlobEnc: about 2 minutes on 2 cores); ALTI alone takes seconds."
        )


with common.errors_as_messages():
    inp = audio_input(model, clip)
    check_audio(common.server_limits(), inp)
    with st.spinner(f"Tracing {inp.n} positions…"), common.engine_progress("Decomposing every layer:"):
        transcript = {"decoder_text": True} if transcript_view else {}
        ex = cached_explain(model, None, methods, audio=inp, **transcript)  # keyed by what the model reads
    seconds = inp.clip_samples / inp.sampling_rate
    st.markdown(
        f"**{label}**: {seconds:.2f} s; {inp.n_valid} of {inp.n} positions hold the clip"
        + (f" (the other {inp.n - inp.n_valid} are padding)" if inp.n_valid < inp.n else "")
        + f"; reconstruction error {ex.reconstruction_error:.1e}."
    )
    if ex.transcript is not None:
        st.markdown(f"Transcript: *{ex.transcript}*")
    for w in ex.warnings:
        st.warning(w)
    common.set_provenance(
        model=name,
        weights_sha256=ctxmix.engine.fingerprint.weights_sha256(model),
        clip=label,
        clip_sha256=inp.fingerprint(),
        methods=methods,
    )

    method = st.selectbox("Map", methods, key="speech_map")
    S = ex.options.get("n_source", len(ex.tokens))
    if transcript_view:
        rows = list(range(S, len(ex.tokens)))
        position = st.selectbox(
            "Row (a decoder input: it predicts the next token)",
            rows,
            index=len(rows) - 1,
            format_func=lambda p: f"{p - S}: {plots.display_tokens([ex.tokens[p]])[0]}",
            key="speech_row",
        )
    elif method not in ex.global_maps:  # a gradient method: one score per frame for the class, no map
        st.caption(
            f"{method} scores the predicted class, {ex.prediction['label']}, at layer 0's input (the frame "
            "embeddings): one value per frame, no row to choose, no layers."
        )
        position = ex.position
    else:
        position = st.slider("Row (a frame)", 0, inp.n_valid - 1, 0, key="speech_frame")
    what = plots.display_tokens([ex.tokens[position]])[0]
    show_padding = st.checkbox("Show the padding's frames too", value=False, key="show_padding")
    times = pd.Series(range(inp.n)).to_numpy() * inp.stride / inp.sampling_rate

    def heat(values, title, key):
        fig = plots.explained_clip_heat(
            ex.options["audio"],
            values,
            inp.input_values[0].numpy(),
            spectrogram=inp.feature == "input_features",
            words=ex.options.get("words"),
            show_padding=show_padding,
            title=title,
        )
        common.plot(fig, key, data=pd.DataFrame({"time_s": times, "frame": ex.tokens[: inp.n], "share": values}))

    values = frame_values(ex, method, position)
    scored = method not in ex.global_maps
    st.subheader(
        f"{method}: the class's score per frame"
        if scored
        else f"{method}: what {what} mixes in from the frames, after the last layer"
    )
    if scored:
        st.caption("The scores at layer 0's input, one per frame.")
    else:
        st.caption(
            f"The row of the aggregated map. Its share in the clip's frames: {values[: inp.n_valid].sum():.3f}; in "
            f"the padding: {values[inp.n_valid :].sum():.3f}"
            + (
                f"; in the earlier decoder inputs: {ex.global_maps[method][-1][position][S:].sum():.3f}."
                if whisper and transcript_view
                else "."
            )
        )
    title = f"{method}, the class's score" if scored else f"{method}, row {what}, aggregated"
    heat(values, title, f"speech_{method}_{position}")
    if ex.options.get("words"):
        shares = pd.DataFrame(word_shares(ex, method, position))
        st.dataframe(shares, hide_index=True)
        common.export_table(shares, f"speech_words_{position}")

    if method in ex.layer_maps:
        n_layers = ex.layer_maps[method].shape[0]
        layer = st.slider("Layer", 1, n_layers, n_layers, key="speech_layer")
        st.subheader(f"{method}: layer {layer}'s own map, row {what}")
        heat(
            frame_values(ex, method, position, layer=layer),
            f"{method}, row {what}, layer {layer}",
            f"speech_{method}_{position}_layer{layer}",
        )
    flag = " --transcribe" if transcript_view else ""
    common.reproduce(
        f"python -m ctxmix explain --audio CLIP.wav --model {name} --method {' '.join(methods)}{flag} "
        f"--position {position}"
    )

change_section(
    model,
    name,
    {k: sample_clip(k) for k in SAMPLE_CLIPS},
    "clips",
    "Whisper's encoder has 1,500 positions whatever the clip: about 3-5 minutes per clip on a 2-core CPU.",
    upload_types=["wav"],
)
