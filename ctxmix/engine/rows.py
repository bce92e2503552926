"""A trace of some rows only (`trace_rows`): one forward pass of a causal LM whose attention hands over the
probabilities of the rows asked for, without ever forming an n x n map per head, then each layer rebuilt at
those rows from the model's hidden states (context attribution's `logit`, `attention` and `at2_exact`).

Those methods read, at layer l, the attention rows alpha^l[:, q_t, :] of the T explained rows, the values
of every position, and the attention and FF outputs at q_t only. A full trace rebuilds every layer at all n
rows (or replays each attention module when streamed): L n x n maps per head and the FF at n rows. Here the
forward pass runs ctxmix's attention (`ctxmix.engine.attention`) with a `Rows` request in this call's pass:
every output from the fast kernel (SDPA; causal masking by its `is_causal`, no n x n mask), and the
probabilities of the T rows recomputed from the same post-RoPE queries and keys with the module's scaling,
soft-cap, sinks and mask, (H, T, n), in float64 for a float64 model and float32 otherwise.

The layers are rebuilt on demand (`RowStates`, as a streamed trace's): layer l from its input, the model's
own hidden state in the model's dtype, converted to the work dtype when the layer is built, and only the
last built layer is held. Memory: O(chunk + L n d in the model's dtype + L H T n) beside the model, with
chunk = `ATTENTION_CHUNK_BYTES` (a block of the rows' scores), plus, for a sliding-window family once n
reaches its window, SDPA's boolean (1, 1, n, n) mask (one byte a cell, shared by every layer and head). Cost:
one forward pass plus the T rows' scores per layer and, per layer read, the head values of all positions and
the FF at T rows.

`RowsTrace.states[l]` is a `LayerState` whose `x` and `x1` hold all n positions (the values are computed
from them) while `alpha` is (H, T, n) and every other field (T, ...): the rows in order. Consumers index a
state with `local(Q)` (positions 0..T-1 of the rows) and hidden states and logits with positions. Each
layer's output at the rows is checked against the model's own hidden state (`reconstruction_error`), as a
full trace's is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ctxmix.engine.attention import (  # noqa: F401 - re-exported: the rows trace's block size and eager lookup
    ATTENTION_CHUNK_BYTES,
    Rows,
    ctxmix_pass,
    family_eager,
    query_block_rows,
)
from ctxmix.engine.layer import LayerState, attention_output, head_values, state_from_attention
from ctxmix.engine.models import Model
from ctxmix.engine.streaming import ReplayedStates, attention_modules
from ctxmix.engine.trace import _activations, _forward, _kept_logits


class NoAttentionRows(RuntimeError):
    """An attention module that did not run through ctxmix's attention (a full trace is needed then)."""


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
    attn = attention_output(lw, alpha_rows, v)  # (T, d)
    st = state_from_attention(lw, x[Q], alpha_rows, attn, None if x1 is None else x1[Q])
    return dataclasses.replace(st, x=x, x1=x1)


def _rows_pass(model: Model, ids: torch.Tensor, keep: int, rows: list[int]):
    """One forward pass (the fast kernel for every output) keeping the probabilities of `rows`: (output, slots)."""
    req = Rows(list(rows), [None] * model.n_layers, {mod: l for l, mod in enumerate(attention_modules(model))})
    with ctxmix_pass(rows=req, kernel="fast"):
        out = _forward(model, ids, torch.ones_like(ids), {}, attentions=False, keep=keep)
    return out, [None if s is None else s[0] for s in req.slots]


@torch.no_grad()
def trace_rows(model: Model, input_ids: list[int], rows: list[int]) -> RowsTrace:
    """One forward pass over input_ids (a causal LM) keeping every layer's attention rows `rows` (sorted,
    distinct positions) and the logits from rows[0] on; the layers are rebuilt at the rows when read.
    Raises NoAttentionRows when an attention module returns no probabilities."""
    n = len(input_ids)
    if not rows or list(rows) != sorted(set(rows)) or not 0 <= rows[0] <= rows[-1] < n:
        raise ValueError(f"rows must be sorted distinct positions in 0..{n - 1}, got {rows[:5]}...")
    ids = torch.tensor([input_ids], device=model.device)
    Q = torch.tensor(rows, device=model.device)
    out, slots = _rows_pass(model, ids, n - rows[0], list(rows))
    if any(a is None for a in slots):
        raise NoAttentionRows("an attention module did not run through ctxmix's attention (a full trace is needed)")
    logits, start = _kept_logits(out, n, rows[0])
    # the model's own hidden states, in its dtype: L layer inputs and the last output (after the final norm:
    # the rows' rebuilt pre-norm states are states[-1].y)
    hidden = [h[0].to(model.device) for h in out.hidden_states]
    del out
    states = RowStates(model, hidden, slots, Q)
    return RowsTrace(model, list(input_ids), list(rows), hidden[:-1], states, logits, start)
