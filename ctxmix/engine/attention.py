"""The one attention function ctxmix gives a model, set once at loading and configured per call.

(Over 500 lines: the per-call passes, the masks they build and the kernels they run are one mechanism, read
together.)

A model serves every session of a server at once (the dashboard's threads, a notebook's own `hf(...)`), so
ctxmix never changes its state for one call. Loading (`use_ctxmix_attention`) sets the model's attention
implementation, once, to `CTXMIX_ATTENTION`, a name registered with transformers' attention interface and its
mask interface. What a forward pass computes is then set by the call that runs it, in a context variable
(`PASS`) that only that thread or task sees (`ctxmix_pass`):

- no ctxmix call (the user's own `hf(...)`, another library's): the implementation the user's model had before
  (eager, SDPA, flash, flex), with its own mask, exactly as without ctxmix;
- *output only* (ablations, generation, `evaluate`, AT2's labels, gradient passes): the fast kernel only
  (`Pass.kernel` "fast": PyTorch's SDPA, or the kernel the user configured), no probabilities;
- *rows* (`Pass.rows`): the fast kernel for every output, plus the probabilities of the rows asked for,
  recomputed from the same post-RoPE queries and keys with the module's scaling, mask, soft-cap, sliding window
  and sinks: (B, H, T, n), never an n x n map per head (context attribution's one-pass methods);
- *full* (`Pass.rows` = every row): the same, for every row, one block of rows at a time (the traces that read
  every row: explain's maps, scope maps, routes). The probabilities are handed back as the module's attention
  weights, so transformers' `output_attentions` collects them as it does eager's.

The reference for exactness is the model's own forward, its fast kernel: the decompositions rebuild each layer
from the kept probabilities and are checked against the hidden states the model computed
(`reconstruction_error`). The probabilities are computed in the model's dtype where it is float64 and in
float32 otherwise (eager's Llama-like softmax runs in float32 even in a float64 model; ctxmix's does not).

Kernels the fast path cannot use: soft-capped logits (Gemma 2: SDPA refuses `softcap`), learned sinks (`s_aux`:
SDPA ignores them) and GPT-2's `reorder_and_upcast_attn` (its own float32 path) run the family's eager function
over blocks of query rows (`ATTENTION_CHUNK_BYTES` of scores at a time), never an n x n map. DeBERTa-v2 has no
attention interface: it runs its own eager attention whatever the name (the one documented exception; its
probabilities come back through `output_attentions`).

Hooks (the ablations' cut of the last hidden state, saliency's layer-0 input) are installed once per model and
read the same context, so they act on their own call's pass only (`Pass.head_rows`, `Pass.layer0_input`).

A user's flash kernel (flash_attention_2/3, a hub kernel) runs the output-only passes, called from this function
with its own mask builder; the passes that keep probabilities run SDPA. The config now names `ctxmix`, so code
transformers runs only when the name says flash (`is_flash_attention_requested`: packed sequences found from
position ids with no mask) is not taken; ctxmix always passes a mask or plain sequences.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

CTXMIX_ATTENTION = "ctxmix"  # the name registered with transformers' attention and mask interfaces
# Bytes of one block of query rows' scores: B x H x rows x keys elements, ~4 copies alive at once (the scores,
# scores + mask, the softmax, its cast back). 64 MiB keeps a block far below one H x n x n map (2 GiB at 4,096
# tokens and 32 heads) while a block is still a matrix product of tens of rows (32 rows at 32 heads and 4,096
# keys in float32).
ATTENTION_CHUNK_BYTES = 64 << 20
_SCORE_COPIES = 4


@dataclass
class Rows:
    """Probabilities a pass keeps: of `positions` (sorted distinct query positions; None: every row), one slot per
    layer (filled with (B, H, T, k), or (B, H, q, k) for every row), the layer of each attention module."""

    positions: list[int] | None
    slots: list = field(default_factory=list)
    layer_of: dict = field(default_factory=dict)

    @property
    def every_row(self) -> bool:
        return self.positions is None


@dataclass(frozen=True)
class Pass:
    """What the forward passes of one ctxmix call compute (see the module docstring).

    kernel: "fast" (SDPA, or the user's kernel) or "eager" (the family's eager function, which is faster than
    SDPA's backward on a CPU for short inputs). rows: the probabilities to keep (None: none). key_bias: a per-key
    additive bias (n,) on every layer's and head's scores (key masking). head_rows: (B, T) rows the LM head reads
    (the others are cut before it) and a list the hook appends to when it cut them. layer0_input: (B, n, d)
    hidden states layer 0 reads instead of the embeddings' output."""

    kernel: str = "fast"
    rows: Rows | None = None
    key_bias: torch.Tensor | None = None
    head_rows: tuple | None = None
    layer0_input: torch.Tensor | None = None
    # what was found of each mask tensor (the same mask serves every layer of a forward): read once per pass
    seen: dict = field(default_factory=dict, compare=False, repr=False)


# this thread's (or task's) pass while a ctxmix call runs the model; None otherwise
PASS: contextvars.ContextVar[Pass | None] = contextvars.ContextVar("ctxmix_pass", default=None)

# config -> the implementation the user's model had before ctxmix (configs are not hashable: by identity)
_USER: dict[int, tuple[weakref.ref, str]] = {}
_USER_LOCK = threading.Lock()


def user_attention(config) -> str:
    """The implementation the user's model had before ctxmix set its own ("eager" where unknown)."""
    got = _USER.get(id(config))
    if got is not None and got[0]() is config:
        return got[1]
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl if impl != CTXMIX_ATTENTION else "eager"


def current_pass() -> Pass | None:
    return PASS.get()


@contextmanager
def ctxmix_pass(**fields: Any) -> Iterator[Pass]:
    """Forward passes run inside the block (this thread or task only) compute what `fields` say (`Pass`'s
    fields); a pass already open in this context is extended (its hooks' fields kept unless given)."""
    outer = PASS.get()
    p = replace(outer, **fields) if outer is not None else Pass(**fields)
    token = PASS.set(p)
    try:
        yield p
    finally:
        PASS.reset(token)


@contextmanager
def within_pass(**fields: Any) -> Iterator[Pass]:
    """A pass with `fields` unless this context already runs one (then that one, unchanged): for the model calls
    of a function that an outer ctxmix call may run inside its own pass (a rows trace's forward)."""
    outer = PASS.get()
    if outer is not None:
        yield outer
        return
    with ctxmix_pass(**fields) as p:
        yield p


def every_row() -> Rows:
    """A request for every row's probabilities (a full trace), handed back as the modules' attention weights."""
    return Rows(None)


@contextmanager
def output_only(model=None) -> Iterator[str]:
    """A block of forward passes whose attention probabilities nobody reads: the fast kernel. Yields the kernel's
    name ("sdpa", or the user's fast implementation)."""
    with ctxmix_pass(kernel="fast", rows=None, key_bias=None):
        yield fast_name(model)


def fast_name(model) -> str:
    """The name of the kernel output-only passes of `model` run ("sdpa", or the user's fast implementation)."""
    if model is None:
        return "sdpa"
    hf = getattr(model, "hf", model)
    if getattr(hf, "config", None) is None:  # not a transformers model (a test's toy network)
        return "sdpa"
    if not uses_ctxmix_attention(hf):
        return user_attention(hf.config)
    user = user_attention(hf.config)
    return user if user not in ("eager", "sdpa") else "sdpa"


def current_attention(model) -> str:
    """The implementation name the model's config holds (`CTXMIX_ATTENTION` once ctxmix loaded it)."""
    hf = getattr(model, "hf", model)
    return getattr(hf.config, "_attn_implementation", None) or "eager"


def uses_ctxmix_attention(hf) -> bool:
    return getattr(hf.config, "_attn_implementation", None) == CTXMIX_ATTENTION


def accepts(hf, name: str) -> bool:
    """Whether the module's forward takes keyword `name` (e.g. `logits_to_keep`, `use_cache`)."""
    try:
        return name in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------- loading: set once


def _configs(hf) -> list:
    """Every config object of the model's modules (a model and its sub-models may hold different ones)."""
    seen: dict[int, Any] = {id(hf.config): hf.config}
    for mod in hf.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen[id(cfg)] = cfg
    return list(seen.values())


def use_ctxmix_attention(hf) -> str:
    """Once, at loading: remember the implementation the user's model has (per config) and set the model's
    attention to `CTXMIX_ATTENTION`. Returns the user's implementation. A class that cannot switch (DeBERTa-v2:
    no attention interface) keeps its own; nothing changes after this."""
    if uses_ctxmix_attention(hf):
        return user_attention(hf.config)
    with _USER_LOCK:
        for cfg in _configs(hf):
            impl = getattr(cfg, "_attn_implementation", None) or "eager"
            if impl != CTXMIX_ATTENTION:
                _USER[id(cfg)] = (weakref.ref(cfg), impl)
        for k in [k for k, (ref, _) in _USER.items() if ref() is None]:
            del _USER[k]
    user = user_attention(hf.config)
    can = getattr(hf, "_can_set_attn_implementation", None)
    if callable(can) and not can():
        return user
    if getattr(hf.config, "output_attentions", False):
        # transformers refuses output_attentions in the config for any implementation but eager
        hf.config.output_attentions = False
    hf.set_attn_implementation(CTXMIX_ATTENTION)
    return user


_HOOK_LOCK = threading.Lock()


def install_once(hf, flag: str, register) -> None:
    """register() once per model (`flag` marks it on the HF module, under a lock): for hooks that read this
    call's `Pass` and are inert for every other call."""
    if getattr(hf, flag, False):
        return
    with _HOOK_LOCK:
        if getattr(hf, flag, False):
            return
        register()
        setattr(hf, flag, True)


# ---------------------------------------------------------------- masks


def _mask_kind(p: Pass | None, user: str) -> str:
    """Which mask builder a forward pass uses: the user's outside a ctxmix call; eager's additive mask for eager
    passes; the user's for an output-only pass of another fast kernel (flash, flex); SDPA's (boolean, or None
    where plain causal) otherwise."""
    if p is None:
        return user
    if p.kernel == "eager":
        return "eager"
    if p.rows is None and p.key_bias is None and user not in ("eager", "sdpa"):
        return user
    return "sdpa"


def ctxmix_mask(*args, config=None, **kwargs):
    """transformers' mask interface: the mask of the builder `_mask_kind` names for this pass."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    kind = _mask_kind(PASS.get(), user_attention(config))
    try:
        fn = ALL_MASK_ATTENTION_FUNCTIONS[kind]
    except KeyError:  # an implementation with no mask builder (a custom kernel): transformers gives it no mask
        return None
    return fn(*args, config=config, **kwargs)


# ---------------------------------------------------------------- eager functions, blocks of rows

_EAGER_PARAMS = ("module", "query", "key", "value", "attention_mask")
_EAGER_CACHE: dict[type, object] = {}


def family_eager(module: torch.nn.Module):
    """The eager attention function of the module's own family (`eager_attention_forward` in its modeling file,
    with transformers' signature (module, query, key, value, attention_mask, **kwargs) -> (output, probabilities));
    GPT-2's `_upcast_and_reordered_attn` where its config asks for it; None when it has none."""
    if getattr(module, "reorder_and_upcast_attn", False) and hasattr(module, "_upcast_and_reordered_attn"):
        return lambda mod, q, k, v, mask, **kw: mod._upcast_and_reordered_attn(q, k, v, mask)
    cls = type(module)
    if cls not in _EAGER_CACHE:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        try:
            names = tuple(inspect.signature(fn).parameters)[: len(_EAGER_PARAMS)] if callable(fn) else ()
        except (TypeError, ValueError):
            names = ()
        _EAGER_CACHE[cls] = fn if names == _EAGER_PARAMS else None
    return _EAGER_CACHE[cls]


def query_block_rows(n_heads: int, n_keys: int, element_size: int, batch: int = 1) -> int:
    """Query rows per block so that the block's scores take about `ATTENTION_CHUNK_BYTES` (at least 1)."""
    per_row = _SCORE_COPIES * max(element_size, 4) * n_heads * n_keys * batch
    return max(1, ATTENTION_CHUNK_BYTES // per_row)


def _is_causal(module, kwargs: dict, q: int) -> bool:
    """SDPA's rule for a pass without a mask: causal where the module is (and more than one query row)."""
    c = kwargs.get("is_causal")
    c = getattr(module, "is_causal", True) if c is None else c
    return bool(c) and q > 1


def _later_keys_closed(
    mask: torch.Tensor | None, causal: bool, q: int, k: int, step: int, seen: dict | None = None
) -> bool:
    """Whether every key after a row's own position (k - q + row) is shut: a causal model's. Then a block of rows
    needs the keys up to its last row only. Checked by blocks (no n x n temporary), once per mask tensor and pass
    (`seen`: every layer gets the same mask, and each check waits for the device)."""
    if mask is None:
        return causal
    got = None if seen is None else seen.get((id(mask), step))
    if got is not None and got[0] is mask:
        return got[1]
    attends = (lambda m: m) if mask.dtype == torch.bool else (lambda m: m == 0)
    closed = not any(bool(attends(mask[..., a : a + step, k - q + a + step :]).any()) for a in range(0, q, step))
    if seen is not None:
        seen[(id(mask), step)] = (mask, closed)
    return closed


def _block_mask(mask: torch.Tensor | None, causal: bool, a: int, b: int, cut: int, q: int, k: int, device):
    """The boolean mask (.., b - a, cut) of rows a..b-1 over keys 0..cut-1 (True: attends), or None for none;
    an additive mask is kept additive."""
    if mask is not None:
        return mask[..., a:b, :cut]
    if not causal:
        return None
    i = torch.arange(a, b, device=device)[:, None]
    j = torch.arange(cut, device=device)[None, :]
    return j <= i  # SDPA's is_causal: upper-left aligned (q == k in every ctxmix pass)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as eager's additive one (0 where attended, the dtype's lowest value where not)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def probs_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype ctxmix computes kept probabilities in: float64 for a float64 model, else float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def block_probs(
    module, query, key, mask, kwargs: dict, a: int, b: int, cut: int, causal: bool, bias=None
) -> torch.Tensor:
    """softmax(q k^T scaling [+ position bias] [soft-capped] + mask [+ key bias] [, sinks]) of query rows a..b-1
    over keys 0..cut-1: (B, H, b - a, cut) in `probs_dtype`. query (B, H, q, dh), key (B, Hkv, k, dh); the scaling
    is the one the module passed (Whisper and OPT pre-scale their queries and pass 1.0), never `module.scaling`."""
    dt = probs_dtype(query)
    H, Hkv = query.shape[1], key.shape[1]
    kk = key[:, :, :cut].to(dt)
    if H != Hkv:
        kk = kk.repeat_interleave(H // Hkv, dim=1)
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.matmul(query[:, :, a:b].to(dt), kk.transpose(-1, -2)) * scaling
    bias = kwargs.get("position_bias")
    if isinstance(bias, torch.Tensor):
        s = s + bias[..., a:b, :cut].to(dt)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    m = _block_mask(mask, causal, a, b, cut, query.shape[2], key.shape[2], query.device)
    if m is not None:
        s = s + _additive(m, dt)
    if bias is not None:
        s = s + bias[:cut].to(dtype=dt, device=s.device)
    sinks = kwargs.get("s_aux")
    if isinstance(sinks, torch.Tensor):
        col = sinks.to(dt).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        z = torch.cat([s, col], -1)
        z = z - z.amax(-1, keepdim=True)
        return torch.softmax(z, -1)[..., :-1]
    return torch.softmax(s, -1)


def _blockwise_output(module, query, key, value, mask, kwargs: dict, causal: bool, bias=None, seen=None):
    """softmax(...) v by blocks of query rows (`ATTENTION_CHUNK_BYTES` of scores each), the probabilities those of
    `block_probs` (the module's scaling, soft-cap, sinks and mask; a per-key bias (k,) added), the keys cut at a
    causal block's last row: (output (B, q, H, dh) in the value's dtype, None); never an n x n map. For attention
    the fast kernels cannot compute; the outputs are then computed from the very probabilities ctxmix keeps."""
    B, H, q, _ = query.shape
    Hkv, k = key.shape[1], key.shape[-2]
    step = query_block_rows(H, k, torch.finfo(probs_dtype(query)).bits // 8, B)
    later = _later_keys_closed(mask, causal, q, k, step, seen)
    v = value if H == Hkv else value.repeat_interleave(H // Hkv, dim=1)
    outs = []
    # the last block first: with cut keys each block is smaller than the one before, so the allocator reuses the
    # first (largest) block's memory instead of growing with every larger one
    for a in reversed(range(0, q, step)):
        b = min(q, a + step)
        cut = k - q + b if later else k
        p = block_probs(module, query, key, mask, kwargs, a, b, cut, causal, bias)
        outs.append(torch.matmul(p.to(value.dtype), v[:, :, :cut]))
    return torch.cat(outs[::-1], dim=2).transpose(1, 2).contiguous(), None


def _needs_eager(module, kwargs: dict) -> bool:
    """Attention the fast kernels cannot compute: soft-capped logits, learned sinks, GPT-2's upcast path (its
    probabilities in float32 whatever the model's dtype): these run `_blockwise_output`."""
    return (
        kwargs.get("softcap") is not None
        or isinstance(kwargs.get("s_aux"), torch.Tensor)
        or bool(getattr(module, "reorder_and_upcast_attn", False))
    )


def _key_bias_eager(mask, bias: torch.Tensor, dtype, device):
    """An additive mask with the per-key bias (k,) added (or the bias alone where there is no mask)."""
    b = bias.to(dtype=dtype, device=device).view(1, 1, 1, -1)
    return b if mask is None else _additive(mask, dtype) + b


_COLUMN_ALIGN = 8  # SDPA's fused kernels want head dims in multiples of 8


def _sdpa_with_key_bias(module, query, key, value, mask, bias: torch.Tensor, kwargs: dict):
    """SDPA on q' = [q, 1, 0..], k' = [k, b / scale, 0..], v' = [v, 0..] (head dims padded to a multiple of 8):
    q' k'^T scale = q k^T scale + b, the per-key bias through any SDPA kernel, its gradient out of k's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dh = query.shape[-1]
    scale = kwargs.pop("scaling", None)
    scale = dh**-0.5 if scale is None else scale
    width = -(-(dh + 1) // _COLUMN_ALIGN) * _COLUMN_ALIGN
    pad = width - dh - 1

    def widen(x: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, column, x.new_zeros(*x.shape[:-1], pad)], -1)

    ones = query.new_ones(*query.shape[:-1], 1)
    kcol = (bias.to(key.dtype).to(key.device) / scale).view(1, 1, -1, 1).expand(*key.shape[:-1], 1)
    vcol = value.new_zeros(*value.shape[:-1], 1)
    out, _ = sdpa_attention_forward(
        module, widen(query, ones), widen(key, kcol), widen(value, vcol), mask, scaling=scale, **kwargs
    )
    return out[..., :dh], None


def _check_bias(bias: torch.Tensor, key: torch.Tensor) -> None:
    """Keys of another length than the gated sequence (a cache) are refused: the bias indexes positions 0..n-1."""
    if bias.shape[0] != key.shape[-2]:
        raise RuntimeError(f"key-mask gate over {bias.shape[0]} positions met {key.shape[-2]} keys")


def _outputs(module, query, key, value, mask, kwargs: dict, p: Pass, user: str):
    """The attention output (B, q, H, dh) of a ctxmix pass: the user's fast kernel for an output-only pass where
    it is not SDPA (flash, flex); the family's eager function where asked for (`Pass.kernel` "eager"); ctxmix's
    own probabilities times the values, by blocks of rows, where the fast kernels cannot compute it; SDPA
    otherwise; each with the pass's key bias."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    bias = p.key_bias
    if bias is not None:
        _check_bias(bias, key)
    if p.kernel == "fast" and p.rows is None and bias is None and user not in ("eager", "sdpa"):
        return ALL_ATTENTION_FUNCTIONS[user](module, query, key, value, mask, **kwargs)
    if p.kernel == "eager":  # the family's function, eager's own additive mask (never skipped): one call
        eager = family_eager(module)
        if eager is None:
            raise RuntimeError(f"{type(module).__name__} has no eager attention function ctxmix can run")
        if bias is not None:
            mask = _key_bias_eager(mask, bias, query.dtype, query.device)
        return eager(module, query, key, value, mask, **kwargs)[0], None
    if _needs_eager(module, kwargs):
        causal = _is_causal(module, kwargs, query.shape[2])
        return _blockwise_output(module, query, key, value, mask, kwargs, causal, bias, p.seen)
    if bias is not None:
        return _sdpa_with_key_bias(module, query, key, value, mask, bias, kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _keep_rows(module, query, key, mask, kwargs: dict, rows: Rows, seen: dict | None = None):
    """The probabilities this pass keeps, of the asked rows (or every row, by blocks): (B, H, T, k)."""
    B, H, q, _ = query.shape
    k = key.shape[-2]
    causal = _is_causal(module, kwargs, q)
    dt = probs_dtype(query)
    step = query_block_rows(H, k, torch.finfo(dt).bits // 8, B)
    later = _later_keys_closed(mask, causal, q, k, step, seen)
    if rows.every_row:
        out = torch.zeros(B, H, q, k, dtype=dt, device=query.device)
        for a in range(0, q, step):
            b = min(q, a + step)
            cut = k - q + b if later else k
            out[:, :, a:b, :cut] = block_probs(module, query, key, mask, kwargs, a, b, cut, causal)
        return out
    pos = rows.positions
    assert pos is not None
    if not pos or q != k or pos[-1] >= q:
        return None  # not this sequence's self-attention (a cross-attention, a cache): nothing asked of it
    out = torch.zeros(B, H, len(pos), k, dtype=dt, device=query.device)
    idx = torch.tensor(pos, device=query.device)
    # the asked rows in groups of `step`, each group a block of rows of its own (its keys up to its last row)
    for s in range(0, len(pos), step):
        sel = idx[s : s + step]
        last = pos[min(len(pos), s + step) - 1] + 1
        cut = k - q + last if later else k
        qq = query.index_select(2, sel)
        if mask is None:
            m = None
            if causal:
                m = torch.arange(cut, device=query.device)[None, :] <= sel[:, None]
        else:
            m = mask[..., :, :cut].index_select(-2, sel)
        out[:, :, s : s + len(sel), :cut] = block_probs(
            module, qq, key, m, {**kwargs, **_rows_bias(kwargs, sel)}, 0, len(sel), cut, False
        )
    return out


def _rows_bias(kwargs: dict, sel: torch.Tensor) -> dict:
    """A position bias (.., q, k) cut to the selected rows (or nothing to change)."""
    bias = kwargs.get("position_bias")
    if not isinstance(bias, torch.Tensor) or bias.shape[-2] == 1:
        return {}
    return {"position_bias": bias.index_select(-2, sel.to(bias.device))}


def ctxmix_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface under `CTXMIX_ATTENTION`: query (B, H, q, dh), key and value
    (B, Hkv, k, dh), the mask of `ctxmix_mask`'s builder. Outside a ctxmix call, the user's implementation; in
    one, what its `Pass` asks (module docstring). Returns (output (B, q, H, dh), probabilities or None)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = getattr(module, "config", None)
    user = user_attention(cfg) if cfg is not None else "eager"
    p = PASS.get()
    if p is None:  # not a ctxmix call: exactly what the user's model ran before ctxmix
        eager = family_eager(module) if user == "eager" else None
        if user == "eager":
            if eager is None:
                raise RuntimeError(f"{type(module).__name__} has no eager attention function")
            return eager(module, query, key, value, attention_mask, **kwargs)
        return ALL_ATTENTION_FUNCTIONS[user](module, query, key, value, attention_mask, **kwargs)
    kw = {k: v for k, v in kwargs.items() if k != "output_attentions"}
    out, _ = _outputs(module, query, key, value, attention_mask, kw, p, user)
    if p.rows is None:
        return out, None
    mask = attention_mask if p.kernel != "eager" else None if attention_mask is None else attention_mask == 0
    kept = _keep_rows(module, query, key, mask, kw, p.rows, p.seen)
    layer = p.rows.layer_of.get(module)
    if kept is not None and layer is not None and layer < len(p.rows.slots):
        p.rows.slots[layer] = kept
    return out, kept if p.rows.every_row else None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CTXMIX_ATTENTION, ctxmix_attention)
    AttentionMaskInterface.register(CTXMIX_ATTENTION, ctxmix_mask)


_register()
