"""A trace of some rows only (`trace_rows`): one forward pass of a causal LM whose attention modules
hand over the probabilities of the rows asked for and drop the rest, then each layer rebuilt at those
rows from the model's hidden states (context attribution's `logit`, `attention` and `at2_exact`).

Those methods read, at layer l, the attention rows alpha^l[:, q_t, :] of the T explained rows, the
values of every position, and the attention and FF outputs at q_t only. A full trace rebuilds every
layer at all n rows (or replays each attention module when streamed): L n x n maps per head and the FF
at n rows. Here the forward pass computes each layer's n x n probabilities once, as it must, and a
forward hook keeps their T rows; memory is O(L n d + L H T n) with no n x n map held, and the cost is
one forward pass plus, per layer, the head values of all positions and the FF at T rows.

`RowsTrace.states[l]` is a `LayerState` whose `x` and `x1` hold all n positions (the values are
computed from them) while `alpha` is (H, T, n) and every other field (T, ...): the rows in order.
Consumers index a state with `local(Q)` (positions 0..T-1 of the rows) and hidden states and logits
with positions. Each layer's output at the rows is checked against the model's own hidden state
(`reconstruction_error`), as a full trace's is.
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from ctxmix.engine.layer import LayerState, head_values, state_from_attention
from ctxmix.engine.models import Model
from ctxmix.engine.streaming import hook_attention_once
from ctxmix.engine.trace import _activations, _forward, _kept_logits

# (row positions (T,), one slot per layer) while this thread's `trace_rows` runs; None otherwise
ROWS: contextvars.ContextVar = contextvars.ContextVar("ctxmix_rows", default=None)


class NoAttentionRows(RuntimeError):
    """An attention module that returned no probabilities (a full trace is needed then)."""


def _keep_rows(l: int, module, args, kwargs, out) -> None:
    got = ROWS.get()
    if got is None:
        return
    rows, slots = got
    alpha = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 4:
        slots[l] = alpha[0][:, rows, :]  # (H, T, n): a copy, so the n x n map is freed with the layer


def install_row_hooks(model: Model) -> None:
    """Once per model: a forward hook on each attention module that keeps the rows of its probabilities
    while this thread's `trace_rows` runs (a ContextVar); inert otherwise."""

    def register(l: int, mod: torch.nn.Module) -> None:
        mod.register_forward_hook(partial(_keep_rows, l), with_kwargs=True)

    hook_attention_once(model, "_ctxmix_row_hooks", register)


@dataclass
class RowsTrace:
    """Per-layer internals of one sequence at some rows (see the module docstring). hidden[l] (n, d) is
    layer l's input (L entries); logits (k, V) of positions logits_start.. n-1."""

    model: Model
    input_ids: list[int]
    rows: list[int]
    hidden: list[torch.Tensor]
    states: list[LayerState]
    logits: torch.Tensor | None
    logits_start: int
    reconstruction_error: float
    streamed: bool = False

    @property
    def n(self) -> int:
        return len(self.input_ids)

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


@torch.no_grad()
def trace_rows(model: Model, input_ids: list[int], rows: list[int]) -> RowsTrace:
    """One forward pass over input_ids (a causal LM, eager attention) keeping every layer's attention rows
    `rows` (sorted, distinct positions) and the logits from rows[0] on; each layer rebuilt at the rows.
    Raises NoAttentionRows when an attention module returns no probabilities."""
    n = len(input_ids)
    if not rows or list(rows) != sorted(set(rows)) or not 0 <= rows[0] <= rows[-1] < n:
        raise ValueError(f"rows must be sorted distinct positions in 0..{n - 1}, got {rows[:5]}...")
    install_row_hooks(model)
    ids = torch.tensor([input_ids], device=model.device)
    Q = torch.tensor(rows, device=model.device)
    slots: list = [None] * model.n_layers
    token = ROWS.set((Q, slots))
    try:
        out = _forward(model, ids, torch.ones_like(ids), {}, attentions=False, keep=n - rows[0])
    finally:
        ROWS.reset(token)
    if any(a is None for a in slots):
        raise NoAttentionRows("an attention module returned no probabilities (load with attn_implementation='eager')")
    hs = [_activations(model, h[0]) for h in out.hidden_states]
    logits, start = _kept_logits(out, n, rows[0])
    states, err = [], 0.0
    for l, lw in enumerate(model.layers):
        st = layer_rows_forward(lw, hs[l], _activations(model, slots[l]), Q)
        states.append(st)
        mine = st.y
        if l == model.n_layers - 1 and model.spec.final_norm is not None:
            mine = lw.next_norm(st.y)  # transformers hands back the last hidden state after the final norm
        err = max(err, float((mine - hs[l + 1][Q]).abs().max()))
    # hidden: the layers' inputs (the model's last hidden state is after the final norm: the rows' rebuilt
    # pre-norm states are states[-1].y)
    return RowsTrace(model, list(input_ids), list(rows), hs[:-1], states, logits, start, err)
