"""Inputs that are not token ids: an image's pixel values as a vision Transformer reads them, and a clip as a speech
model reads it.

A text model's positions are its tokens; an image model's are its class token (and DINOv2's registers) followed
by one patch per grid cell, row by row; a speech model's are frames in time order. `ImageInput` and `AudioInput`
hold what the model reads (the processor's pixel values, the clip's samples or spectrogram) and what each position
is (its label, grid cell or time span), so that the trace, the maps and their labels never guess.
The sequence's positions stand where token ids stand elsewhere: `Trace.input_ids` then holds -1 per position,
which no embedding accepts, so a method that would feed ids to the model fails at once instead of reading
wrong rows.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxmix.engine.processors import default_processor
from ctxmix.errors import BadInput

NOT_AN_ID = -1  # Trace.input_ids of a position that is not a token


def _tensor_sha256(t: torch.Tensor, header: str) -> str:
    """sha256 of `header`, then of t's float32 bytes."""
    h = hashlib.sha256(header.encode())
    h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the model reads it. pixel_values (1, C, H, W) from the model's image processor; grid (rows,
    columns) of patches of `patch` pixels; `prefix` positions before the patches (the class token, registers)."""

    pixel_values: torch.Tensor
    grid: tuple[int, int]
    patch: int
    prefix: int
    prefix_labels: tuple[str, ...]
    source_size: tuple[int, int] | None = None  # (height, width) of the image given, before the processor
    mean: tuple[float, ...] | None = None  # the processor's normalisation, per channel (None: none)
    std: tuple[float, ...] | None = None

    kind = "image"

    @property
    def n(self) -> int:
        return self.prefix + self.grid[0] * self.grid[1]

    def labels(self) -> list[str]:
        """One label per position: the prefix tokens', then "r{row}c{col}" for each patch, row by row."""
        rows, cols = self.grid
        return list(self.prefix_labels) + [f"r{r}c{c}" for r in range(rows) for c in range(cols)]

    def cell(self, position: int) -> tuple[int, int] | None:
        """The (row, column) of the patch at `position`, or None for a prefix token."""
        k = position - self.prefix
        if not 0 <= k < self.grid[0] * self.grid[1]:
            return None
        return divmod(k, self.grid[1])

    def rgb(self) -> np.ndarray:
        """The image as the model read it (resized, cropped), back in 0-255 RGB: (H, W, 3) uint8, for display."""
        px = self.pixel_values[0].detach().to("cpu", torch.float64)
        if self.mean is not None and self.std is not None:
            px = (
                px * torch.tensor(self.std, dtype=px.dtype)[:, None, None]
                + torch.tensor(self.mean, dtype=px.dtype)[:, None, None]
            )
        return (px.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()

    def forward_kwargs(self, device, dtype) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values.to(device=device, dtype=dtype)}

    def record(self) -> dict:
        """What an explanation records of the image (`Explanation.options["image"]`)."""
        pixels = list(self.pixel_values.shape[-2:])
        return {
            "grid": list(self.grid),
            "patch": self.patch,
            "prefix": self.prefix,
            "pixels": pixels,
            "sha256": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """sha256 of the pixel values and their shape: the input's identity in caches and saved results."""
        return _tensor_sha256(self.pixel_values, str(tuple(self.pixel_values.shape)))


def _pil(image) -> Any:
    """A path, a PIL image or an (H, W[, C]) array (uint8 0-255, or floats in [0, 1]) as an RGB PIL image."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise BadInput(f"no image file at {path}")
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except OSError as exc:
            raise BadInput(f"{path.name} is not an image this installation can read ({exc})") from None
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, bytes):  # an uploaded file's contents
        try:
            with Image.open(io.BytesIO(image)) as im:
                return im.convert("RGB")
        except OSError as exc:
            raise BadInput(f"the file is not an image this installation can read ({exc})") from None
    arr = np.asarray(image)
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4)):
        raise BadInput(f"an image array is (height, width) or (height, width, 1/3/4 channels), got {arr.shape}")
    if arr.dtype != np.uint8:
        if not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 1:
            raise BadInput("a float image array holds values in [0, 1]")
        arr = np.round(arr * 255).astype(np.uint8)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    return Image.fromarray(arr).convert("RGB")


def image_input(model, image) -> ImageInput:
    """`image` (a path, a PIL image, an array or a file's bytes) through the model's image processor, with its
    positions (an `ImageInput` is returned as it is)."""
    if model.spec.inputs != "pixels":
        reads = "audio" if model.spec.inputs == "audio" else "text"
        raise BadInput(f"{model.name} is a {model.spec.family} model: it reads {reads}, not images")
    if isinstance(image, ImageInput):
        return image
    processor = model.processor if model.processor is not None else default_processor(model.config)
    pil = _pil(image)
    px = processor(images=pil, return_tensors="pt")["pixel_values"]
    patch = int(model.config.patch_size)
    H, W = px.shape[-2:]
    if H % patch or W % patch:
        raise BadInput(f"the processed image is {H} x {W} pixels, not a whole number of {patch}-pixel patches")
    registers = int(getattr(model.config, "num_register_tokens", 0) or 0)
    prefix = ("[CLS]",) + tuple(f"[REG{k}]" for k in range(1, registers + 1))
    normalised = getattr(processor, "do_normalize", False)
    mean, std = (
        (getattr(processor, "image_mean", None), getattr(processor, "image_std", None)) if normalised else (None, None)
    )
    return ImageInput(
        px,
        (H // patch, W // patch),
        patch,
        len(prefix),
        prefix,
        source_size=(pil.height, pil.width),
        mean=None if mean is None else tuple(float(x) for x in mean),
        std=None if std is None else tuple(float(x) for x in std),
    )


SAMPLE_IMAGES = ("coffee", "astronaut", "chelsea")  # the photographs scikit-image's wheel bundles (no download)


def sample_image(name: str) -> np.ndarray:
    """One of scikit-image's bundled photographs, (H, W, 3) uint8."""
    if name not in SAMPLE_IMAGES:
        raise BadInput(f"no bundled photograph {name!r}; there are {', '.join(SAMPLE_IMAGES)}")
    from skimage import data

    return getattr(data, name)()


# spoken sentences bundled with ctxmix (16 kHz WAV, flite 2.2's CMU voices slt and rms: free to redistribute)
SAMPLE_CLIPS = {
    "stella": "Please call Stella and ask her to bring these things with her from the store.",
    "keys": "The keys to the cabinet are on the table.",
    "boat": "A small boat sailed slowly across the quiet lake.",
}


def sample_clip(name: str) -> Path:
    """The path of one of the bundled spoken sentences (`SAMPLE_CLIPS`: name -> what it says)."""
    if name not in SAMPLE_CLIPS:
        raise BadInput(f"no bundled clip {name!r}; there are {', '.join(SAMPLE_CLIPS)}")
    return Path(__file__).parent / "sample_clips" / f"{name}.wav"


@dataclass(frozen=True, eq=False)
class AudioInput:
    """One clip as a speech model reads it, and the frames the model's positions are: frame k reads samples
    [k * stride - offset, k * stride - offset + receptive) of the clip (at `sampling_rate`).

    wav2vec2 and HuBERT read the waveform (`input_values`, (1, samples)); their convolutions make one frame per
    stride. Whisper reads the log-mel spectrogram of a 30 s window (`input_features`, (1, mels, 3000)): 1,500
    positions 20 ms apart, centred frames (hence `offset`), and those from `valid` on hold the feature
    extractor's padding, not the clip."""

    input_values: torch.Tensor  # what the model reads, under the keyword `feature`
    sampling_rate: int
    stride: int  # samples between frames (the product of the convolutions' strides)
    receptive: int  # samples one frame reads
    frames: int
    samples: int = 0  # the clip's own samples (0: input_values' last dimension, the waveform itself)
    valid: int | None = None  # frames that hold the clip; the rest are padding (None: every frame)
    offset: int = 0  # samples a frame's receptive field starts before k * stride (centred frames)
    feature: str = "input_values"  # the model's keyword for `input_values` ("input_features": Whisper)

    kind = "audio"

    @property
    def n(self) -> int:
        return self.frames

    @property
    def clip_samples(self) -> int:
        return self.samples or int(self.input_values.shape[-1])

    @property
    def n_valid(self) -> int:
        """The frames that hold the clip (the others are padding)."""
        return self.frames if self.valid is None else self.valid

    def span(self, position: int) -> tuple[float, float]:
        """(start, end) in seconds of the samples frame `position` reads (clipped to the clip's start)."""
        start = position * self.stride - self.offset
        return max(start, 0) / self.sampling_rate, (start + self.receptive) / self.sampling_rate

    def labels(self) -> list[str]:
        """One label per frame: its time, k * stride, in seconds ("0.000s", "0.020s", ...); "pad" marks a frame
        of padding."""
        return [
            f"{k * self.stride / self.sampling_rate:.3f}s" + ("" if k < self.n_valid else " pad")
            for k in range(self.frames)
        ]

    def forward_kwargs(self, device, dtype) -> dict[str, torch.Tensor]:
        return {self.feature: self.input_values.to(device=device, dtype=dtype)}

    def record(self) -> dict:
        """What an explanation records of the clip (`Explanation.options["audio"]`)."""
        return {
            "sampling_rate": self.sampling_rate,
            "stride": self.stride,
            "receptive": self.receptive,
            "offset": self.offset,
            "samples": self.clip_samples,
            "frames": self.frames,
            "valid_frames": self.n_valid,
            "sha256": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """sha256 of the input values, their shape and rate, and the clip's length in samples (Whisper's features of
        a clip and of the same clip with trailing silence are equal: the padding differs)."""
        shape = tuple(self.input_values.shape)
        return _tensor_sha256(self.input_values, f"{shape} {self.sampling_rate} {self.clip_samples}")


def _waveform(audio, sampling_rate: int | None, target: int) -> np.ndarray:
    """A WAV file (its path or its bytes) or a 1-D array (at `sampling_rate`) as mono float64 samples at `target`
    Hz."""
    from math import gcd

    from scipy.signal import resample_poly

    if isinstance(audio, (str, Path, bytes)):
        from scipy.io import wavfile

        path = Path("the upload") if isinstance(audio, bytes) else Path(audio)
        if not isinstance(audio, bytes) and not path.is_file():
            raise BadInput(f"no audio file at {path}")
        try:
            sr, x = wavfile.read(io.BytesIO(audio) if isinstance(audio, bytes) else path)
        except ValueError as exc:
            raise BadInput(f"{path.name} is not a WAV file this installation can read ({exc})") from None
        if sampling_rate is not None and sampling_rate != sr:
            raise BadInput(f"{path.name} is sampled at {sr} Hz, not the {sampling_rate} Hz given")
        sampling_rate = sr
        x = x.astype(np.float64) / (np.iinfo(x.dtype).max + 1.0) if x.dtype.kind in "iu" else x.astype(np.float64)
    else:
        x = np.asarray(audio, dtype=np.float64)
        if sampling_rate is None:
            raise BadInput("an audio array needs its sampling_rate (samples per second)")
    if x.ndim == 2:  # (samples, channels): mono by the mean
        x = x.mean(axis=1)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise BadInput(f"audio is a non-empty 1-D array of finite samples (or samples x channels), got {x.shape}")
    if int(sampling_rate) <= 0:
        raise BadInput(f"sampling_rate must be positive, got {sampling_rate}")
    sr = int(sampling_rate)
    if sr != target:
        g = gcd(sr, target)
        x = resample_poly(x, target // g, sr // g)
    return x


def audio_input(model, audio, sampling_rate: int | None = None) -> AudioInput:
    """`audio` (a WAV path, or a 1-D array with its `sampling_rate`; resampled to the model's rate) through the
    model's feature extractor, with its frames (an `AudioInput` is returned as it is)."""
    if model.spec.inputs != "audio":
        raise BadInput(f"{model.name} is a {model.spec.family} model: it does not read audio")
    if isinstance(audio, AudioInput):
        return audio
    extractor = model.processor if model.processor is not None else default_processor(model.config)
    rate = int(extractor.sampling_rate)
    x = _waveform(audio, sampling_rate, rate)
    if model.spec.family == "Whisper":
        return _whisper_input(model, extractor, x)
    cfg = model.config
    stride, receptive = 1, 1
    for k, st in zip(cfg.conv_kernel, cfg.conv_stride):
        receptive += (k - 1) * stride
        stride *= st
    if x.size < receptive:
        raise BadInput(
            f"the clip has {x.size} samples; {model.name} reads at least {receptive} ({receptive / rate:.3f} s)"
        )
    values = extractor(x, sampling_rate=rate, return_tensors="pt")["input_values"]
    frames = (values.shape[-1] - receptive) // stride + 1
    return AudioInput(values, rate, stride, receptive, frames)


def _whisper_input(model, extractor, x: np.ndarray) -> AudioInput:
    """Whisper's log-mel features of one window (`n_samples`, 30 s): a longer clip is refused, never cut."""
    rate, hop, window = int(extractor.sampling_rate), int(extractor.hop_length), int(extractor.n_fft)
    if x.size > extractor.n_samples:
        raise BadInput(
            f"the clip lasts {x.size / rate:.1f} s; Whisper reads one window of {extractor.n_samples / rate:.0f} s: "
            "cut the clip (ctxmix explains one window and never trims silently)"
        )
    feats = extractor(x, sampling_rate=rate, return_tensors="pt")["input_features"]
    # two convolutions of kernel 3 (the second of stride 2) over centred STFT frames `hop` apart
    stride = 2 * hop
    frames = int(model.config.max_source_positions)
    return AudioInput(
        feats,
        rate,
        stride,
        receptive=4 * hop + window,
        frames=frames,
        samples=int(x.size),
        valid=min(frames, -(-x.size // stride)),
        offset=2 * hop + window // 2,
        feature="input_features",
    )


@torch.no_grad()
def trace_input(model, inp, notes: list[str] | None = None):
    """Run a model once on a non-id input (`ImageInput`, `AudioInput`) and rebuild every layer from its weights,
    as `trace_ids` does for text: a `Trace` whose positions are the input's (`labels()`), its `input_ids`
    NOT_AN_ID per position and its `inputs` the input."""
    from ctxmix.engine.attention import ctxmix_pass, every_row
    from ctxmix.engine.trace import Trace, _activations, _kept_logits, _rebuild

    run = model.hf.get_encoder() if model.spec.encoder_decoder else model.hf  # Whisper: the encoder's own pass
    with ctxmix_pass(rows=every_row()):
        out = run(**inp.forward_kwargs(model.device, model.dtype), output_hidden_states=True, output_attentions=True)
    if out.hidden_states[0].shape[1] != inp.n:
        raise BadInput(f"{model.name} read {out.hidden_states[0].shape[1]} positions, not the {inp.n} expected")
    hs = [_activations(model, h[0]) for h in out.hidden_states]
    states, err = _rebuild(model, hs, [_activations(model, a[0]) for a in out.attentions], None)
    logits, _ = _kept_logits(out, inp.n, None)
    return Trace(
        model=model,
        input_ids=[NOT_AN_ID] * inp.n,
        tokens=inp.labels(),
        hidden=hs[:-1] + [states[-1].y],
        states=states,
        logits=logits,
        reconstruction_error=float(err),
        notes=list(notes or []),
        inputs=inp,
    )


def trace_image(model, image, notes: list[str] | None = None):
    """`trace_input` of an image (a path, PIL image, array, bytes or `ImageInput`): the class token (and registers)
    and the patches."""
    return trace_input(model, image_input(model, image), notes)


def trace_audio(model, audio, sampling_rate: int | None = None, notes: list[str] | None = None):
    """`trace_input` of a clip (a WAV path, an array with its sampling_rate, or an `AudioInput`): its frames."""
    return trace_input(model, audio_input(model, audio, sampling_rate), notes)
