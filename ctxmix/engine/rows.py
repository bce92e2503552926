"""A trace of some rows only (`trace_rows`): one forward pass of a causal LM whose attention hands over the
probabilities of the rows asked for, without ever forming an n x n map per head, then each layer rebuilt at
those rows from the model's hidden states (context attribution's `logit`, `attention` and `at2_exact`).

Those methods read, at layer l, the attention rows alpha^l[:, q_t, :] of the T explained rows, the values
of every position, and the attention and FF outputs at q_t only. A full trace rebuilds every layer at all n
rows (or replays each attention module when streamed): L n x n maps per head and the FF at n rows. Here the
forward pass runs `rows_attention`, an attention implementation registered with transformers
(`ROWS_ATTENTION`): each attention module's own family eager function (its scaling, soft-cap, sinks, GQA
repeat, the eager mask with its sliding window) called over blocks of query rows, the keys cut at the
block's last row (a causal model's later keys have probability exactly 0). The outputs are the eager
outputs (the same per-row operations), the probabilities of the T rows are kept (H, T, n) and the rest of
each block is dropped with it. An attention module that does not run through the interface hands back its
full probabilities and a forward hook keeps their rows (the previous path, for such families).

The layers are rebuilt on demand (`RowStates`, as a streamed trace's): layer l from its input, the model's
own hidden state in the model's dtype, converted to the work dtype when the layer is built, and only the
last built layer is held. Memory: O(chunk + L n d in the model's dtype + L H T n) beside the model, with
chunk = `ATTENTION_CHUNK_BYTES` (the block's scores) plus eager's (1, 1, n, n) additive mask, one for each
mask kind (full, sliding) shared by every layer and head. Cost: one forward pass plus, per layer read, the
head values of all positions and the FF at T rows.

`RowsTrace.states[l]` is a `LayerState` whose `x` and `x1` hold all n positions (the values are computed
from them) while `alpha` is (H, T, n) and every other field (T, ...): the rows in order. Consumers index a
state with `local(Q)` (positions 0..T-1 of the rows) and hidden states and logits with positions. Each
layer's output at the rows is checked against the model's own hidden state (`reconstruction_error`), as a
full trace's is.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import partial

import torch

from ctxmix.engine.attention import attention_implementation
from ctxmix.engine.layer import LayerState, head_values, state_from_attention
from ctxmix.engine.models import Model
from ctxmix.engine.streaming import ReplayedStates, attention_modules, hook_attention_once
from ctxmix.engine.trace import _activations, _forward, _kept_logits

ROWS_ATTENTION = "ctxmix_rows"  # the name `rows_attention` is registered under (attention and mask interfaces)
# Bytes of one block of query rows' scores: H x rows x keys elements, ~4 copies alive at once inside an eager
# function (the scores, scores + mask, the float32 softmax, its cast back). 64 MiB keeps the block far below
# one H x n x n map (2 GiB at 4,096 tokens and 32 heads) while a block is still a matrix product of tens of
# rows on an 8B model at 4k tokens (42 rows at 32 heads).
ATTENTION_CHUNK_BYTES = 64 << 20
_SCORE_COPIES = 4


@dataclass
class _Request:
    """What this thread's `trace_rows` asks of the attention: the rows (T,) (a tensor and the same positions
    as a sorted list), one slot per layer for their probabilities (H, T, n), each attention module's layer,
    and which masks are causal (by id; the same mask tensors serve every layer)."""

    rows: torch.Tensor
    positions: list[int]
    slots: list
    layer_of: dict = field(default_factory=dict)
    causal: dict = field(default_factory=dict)


# this thread's request while its `trace_rows` runs; None otherwise
ROWS: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("ctxmix_rows", default=None)


class NoAttentionRows(RuntimeError):
    """An attention module that returned no probabilities (a full trace is needed then)."""


class _NoFamilyEager(RuntimeError):
    """An attention module whose family has no eager function `rows_attention` can call blockwise."""


_EAGER_PARAMS = ("module", "query", "key", "value", "attention_mask")
_EAGER_CACHE: dict[type, object] = {}


def family_eager(module: torch.nn.Module):
    """The eager attention function of the module's own family (`eager_attention_forward` in its modeling
    file, with transformers' signature (module, query, key, value, attention_mask, **kwargs) -> (output,
    probabilities)), or None when it has none or that is not the eager path (GPT-2's reordered upcast)."""
    cls = type(module)
    if cls not in _EAGER_CACHE:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        try:
            names = tuple(inspect.signature(fn).parameters)[: len(_EAGER_PARAMS)] if callable(fn) else ()
        except (TypeError, ValueError):
            names = ()
        _EAGER_CACHE[cls] = fn if names == _EAGER_PARAMS else None
    if getattr(module, "reorder_and_upcast_attn", False):  # GPT-2's eager runs another function then
        return None
    return _EAGER_CACHE[cls]


def query_block_rows(n_heads: int, n_keys: int, element_size: int) -> int:
    """Query rows per block so that the block's scores take about `ATTENTION_CHUNK_BYTES` (at least 1)."""
    per_row = _SCORE_COPIES * max(element_size, 4) * n_heads * n_keys
    return max(1, ATTENTION_CHUNK_BYTES // per_row)


def _masks_later_keys(req: _Request, mask: torch.Tensor, step: int) -> bool:
    """Whether the mask (B, 1, q, k), additive or boolean, shuts every key after a row's own position (a causal
    mask, sliding or not): then a block of rows can drop the keys after its last row. Checked by the blocks
    `rows_attention` uses (no n x n temporary), once per mask tensor and pass."""
    got = req.causal.get(id(mask))
    if got is None or got[0] is not mask:
        q, k = mask.shape[-2], mask.shape[-1]
        attends = (lambda m: m) if mask.dtype == torch.bool else (lambda m: m == 0)  # boolean or additive
        open_later = [attends(mask[..., a : a + step, k - q + a + step :]).any() for a in range(0, q, step)]
        got = req.causal[id(mask)] = (mask, not bool(torch.stack(open_later).any()))
    return got[1]


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface: query (B, H, q, dh), key and value (B, Hkv, k, dh), the eager 4-D
    additive mask (B, 1, q, k) or None. Returns (output (B, q, H, dh), None), the output being the family's
    eager output; inside this thread's `trace_rows` the probabilities of the requested rows are kept in the
    module's slot (H, T, k), and no block holds more than `ATTENTION_CHUNK_BYTES` of scores. Outside it (a
    trace of the same model in another thread while the implementation is switched), exactly eager."""
    eager = family_eager(module)
    if eager is None:
        raise _NoFamilyEager(f"{type(module).__name__} has no eager function to run by blocks")
    req = ROWS.get()
    if req is None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    B, H, q, _ = query.shape
    k = key.shape[-2]
    l = req.layer_of.get(module)
    keep = l is not None and B == 1 and q == k  # a single sequence's self-attention: its rows are asked for
    rows = req.rows.to(query.device)
    step = query_block_rows(H, k, query.element_size())
    # a causal model's keys after a block's last row have probability exactly 0: cutting them saves half the
    # work and keeps right a family that reads the queries as the last rows of the keys
    cut_later = attention_mask is not None and _masks_later_keys(req, attention_mask, step)
    kept, outs = None, []
    # the last block first: with cut keys each block is smaller than the one before, so the allocator reuses the
    # first (largest) block's memory instead of growing with every larger one (measured: 2.3x the budget otherwise)
    for a in reversed(range(0, q, step)):
        b = min(q, a + step)
        cut = k - q + b if cut_later else k
        mask = None if attention_mask is None else attention_mask[:, :, a:b, :cut]
        out, probs = eager(module, query[:, :, a:b], key[:, :, :cut], value[:, :, :cut], mask, **kwargs)
        outs.append(out)
        i0, i1 = bisect_left(req.positions, a), bisect_left(req.positions, b)  # the asked rows in [a, b)
        if keep and isinstance(probs, torch.Tensor) and i1 > i0:
            if kept is None:
                kept = torch.zeros(H, len(req.positions), k, dtype=probs.dtype, device=probs.device)
            kept[:, i0:i1, :cut] = probs[0][:, rows[i0:i1] - a]
        del probs
    if keep and kept is not None:
        req.slots[l] = kept
    return torch.cat(outs[::-1], dim=1), None


def _register() -> None:
    """`rows_attention` under `ROWS_ATTENTION`, with the eager mask builder (an unknown name gets no mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ROWS_ATTENTION, rows_attention)
    AttentionMaskInterface.register(ROWS_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


_register()


def _keep_rows(l: int, module, args, kwargs, out) -> None:
    req = ROWS.get()
    if req is None:
        return
    alpha = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 4:  # a module that ran its own eager code
        req.slots[l] = alpha[0][:, req.rows, :]  # (H, T, n): a copy, so the n x n map is freed with the layer


def install_row_hooks(model: Model) -> None:
    """Once per model: a forward hook on each attention module that keeps the rows of the full probabilities
    an attention module returns (one that does not run `rows_attention`) while this thread's `trace_rows`
    runs (a ContextVar); inert otherwise."""

    def register(l: int, mod: torch.nn.Module) -> None:
        mod.register_forward_hook(partial(_keep_rows, l), with_kwargs=True)

    hook_attention_once(model, "_ctxmix_row_hooks", register)


class RowStates(ReplayedStates):
    """The layer states of a `RowsTrace`, built on demand (`layer_rows_forward`) from the layer input, held
    in the model's dtype, and the kept attention rows (H, T, n); the last built is kept, and each layer's
    reconstruction error is measured at the rows the first time it is built."""

    def __init__(self, model: Model, hidden: list[torch.Tensor], alpha_rows: list, rows: torch.Tensor) -> None:
        super().__init__(model, hidden, alpha_rows, targets=hidden)
        self.rows = rows

    def _build(self, l: int) -> LayerState:
        x = _activations(self.model, self.hidden[l])  # the one work-dtype copy of a layer input alive
        return layer_rows_forward(self.model.layers[l], x, _activations(self.model, self.calls[l]), self.rows)

    def _target(self, l: int) -> torch.Tensor:
        assert self._targets is not None
        return _activations(self.model, self._targets[l + 1][self.rows])


@dataclass
class RowsTrace:
    """Per-layer internals of one sequence at some rows (see the module docstring). hidden[l] (n, d) is
    layer l's input in the model's dtype (L entries); logits (k, V) of positions logits_start.. n-1."""

    model: Model
    input_ids: list[int]
    rows: list[int]
    hidden: list[torch.Tensor]
    states: RowStates
    logits: torch.Tensor | None
    logits_start: int
    streamed: bool = False

    @property
    def n(self) -> int:
        return len(self.input_ids)

    @property
    def reconstruction_error(self) -> float:
        """The largest error of the rebuilt rows against the model's own states, over every layer."""
        return self.states.reconstruction_error()

    def local(self, Q: torch.Tensor) -> torch.Tensor:
        """Positions Q (k,) as indices into the states' row dimension (each must be one of `rows`)."""
        where = {r: i for i, r in enumerate(self.rows)}
        missing = [int(q) for q in Q.tolist() if int(q) not in where]
        if missing:
            raise ValueError(f"positions {missing[:5]} are not among the traced rows")
        return torch.tensor([where[int(q)] for q in Q.tolist()], device=Q.device)

    def logits_at(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.logits is not None
        if bool((rows < self.logits_start).any()):
            raise ValueError(f"the trace kept logits from position {self.logits_start} only")
        return self.logits[rows - self.logits_start]


def layer_rows_forward(lw, x: torch.Tensor, alpha_rows: torch.Tensor, Q: torch.Tensor) -> LayerState:
    """Layer l rebuilt at rows Q (T,) from its input x (n, d) and the model's attention rows (H, T, n):
    the attention output sum_h (alpha_h v_h) W_O^h + b_O at the rows (T, d), then the rest of the layer
    (`state_from_attention`) at the rows. x and x1 stay whole (see the module docstring)."""
    x1 = lw.ln1(x) if lw.position != "post" else None
    v = head_values(lw, x if x1 is None else x1, with_bias=True)  # (H, n, dh)
    Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)  # (H, dh, d)
    attn = torch.matmul(torch.matmul(alpha_rows, v), Wo).sum(0) + lw.bo  # (T, d)
    st = state_from_attention(lw, x[Q], alpha_rows, attn, None if x1 is None else x1[Q])
    return dataclasses.replace(st, x=x, x1=x1)


def _rows_pass(model: Model, ids: torch.Tensor, keep: int, Q: torch.Tensor, impl: str):
    """One forward pass with attention `impl` keeping the rows Q's probabilities: (output, slots)."""
    slots: list = [None] * model.n_layers
    layer_of = {mod: l for l, mod in enumerate(attention_modules(model))}
    with attention_implementation(model, impl):
        token = ROWS.set(_Request(Q, Q.tolist(), slots, layer_of))
        try:
            out = _forward(model, ids, torch.ones_like(ids), {}, attentions=False, keep=keep)
        finally:
            ROWS.reset(token)
    return out, slots


@torch.no_grad()
def trace_rows(model: Model, input_ids: list[int], rows: list[int]) -> RowsTrace:
    """One forward pass over input_ids (a causal LM) keeping every layer's attention rows `rows` (sorted,
    distinct positions) and the logits from rows[0] on; the layers are rebuilt at the rows when read.
    Raises NoAttentionRows when an attention module returns no probabilities."""
    n = len(input_ids)
    if not rows or list(rows) != sorted(set(rows)) or not 0 <= rows[0] <= rows[-1] < n:
        raise ValueError(f"rows must be sorted distinct positions in 0..{n - 1}, got {rows[:5]}...")
    install_row_hooks(model)
    ids = torch.tensor([input_ids], device=model.device)
    Q = torch.tensor(rows, device=model.device)
    try:
        out, slots = _rows_pass(model, ids, n - rows[0], Q, ROWS_ATTENTION)
    except _NoFamilyEager:  # the full eager probabilities, their rows kept by the hooks (the previous path)
        out, slots = _rows_pass(model, ids, n - rows[0], Q, "eager")
    if any(a is None for a in slots):
        raise NoAttentionRows("an attention module returned no probabilities (load with attn_implementation='eager')")
    logits, start = _kept_logits(out, n, rows[0])
    # the model's own hidden states, in its dtype: L layer inputs and the last output (after the final norm:
    # the rows' rebuilt pre-norm states are states[-1].y)
    hidden = [h[0].to(model.device) for h in out.hidden_states]
    del out
    states = RowStates(model, hidden, slots, Q)
    return RowsTrace(model, list(input_ids), list(rows), hidden[:-1], states, logits, start)
