"""Loading models safely (safetensors only, no remote code) into a `Model`: a name, folder or Hugging Face id
to the wrapped model, with the checks that refuse weights that would give silently wrong numbers.
Where a model lives is `placement`, its fingerprints `fingerprint`, the embedded ones' builds `embedded`,
its layer list `layers`, its token ids by role `tokens`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ctxmix.engine.arch import ArchSpec, WeightReader, _config_heads, _get, final_norm, read_layer, spec_for
from ctxmix.engine.embedded import BUILT_ONCE, EMBEDDED, minilm_path
from ctxmix.engine.fingerprint import verify_weights, weights_sha256
from ctxmix.engine.layers import LayerList
from ctxmix.engine.load_checks import check_loaded
from ctxmix.engine.placement import (
    engine_device,
    load_placement,
    model_dtype,
    quantization_identity,
    resolve_device,
    torch_dtype,
)
from ctxmix.engine.processors import processor_from
from ctxmix.engine.tokens import Encoded, non_word_ids
from ctxmix.errors import BadInput, ModelLoadError, UnsupportedArchitecture, checked_arguments


def cache_dir() -> Path:
    """Where built models and cached results live: $CTXMIX_CACHE, else ~/.cache/ctxmix."""
    p = Path(os.environ.get("CTXMIX_CACHE") or Path.home() / ".cache" / "ctxmix")
    p.mkdir(parents=True, exist_ok=True)
    return p


@dataclass
class Model:
    """A loaded model and what ctxmix knows about it.

    `kind` is "classifier", "masked_lm", "causal_lm", "encoder" (no head) or "seq2seq" (an
    encoder-decoder; `ctxmix.engine.seq2seq` explains its decoder, the other methods its encoder).
    `info` carries provenance, e.g. the held-out accuracy of minilm-sentiment.
    One Model may serve several threads at once: ctxmix set its attention once when it was loaded, and what a
    forward pass computes is set per call in a context variable that only the calling thread or task sees
    (`ctxmix.engine.attention`); its hooks read the same context and are inert for every other call.
    """

    hf: Any  # a transformers PreTrainedModel
    tokenizer: Any
    name: str
    device: torch.device
    spec: ArchSpec
    kind: str
    dtype: torch.dtype = torch.float32
    info: dict = field(default_factory=dict)
    precision: str = "float32"  # the engine's default precision for this model (ctxmix.engine.precision)
    # the kernel of passes that read no probabilities (`ctxmix.engine.attention.output_only`): the user's fast
    # implementation (flash, flex), "sdpa" where the user's model ran eager or SDPA
    output_attention: str = "sdpa"
    processor: Any = None  # an image model's image processor (None: the family's default, built from the config)
    _weights_sha256: str | None = field(default=None, repr=False, compare=False)  # weights_sha256, once
    _decoder_weights: list | None = field(default=None, repr=False, compare=False)  # an encoder-decoder's, once

    @property
    def config(self):
        return self.hf.config

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the decompositions run in: the model's, but float32 for half-precision
        models (their activations and weights are upcast, so maps differ from the float32
        model's only by what the rounded weights and the model's own half-precision forward change)."""
        return torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype

    @cached_property
    def layers(self) -> LayerList:
        """Every layer's weights as the engine reads them (`LayerList`): views of a plain model's tensors,
        or one layer at a time, copied where the model keeps them otherwise (offloaded, quantized, half)."""
        return LayerList(self)

    def weights_changed(self) -> None:
        """After weights were edited through `.data` (bypassing torch's version counters, by which ctxmix notices
        in-place edits under torch.no_grad()): the products of weights the engine keeps are made again."""
        self.layers.forget_kept_products()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def n_heads(self) -> int:
        """Query heads per layer (from the config: no weights read)."""
        return _config_heads(self.hf.config, self.spec)[0]

    @cached_property
    def widths(self) -> dict[str, int]:
        """{"d", "d_ff", "heads", "kv_heads", "head_dim"} of the layers, read from layer 0 once, apart from the
        layer the engine holds (`LayerList` keeps one; reading layer 0 through it mid-pass would free that one)."""
        lw = (
            self.layers[0]
            if self.layers.resident
            else read_layer(self.hf.base_model, self.hf.config, self.spec, 0, WeightReader())
        )
        return {
            "d": int(lw.Wo.shape[1]),
            "d_ff": int(lw.W2.shape[0]),
            "heads": lw.n_heads,
            "kv_heads": lw.n_kv_heads,
            "head_dim": lw.head_dim,
        }

    @cached_property
    def final_norm(self):
        """The norm after the last layer (pre-LN, sandwich and parallel models), or None: what
        `layers[-1].next_norm` is, read alone (a few vectors, not the last layer's weights)."""
        return final_norm(self.hf.base_model, self.spec, self.layers.reader)

    @cached_property
    def quantization_schemes(self) -> dict[str, int]:
        """{scheme: number of layers} of the model's quantized layers (`ctxmix.engine.weights`); empty for a
        float model. Raises UnsupportedArchitecture, naming the class, for a quantized layer ctxmix cannot read."""
        from ctxmix.engine.weights import is_quantized_tensor, quantization_scheme

        spec = self.spec
        read = [p for p in (spec.value, spec.out_proj, spec.ff_in, spec.ff_gate, spec.ff_up, spec.ff_out) if p]
        engine_linears = {id(_get(layer, p)) for layer in self.layers.modules for p in read}
        out: dict[str, int] = {}
        for mod in self.hf.modules():
            w = getattr(mod, "weight", None)
            if id(mod) in engine_linears or (isinstance(w, torch.Tensor) and is_quantized_tensor(w)):
                scheme = quantization_scheme(mod)  # what the engine reads must be readable: refused by name
                if scheme:
                    out[scheme] = out.get(scheme, 0) + 1
        return out

    def quantization_notes(self, error: float) -> list[str]:
        """The warning an explanation carries when the model's kernels also round their inputs (LLM.int8):
        the decomposition, built from the dequantized weights, is then exact only up to that rounding, which
        the reconstruction error measures."""
        from ctxmix.engine.weights import ACTIVATION_QUANTIZING

        acts = [ACTIVATION_QUANTIZING[s] for s in self.quantization_schemes if s in ACTIVATION_QUANTIZING]
        if not acts:
            return []
        return [
            f"{self.name} runs {', '.join(acts)}: the decompositions use its dequantized weights, so they are "
            f"exact only up to the kernels' rounding of their inputs; measured reconstruction error {error:.3g} "
            "(largest |difference| from the model's own hidden states). Weight-only schemes (4bit, int8) are exact."
        ]

    @property
    def max_length(self) -> int:
        c = self.hf.config
        m = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 512
        if self.spec.family in ("RoBERTa",):
            m -= 2  # RoBERTa's positions start at padding_idx + 1
        tm = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tm, int) and 0 < tm < 10**6:
            m = min(m, tm)
        return int(m)

    def encode(self, text: str) -> tuple[list[int], list[str]]:
        """Token ids with the model's special tokens; truncated to `max_length` with a warning.
        Returns (ids, warnings)."""
        self.encode_check(text)
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        notes = []
        special = set(self.tokenizer.all_special_ids) - {self.tokenizer.unk_token_id}
        content = [i for i in ids if i not in special]
        if not content or all(i == self.tokenizer.unk_token_id for i in content):
            notes.append(
                "the text has no token this model knows: it became "
                + (
                    f"{len(content)} unknown token(s) ({self.tokenizer.unk_token})"
                    if content
                    else "nothing but the special tokens"
                )
                + "; the maps say little"
            )
            warnings.warn(notes[-1], stacklevel=3)
        if len(ids) > self.max_length:
            notes.append(f"the text has {len(ids)} tokens; truncated to the model's maximum of {self.max_length}")
            warnings.warn(notes[-1], stacklevel=3)
            ids = self.tokenizer(text, add_special_tokens=True, truncation=True, max_length=self.max_length)[
                "input_ids"
            ]
        return list(ids), notes

    def tokens(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None and self.spec.encoder_decoder:  # a random Whisper's decoder: ids as they are
            return [f"<{i}>" for i in ids]
        if self.tokenizer is None:
            raise BadInput(f"{self.name} has no tokenizer: it reads {self.spec.inputs}, not token ids")
        return list(self.tokenizer.convert_ids_to_tokens(ids))

    @property
    def uses_token_types(self) -> bool:
        """Whether the model reads token_type_ids (BERT-style segment embeddings of 2+ types).
        GPT-2 also accepts them but adds word embeddings of them, so the tokenizer decides."""
        return (
            "token_type_ids" in (getattr(self.tokenizer, "model_input_names", None) or ())
            and int(getattr(self.config, "type_vocab_size", 0) or 0) > 1
        )

    def type_ids_kwargs(self, rows, width: int | None = None, batch: int | None = None) -> dict:
        """{"token_type_ids": (B, width) long tensor on the device} for a forward pass, right-padded
        with 0; {} when the model reads none or no row has any (then the model's default of zeros
        applies). rows: one list (or None) per sequence; `batch` repeats a single row."""
        if not self.uses_token_types or rows is None or all(r is None for r in rows):
            return {}
        width = width or max(len(r) for r in rows if r is not None)
        t = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            if r is not None:
                t[b, : len(r)] = torch.tensor(list(r)[:width], dtype=torch.long)
        if batch is not None and len(rows) == 1:
            t = t.expand(batch, -1)
        return {"token_type_ids": t.to(self.device)}

    def count_tokens(self, text: str) -> int:
        """Tokens of a text with the model's special tokens, uncapped (for estimates before a call)."""
        return len(self.tokenizer(text or "", add_special_tokens=True)["input_ids"])

    def encode_input(self, text) -> Encoded:
        """One text or a sentence pair (text_a, text_b), tokenised as the model's tokenizer pairs
        them (truncated longest-first to `max_length`, with a note). Returns the ids, the
        token_type_ids the model reads (None for one text or a model without them) and the
        segments: 0 / 1 for the tokens of text A / B, -1 for special tokens."""
        if isinstance(text, str):
            ids, notes = self.encode(text)
            special = non_word_ids(self.tokenizer)
            return Encoded(ids, None, [-1 if i in special else 0 for i in ids], notes)
        if not isinstance(text, (tuple, list)) or len(text) != 2:
            raise BadInput(
                f"give one text (a string) or a sentence pair (text_a, text_b), got {type(text).__name__}"
                + (f" of {len(text)}" if isinstance(text, (tuple, list)) else "")
            )
        a, b = text
        for name, t in (("first", a), ("second", b)):
            if not isinstance(t, str) or not t.strip():
                raise BadInput(f"the {name} text of the pair must be a non-empty string")
            self.encode_check(t)
        enc = self.tokenizer(a, b, add_special_tokens=True)
        notes = []
        if len(enc["input_ids"]) > self.max_length:
            notes.append(
                f"the pair has {len(enc['input_ids'])} tokens; truncated (longest text first) to the "
                f"model's maximum of {self.max_length}"
            )
            warnings.warn(notes[-1], stacklevel=3)
            enc = self.tokenizer(a, b, add_special_tokens=True, truncation="longest_first", max_length=self.max_length)
        ids = list(enc["input_ids"])
        try:
            seq = enc.sequence_ids()
        except (ValueError, AttributeError):  # a tokenizer without the Rust backend's alignment
            raise BadInput(
                f"{self.name}'s tokenizer cannot say which token belongs to which text "
                "(no fast tokenizer); sentence pairs need one"
            ) from None
        segments = [-1 if s is None else int(s) for s in seq]
        types = list(enc["token_type_ids"]) if self.uses_token_types and "token_type_ids" in enc else None
        return Encoded(ids, types, segments, notes)

    def encode_check(self, text: str) -> None:
        """The checks `encode` makes on a text (a string, not blank, valid Unicode)."""
        if not isinstance(text, str):
            raise BadInput(f"the text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise BadInput("the text is empty: give at least one word")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadInput(
                f"the text holds a character that is not valid Unicode (a lone surrogate) at position {e.start}"
            ) from None


@checked_arguments
def load_model(
    name_or_path: str,
    device: str = "auto",
    dtype: str | torch.dtype = "float32",
    precision: str = "float32",
    *,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    quantization: Any = None,
) -> Model:
    """Load a model for analysis: "minilm", "minilm-sentiment", "smollm2", "gemma3", a local folder
    or a Hugging Face id. Eager attention (so attention weights exist), eval mode, float32
    unless `dtype` says otherwise ("bfloat16" / "float16" for large models: the engine decomposes one layer
    at a time in float32; "float64" for exactness tests). `precision` ("float32", "tf32", "bf16") is the
    engine's default for this model's large products (ctxmix.engine.precision).

    Where the model lives (accelerate and transformers do the placing; ctxmix reads each layer where it is):
    `device_map` ("auto" spreads it over the GPUs, then the CPU, then disk; or a dict of module name ->
    device / "cpu" / "disk"), `max_memory` (per device, e.g. {0: "20GiB", "cpu": "60GiB"}), `offload_folder`
    (for the layers mapped to "disk"); `quantization` ("4bit", "8bit", "int8" or a transformers quantization
    config: `BitsAndBytesConfig`, `TorchAoConfig`, ...). With any of these the model is not moved to
    `device`: the engine computes on the device its inputs go to (`Model.device`)."""
    from ctxmix.engine.precision import check_precision

    check_precision(precision)
    placement = load_placement(device_map, max_memory, offload_folder, quantization, dtype, device)
    model = _load_model(name_or_path, device, dtype, placement)
    model.precision = precision
    if quantization is not None:
        model.info = {**model.info, "quantization": quantization_identity(quantization)}
    return model


def _load_model(name_or_path: str, device: str, dtype: str | torch.dtype, placement: dict | None = None) -> Model:
    dev, dtype = resolve_device(device), torch_dtype(dtype)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise BadInput("give a model name: one of " + ", ".join(EMBEDDED) + ", a Hugging Face id or a local folder")
    name = name_or_path.strip()
    if name == "minilm":
        return _from_folder_or_hub(
            minilm_path(), name, dev, dtype, info={"source": EMBEDDED[name]}, placement=placement
        )
    if name in BUILT_ONCE:
        return _cached_build(cache_dir() / name, BUILT_ONCE[name], name, dev, dtype, placement)
    if name.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ModelLoadError(f"no such folder: {name!r}")
    name = os.path.expanduser(name)
    return _from_folder_or_hub(name, name, dev, dtype, placement=placement)


# joint image-text models whose image tower ctxmix explains: {model type: (the joint class, the tower's class)}. A
# CLIPModel's tower is its `vision_model` (a CLIPVisionModel: keys vision_model.*); a folder or hub id of one loads
# the tower alone. Another class of that type (CLIPForImageClassification: a head on the pooled patches) is refused
JOINT_VISION_TOWERS = {"clip": ("CLIPModel", "CLIPVisionModel")}


def _joint_tower(model_type, cls_names: list[str]) -> str | None:
    """The tower class to explain for a joint model of `model_type` built as one of `cls_names` (None: not one)."""
    joint = JOINT_VISION_TOWERS.get(model_type)
    if joint is None:
        return None
    other = [c for c in cls_names if c != joint[0]]
    if other:
        raise UnsupportedArchitecture(
            f"{', '.join(other)} is not supported: ctxmix explains a {joint[0]}'s image tower ({joint[1]}); a head "
            "on a joint model's tower is not described"
        )
    return joint[1]


def model_from_hf(
    hf: Any, tokenizer=None, name: str = "custom", precision: str = "float32", processor: Any = None
) -> Model:
    """Wrap an already built transformers model (tests use tiny random ones). tokenizer: a text model's;
    processor: an image model's image processor (None: the family's default from the config, see
    `ctxmix.engine.processors.default_processor`)."""
    if _joint_tower(getattr(hf.config, "model_type", None), [type(hf).__name__]):  # CLIPModel: its `vision_model`
        hf = hf.vision_model
    if tokenizer is None and spec_for(hf.config).inputs == "ids":
        raise BadInput("a text model needs its tokenizer: model_from_hf(hf, tokenizer)")
    spec = spec_for(hf.config)
    cls = type(hf).__name__
    kind = (
        "seq2seq"
        if spec.encoder_decoder
        else "classifier"
        if "SequenceClassification" in cls or "ImageClassification" in cls
        else "masked_lm"
        if "MaskedLM" in cls
        else "causal_lm"
        if ("CausalLM" in cls or "LMHead" in cls)
        else "encoder"
    )
    from ctxmix.engine.attention import fast_name, use_ctxmix_attention

    use_ctxmix_attention(hf)  # once: ctxmix's attention, configured per call from now on (never switched again)
    hf.eval().requires_grad_(False)
    from ctxmix.engine.precision import check_precision

    model = Model(
        hf=hf,
        tokenizer=tokenizer,
        name=name,
        device=engine_device(hf),
        spec=spec,
        kind=kind,
        dtype=model_dtype(hf),
        precision=check_precision(precision),
        output_attention=fast_name(hf),
        processor=processor,
    )
    model.quantization_schemes  # noqa: B018 - refuses a quantized layer it cannot read, now rather than mid-way
    return model


def _kind_and_class(config):
    import transformers as T

    archs = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        speech = getattr(config, "num_mel_bins", None) is not None  # Whisper
        return "seq2seq", T.AutoModelForSpeechSeq2Seq if speech else T.AutoModelForSeq2SeqLM
    if "ForSequenceClassification" in archs:
        return "classifier", T.AutoModelForSequenceClassification
    if "ForImageClassification" in archs:
        return "classifier", T.AutoModelForImageClassification
    if "ForMaskedLM" in archs or "ForPreTraining" in archs:
        return "masked_lm", T.AutoModelForMaskedLM
    if "ForCausalLM" in archs or "LMHeadModel" in archs:
        return "causal_lm", T.AutoModelForCausalLM
    return "encoder", T.AutoModel


def _from_folder_or_hub(
    src: str,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    info: dict | None = None,
    placement: dict | None = None,
) -> Model:
    import transformers as T

    placement = placement or {}
    try:
        config = T.AutoConfig.from_pretrained(src, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - turned into one clear message
        where = "a local folder" if os.path.isdir(src) else "a Hugging Face id"
        raise ModelLoadError(
            f"could not load {name!r} as {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
            f"(no network, a typo, or a private model?). Embedded models that work offline: {', '.join(EMBEDDED)}"
        ) from None
    tower = _joint_tower(getattr(config, "model_type", None), list(getattr(config, "architectures", None) or []))
    if tower is not None:  # the image tower of a joint model: its text tower is neither read nor loaded
        config = config.vision_config
    spec = spec_for(config)
    kind, cls = ("encoder", getattr(T, tower)) if tower else _kind_and_class(config)
    try:
        hf, loading = cls.from_pretrained(
            src,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=dtype,
            output_loading_info=True,
            **placement,
        )
        tok = T.AutoTokenizer.from_pretrained(src) if spec.inputs == "ids" or spec.encoder_decoder else None
        processor = None if spec.inputs == "ids" else processor_from(src, config)
    except Exception as e:  # noqa: BLE001
        if "ignore_mismatched_sizes" in str(e):
            raise ModelLoadError(
                f"{name!r} cannot be used as it is: tensors of the wrong shape for its config "
                "(a checkpoint of another size, or an edited file)"
            ) from None
        raise ModelLoadError(
            f"could not load the weights of {name!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "ctxmix reads safetensors weights only (never pickle files, never remote code)."
        ) from None
    if tower is not None:  # the joint model's text tower and projections are not the tower's: no warning for them
        joint_parts = ("text_model.", "text_projection", "visual_projection", "logit_scale")
        unexpected = [k for k in loading.get("unexpected_keys") or () if not k.startswith(joint_parts)]
        loading = {**loading, "unexpected_keys": unexpected}
    check_loaded(name, hf, loading, tok)
    hf.eval().requires_grad_(False)  # gradients are taken w.r.t. inputs only
    if not placement:  # a dispatched or quantized model stays where transformers put it
        hf.to(device)
    else:
        device = engine_device(hf)
    from ctxmix.engine.attention import fast_name, use_ctxmix_attention

    use_ctxmix_attention(hf)  # once: ctxmix's attention, configured per call from now on (never switched again)
    model = Model(
        hf=hf,
        tokenizer=tok,
        name=name,
        device=device,
        spec=spec,
        kind=kind,
        dtype=dtype,
        info=info or {},
        output_attention=fast_name(hf),
        processor=processor,
    )
    model.quantization_schemes  # noqa: B018 - refuses a quantized layer it cannot read, now rather than mid-way
    weights_sha256(model)  # now, while the files are the ones just read
    return model


def _cached_build(folder: Path, build, name: str, device, dtype, placement: dict | None = None) -> Model:
    """Load a model built once into the cache; rebuild when missing, corrupt or altered."""
    for attempt in range(2):
        if not (folder / "ctxmix_meta.json").exists():
            build(folder)
        try:
            meta = json.loads((folder / "ctxmix_meta.json").read_text())
            verify_weights(folder, meta)
        except Exception as e:  # noqa: BLE001 - a corrupt cache is rebuilt, once
            if attempt:
                raise
            warnings.warn(f"the cached {name!r} model at {folder} could not be read ({e}); rebuilding it", stacklevel=3)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if placement:  # the files are the recorded ones: a failure is the placement's, never a reason to rebuild
            return _from_folder_or_hub(str(folder), name, device, dtype, info=meta, placement=placement)
        try:
            return _from_folder_or_hub(str(folder), name, device, dtype, info=meta)
        except Exception as e:  # noqa: BLE001 - a cache that verifies but does not load is rebuilt, once
            if attempt:
                raise
            warnings.warn(f"the cached {name!r} model at {folder} could not be read ({e}); rebuilding it", stacklevel=3)
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")
