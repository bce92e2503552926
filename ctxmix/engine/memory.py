"""The memory account: the bytes each tensor of a call holds, by name and device, from the model's widths.

One set of part functions (`Widths` -> bytes) serves two readers: the code that sizes batches, chunks and
the choice to stream (`ctxmix.engine.budget.sequence_bytes`, the ablation batch, the gradient passes'
attention) and `ctxmix.estimate_memory`, which adds the parts a call holds at its peak so that a user learns
before loading a model whether the call fits, and a call that would not fit is refused before any forward pass.

Each part is a tensor of the code, counted from its shape (docs/performance.md, "Memory", lists them with their
formulas). n tokens, L layers, d the model width, d' the FF width, H query heads, V the vocabulary, e the
model's bytes per element (2 for bf16), w the engine's (4: half-precision layers are decomposed in float32).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

BYTES = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
DTYPE_NAMES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Widths:
    """What the account reads of a model: L layers, d, d' (d_ff), H query and Hkv key-value heads of width dh,
    the vocabulary V, e (bytes of the model's dtype), w (bytes of the engine's), the weights' bytes as stored
    and, for a model whose layers the engine copies one at a time (half precision, quantized, offloaded), the
    bytes of that copy."""

    L: int
    d: int
    d_ff: int
    H: int
    Hkv: int
    dh: int
    V: int
    gated: bool
    causal: bool
    e: int
    w: int
    weights: int
    layer_copy: int
    ends: int = 0  # bytes of the input embeddings and the output head (they stay on the engine's device)
    # the fast kernels cannot compute the family's attention (soft-capped logits): its outputs come from the
    # family's eager function run by blocks of rows (`ctxmix.engine.attention`)
    eager_blocks: bool = False
    window: int = 0  # a sliding window's length (0: none): SDPA's boolean n x n mask once n reaches it


def _dtype(value, default: torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value is None:
        return default
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        from ctxmix.errors import BadInput

        raise BadInput(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {value!r}")
    return DTYPE_NAMES[name]


def _copy_bytes(d: int, d_ff: int, H: int, Hkv: int, dh: int, gated: bool, w: int) -> int:
    """One layer's V, O and FF matrices in the engine's dtype (`ctxmix.engine.layers.LayerList`'s copy)."""
    return (d * Hkv * dh + H * dh * d + (3 if gated else 2) * d * d_ff) * w


_MODEL_WIDTHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Model -> its Widths, read once


def widths_of(model_or_config: Any, dtype=None) -> Widths:
    """The `Widths` of a loaded `Model` (as it is placed and typed; read once per model) or of a transformers
    config (`dtype`: how its weights would be held, default the config's; the parameters counted on `meta`,
    nothing allocated)."""
    from ctxmix.engine.arch import _config_heads, spec_for
    from ctxmix.engine.models import Model

    if isinstance(model_or_config, Model):
        hit = _MODEL_WIDTHS.get(model_or_config.hf)
        if hit is None or hit[0] is not model_or_config.dtype:
            hit = _MODEL_WIDTHS[model_or_config.hf] = (model_or_config.dtype, _model_widths(model_or_config))
        return hit[1]
    cfg = model_or_config
    spec = spec_for(cfg)
    text = cfg.get_text_config()
    dt = _dtype(dtype, _dtype(getattr(text, "dtype", None) or getattr(cfg, "dtype", None), torch.float32))
    e = BYTES[dt]
    w = 4 if e == 2 else e
    H, Hkv = _config_heads(cfg, spec)
    d = int(getattr(text, "hidden_size", None) or getattr(text, "n_embd", None) or text.d_model)
    d_ff = int(
        getattr(text, "intermediate_size", None)
        or getattr(text, "n_inner", None)
        or getattr(text, "ffn_dim", None)
        or 4 * d
    )
    dh = int(getattr(text, "head_dim", None) or d // H)
    L = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or text.num_layers)
    copy = 0 if e == w else _copy_bytes(d, d_ff, H, Hkv, dh, spec.gated, w)
    total, ends = parameter_count(cfg)
    V = int(text.vocab_size)
    return Widths(
        L, d, d_ff, H, Hkv, dh, V, spec.gated, spec.causal, e, w, total * e, copy, ends * e, *_attention_kind(text)
    )


def _attention_kind(cfg) -> tuple[bool, int]:
    """(eager_blocks, window) of a config: soft-capped attention logits; the sliding window's length, where any
    layer has one."""
    softcap = getattr(cfg, "attn_logit_softcapping", None) is not None
    window = getattr(cfg, "sliding_window", None)
    window = window if isinstance(window, int) and getattr(cfg, "use_sliding_window", True) is not False else 0
    return softcap, int(window or 0)


def _model_widths(m) -> Widths:
    from ctxmix.engine.models import Model

    assert isinstance(m, Model)
    wd = m.widths
    e, w = BYTES.get(m.dtype, 4), BYTES.get(m.work_dtype, 4)
    out = m.hf.get_output_embeddings()
    V = int(out.weight.shape[0]) if out is not None else wd["d"]
    weights = sum(p.numel() * p.element_size() for p in m.hf.parameters() if p.device.type != "meta")
    d, d_ff, H, Hkv, dh = wd["d"], wd["d_ff"], wd["heads"], wd["kv_heads"], wd["head_dim"]
    copy = 0 if m.layers.resident else _copy_bytes(d, d_ff, H, Hkv, dh, m.spec.gated, w)
    return Widths(
        m.n_layers,
        d,
        d_ff,
        H,
        Hkv,
        dh,
        V,
        m.spec.gated,
        m.spec.causal,
        e,
        w,
        weights,
        copy,
        0,
        *_attention_kind(m.hf.config.get_text_config()),
    )


def parameter_count(config) -> tuple[int, int]:
    """(all parameters, those of the input embeddings and the output head) of the model a config describes,
    counted on `meta` (no memory allocated); tied weights once."""
    import transformers as T

    from ctxmix.engine.models import _kind_and_class

    try:
        with torch.device("meta"):
            hf = T.AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM: the class ctxmix loads it with
        _, cls = _kind_and_class(config)
        with torch.device("meta"):
            hf = cls.from_config(config)
    seen: dict[int, int] = {}
    for p in hf.parameters():
        seen[id(p)] = p.numel()
    heads = (hf.get_input_embeddings(), hf.get_output_embeddings())
    ends = {id(m.weight): m.weight.numel() for m in heads if m is not None}
    return sum(seen.values()), sum(ends.values())


# ------------------------------------------------------------------ the parts (bytes)


def eager_attention_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """One layer's eager attention while it runs: the scores and their masked copy, then the float32 softmax
    beside its input and, for half precision, its cast back: 8 bytes x H x n^2 in float32 and in bf16 (2 + 4 +
    2), 2 x e + 4 otherwise."""
    per = 8 if W.e in (2, 4) else 2 * W.e + 4
    return batch * W.H * n * n * per


def attention_block_bytes(W: Widths, n: int, rows: int | None = None, batch: int = 1) -> int:
    """One block of query rows' scores while ctxmix's attention computes probabilities (or runs a family's eager
    function by blocks): a block holds at most `ATTENTION_CHUNK_BYTES` over its `_SCORE_COPIES` copies, about half
    of them alive at once (the scores and the softmax). rows: the rows asked for (every row: n)."""
    from ctxmix.engine.attention import _SCORE_COPIES, ATTENTION_CHUNK_BYTES

    rows = n if rows is None else min(rows, n)
    return min(ATTENTION_CHUNK_BYTES, _SCORE_COPIES * max(W.w, 4) * W.H * rows * n * batch) // 2


def eager_blocks_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """The blocks of a family whose outputs come from its eager function by blocks of rows (soft-capped logits:
    SDPA refuses them), 0 for the others (SDPA holds O(n) per head)."""
    return attention_block_bytes(W, n, batch=batch) if W.eager_blocks else 0


def window_mask_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """SDPA's boolean (B, 1, n, n) mask of a sliding-window family once n reaches the window (one byte a cell,
    shared by every layer and head); none below it, nor for a plain causal model (SDPA's `is_causal`)."""
    return batch * n * n if W.window and n >= W.window else 0


def layer_activation_bytes(W: Widths, n: int, batch: int = 1, attention: int = 0) -> int:
    """One layer's transient in a forward pass, in the model's dtype: the larger of its attention phase (the
    residual stream, its normed copy, q, k, v and the output: 6 vectors of width d per token, beside `attention`
    bytes of scores) and its MLP phase (4 vectors of width d and the hidden ones: gate, up and their product, 3 of
    width d'; 2 without a gate)."""
    mlp = batch * n * (4 * W.d + (3 if W.gated else 2) * W.d_ff) * W.e
    return max(mlp, batch * n * 6 * W.d * W.e + attention)


def hidden_states_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """The L + 1 hidden states a traced forward pass returns, in the model's dtype."""
    return batch * (W.L + 1) * n * W.d * W.e


def kept_attention_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """Every layer's attention probabilities, kept by a stored trace (in the model's dtype)."""
    return batch * W.L * W.H * n * n * W.e


def logits_bytes(W: Widths, rows: int, batch: int = 1, upcast: bool = True) -> int:
    """The logits of `rows` positions in the model's dtype, with a float32 copy for the log-softmax."""
    return batch * rows * W.V * (W.e + (4 if upcast else 0))


def layer_state_bytes(W: Widths, n: int) -> int:
    """One traced layer's states in the engine's dtype (`ctxmix.engine.layer.LayerState`): 8 vectors of width d
    and 2 of width d' per token, and the H x n x n probabilities."""
    return (n * (8 * W.d + 2 * W.d_ff) + W.H * n * n) * W.w


def trace_states_bytes(W: Widths, n: int) -> int:
    """Every layer's states of a stored trace (`layer_state_bytes` x L)."""
    return W.L * layer_state_bytes(W, n)


def maps_bytes(W: Widths, n: int, n_maps: int, elem: int = 8) -> int:
    """`n_maps` per-layer (L, n, n) maps of `elem` bytes per entry."""
    return n_maps * W.L * n * n * elem


def head_vectors_bytes(W: Widths, n: int, batch: int = 1) -> int:
    """One layer's head vectors f^h(x_j) (n, H, d) in the engine's dtype, kept while its rows are decomposed."""
    return batch * n * W.H * W.d * W.w


def backward_saved_bytes(W: Widths, n: int, eager: bool) -> int:
    """What autograd keeps of a forward pass for its backward (the gradient methods' pass), over every layer: per
    layer and token about 2 vectors of width d and 4 of width d' (2 without a gate) in the model's dtype (counted
    with torch's saved-tensor hooks on a float32 Llama, d 512, d' 2048: 9,026 elements per token and layer against
    2 d + 4 d' = 9,216), and with eager attention its probabilities: the float32 softmax output, and in another
    dtype the cast copy that the value product keeps."""
    acts = W.L * n * (2 * W.d + (4 if W.gated else 2) * W.d_ff) * W.e
    probs = W.L * W.H * n * n * (4 + (W.e if W.e != 4 else 0)) if eager else 0
    return acts + probs


def ablation_sequence_bytes(W: Widths, n: int, K: int) -> int:
    """One sequence of an output-only (SDPA) ablation pass that keeps K rows of logits: one layer's activations
    (`layer_activation_bytes`; the fused attention kernel holds O(n) per head) and the kept logits (K, V) in the
    model's dtype with two float32 copies for the log-softmax (the gathered rows, the scatter's copy), and a
    sliding window's boolean mask. A soft-capped family's eager blocks are shared by the batch
    (`ablation_batch_bytes`)."""
    return layer_activation_bytes(W, n, attention=n * 2 * W.H * W.e) + K * W.V * (W.e + 2 * 4) + window_mask_bytes(W, n)


def ablation_batch_bytes(W: Widths, n: int, K: int, batch: int) -> int:
    """A batch of `batch` ablated sequences: each one's `ablation_sequence_bytes`, and the blocks of the family's
    eager attention where SDPA cannot run it (one block of rows for the whole batch, `eager_blocks_bytes`)."""
    return batch * ablation_sequence_bytes(W, n, K) + eager_blocks_bytes(W, n, batch)
