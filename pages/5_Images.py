"""Images: how a vision Transformer's class token and patches mix (ViT, DINOv2, CLIP's vision tower), with the
text pages' exact methods."""

import pandas as pd
import streamlit as st

import ctxmix
from ctxmix.engine.inputs import SAMPLE_IMAGES, image_input, sample_image
from ctxmix.export import plots
from ctxmix.methods.explain import input_methods
from ctxmix.methods.images import patch_values, position_of
from ctxmix.service.cache import cached_explain
from ctxmix.service.limits import check_image
from ctxmix_dashboard.ui import common
from ctxmix_dashboard.ui.input_corpus import change_section

common.page_setup()

st.title("Images")
st.caption(
    "An image model's positions are its class token (and DINOv2's registers), then one patch per grid cell, row "
    "by row. Every mixing method is exact here as on text: the heat is one row of a map (by default the class "
    "token's), over the patches it reads."
)
names = common.allowed_image_models()
if not names:
    st.error("No image model is allowed on this server (allowed_models in its secrets lists none).")
    st.stop()
# its own URL key: the text pages' shared "model" names a text model
name = st.sidebar.selectbox("Model", names, index=common.qp_index("image_model", names), key="image_model")
common.set_qp(image_model=name)
model = common.load_or_stop(name)
lim = common.limits()

source = st.radio("Image", ["A bundled photograph", "Upload an image"], horizontal=True, key="image_source")
if source == "A bundled photograph":
    photo = st.selectbox("Photograph (scikit-image's)", list(SAMPLE_IMAGES), key="photo")
    common.set_qp(photo=photo)
    image, label = sample_image(photo), photo
else:
    up = st.file_uploader(
        "PNG, JPEG, WebP or BMP",
        type=["png", "jpg", "jpeg", "webp", "bmp"],
        key="image_file",
        max_upload_size=max(1, int(lim["max_upload_mb"] + 0.999)),
    )
    if up is None:
        st.info("Upload an image to explain it.")
        st.stop()
    image, label = up.getvalue(), up.name

methods = st.multiselect("Methods", input_methods(model), default=["alti", "attention_rollout"], key="image_methods")
if not methods:
    st.info("Pick at least one method.")
    st.stop()


with common.errors_as_messages():
    inp = image_input(model, image)
    check_image(common.server_limits(), inp)
    with st.spinner(f"Tracing {inp.n} positions…"), common.engine_progress("Decomposing every layer:"):
        ex = cached_explain(model, None, methods, image=inp)  # keyed by the pixels the model reads
    rows, cols = inp.grid
    st.markdown(
        f"**{label}** as {name} reads it: {inp.pixel_values.shape[-1]} × {inp.pixel_values.shape[-2]} pixels, "
        f"{rows} × {cols} patches of {inp.patch} pixels, {inp.n} positions; reconstruction error "
        f"{ex.reconstruction_error:.1e}."
    )
    common.set_provenance(
        model=name,
        weights_sha256=ctxmix.engine.fingerprint.weights_sha256(model),
        image=label,
        image_sha256=inp.fingerprint(),
        methods=methods,
    )

    method = st.selectbox("Map", methods, key="image_map")
    scored = method not in ex.global_maps  # a gradient method: one score per position for the class, no map
    if scored:
        st.caption(
            f"{method} scores the predicted class, {ex.prediction['label']}, at layer 0's input (the patch "
            "embeddings): one value per position, no row to choose, no layers."
        )
    whose = (
        "The class token"
        if scored
        else st.radio("Row", ["The class token", "A patch"], horizontal=True, key="image_row")
    )
    if whose == "A patch":
        r = st.slider("Patch row", 0, rows - 1, rows // 2, key="patch_row")
        c = st.slider("Patch column", 0, cols - 1, cols // 2, key="patch_col")
        position = position_of(ex, r, c)
    else:
        position = 0
    what = ex.tokens[position]

    prefix, grid = patch_values(ex, method, position)
    st.subheader(
        f"{method}: the class's score per patch" if scored else f"{method}: what {what} mixes in, after the last layer"
    )
    st.caption(
        ("The scores; " if scored else "The row of the aggregated map (rollout of the layer maps); ")
        + "prefix tokens: "
        + ", ".join(f"{t} {v:.3g}" for t, v in prefix.items())
    )
    common.plot(
        plots.image_heat(
            inp.rgb(), grid, title=f"{method}, the class's score" if scored else f"{method}, row {what}, aggregated"
        ),
        f"image_{method}_{what}",
        data=pd.DataFrame(grid),
    )

    if method in ex.layer_maps:
        layer = st.slider("Layer", 1, model.n_layers, model.n_layers, key="image_layer")
        prefix_l, grid_l = patch_values(ex, method, position, layer=layer)
        st.subheader(f"{method}: layer {layer}'s own map, row {what}")
        common.plot(
            plots.image_heat(inp.rgb(), grid_l, title=f"{method}, row {what}, layer {layer}"),
            f"image_{method}_{what}_layer{layer}",
            data=pd.DataFrame(grid_l),
        )
    common.reproduce(
        f"python -m ctxmix explain --image IMAGE.png --model {name} --method {' '.join(methods)} --position {position}"
    )

change_section(
    model,
    name,
    {k: sample_image(k) for k in SAMPLE_IMAGES},
    "photographs",
    "About 10-30 s per photograph on a CPU.",
    upload_types=["png", "jpg", "jpeg", "webp", "bmp"],
)
