"""What turns an image or a clip into a model's input: an image model's image processor or a speech model's feature
extractor, the family's default built from its config or a model folder's own. (Apart from `ctxmix.engine.inputs`,
which traces: loading a model reads a processor and never traces.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctxmix.errors import BadInput


def default_processor(config) -> Any:
    """The family's image processor (or a speech encoder's feature extractor) built from its config (no files
    needed: random-config models, and models loaded without one): ViT's resize to the model's size, DINOv2's
    resize and centre crop with ImageNet statistics, CLIP's with its own; wav2vec2's and HuBERT's 16 kHz
    normalised waveform; Whisper's log-mel spectrogram of 30 s."""
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
    if mt == "whisper":  # 80 (or 128) log-mel bins every 10 ms, padded to 30 s as the encoder requires
        # the window is what the encoder's positions cover: 2 mel frames of 10 ms each (30 s for 1,500)
        seconds = max(1, round(int(getattr(config, "max_source_positions", 1500)) / 50))
        return T.WhisperFeatureExtractor(feature_size=int(getattr(config, "num_mel_bins", 80)), chunk_length=seconds)
    if mt == "clip_vision_model":
        return T.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    raise BadInput(f"no default processor for model type {mt!r}; pass processor= to model_from_hf")


def processor_from(folder: str, config) -> Any:
    """A model folder's image processor (its preprocessor_config.json, read with the PIL backend: ctxmix does not
    need torchvision) or feature extractor, or the family's default when the folder has none."""
    import transformers as T

    if not (Path(folder) / "preprocessor_config.json").is_file():
        return default_processor(config)
    saved = json.loads((Path(folder) / "preprocessor_config.json").read_text())
    if saved.get("feature_extractor_type") and not saved.get("image_processor_type"):
        cls = getattr(T, saved["feature_extractor_type"], None)
        if cls is None:
            raise BadInput(f"{folder}: unknown feature extractor {saved['feature_extractor_type']!r}")
        return cls.from_pretrained(folder)
    kind = saved.get("image_processor_type", "")
    cls = getattr(T, kind.removesuffix("Pil") + "Pil", None) or getattr(T, kind, None)
    if cls is None:
        raise BadInput(f"{folder}: unknown image processor {kind!r}")
    return cls.from_pretrained(folder)
