"""An image model's image processor: the family's default built from its config, or a model folder's own.
(Apart from `ctxmix.engine.inputs`, which traces: loading a model reads a processor and never traces.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctxmix.errors import BadInput


def default_image_processor(config) -> Any:
    """The family's image processor (or a speech encoder's feature extractor) built from its config (no files
    needed: random-config models, and models loaded without one): ViT's resize to the model's size, DINOv2's
    resize and centre crop with ImageNet statistics, CLIP's with its own; wav2vec2's and HuBERT's 16 kHz
    normalised waveform."""
    import transformers as T

    size = int(getattr(config, "image_size", 224))
    mt = getattr(config, "model_type", "")
    if mt == "vit":
        return T.ViTImageProcessorPil(size={"height": size, "width": size})
    if mt in ("dinov2", "dinov2_with_registers"):
        return T.BitImageProcessorPil(
            size={"shortest_edge": round(size * 256 / 224)},
            crop_size={"height": size, "width": size},
            do_convert_rgb=True,
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
    if mt in ("wav2vec2", "hubert"):  # a speech encoder's feature extractor: 16 kHz, zero mean and unit variance
        return T.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True)
    if mt == "clip_vision_model":
        return T.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    raise BadInput(f"no default processor for model type {mt!r}; pass processor= to model_from_hf")


def image_processor_from(folder: str, config) -> Any:
    """A model folder's image processor (its preprocessor_config.json, read with the PIL backend: ctxmix does not
    need torchvision), or the family's default when the folder has none."""
    import transformers as T

    if not (Path(folder) / "preprocessor_config.json").is_file():
        return default_image_processor(config)
    kind = json.loads((Path(folder) / "preprocessor_config.json").read_text()).get("image_processor_type", "")
    cls = getattr(T, kind.removesuffix("Pil") + "Pil", None) or getattr(T, kind, None)
    if cls is None:
        raise BadInput(f"{folder}: unknown image processor {kind!r}")
    return cls.from_pretrained(folder)
