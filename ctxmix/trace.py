"""One forward pass that captures what every decomposition needs.

The model's own eager forward gives the layer inputs and the attention probabilities
(transformers 5 collects them per call through a context variable, so two threads can trace
one shared model at once); ctxmix registers no hook and changes nothing in the model.
Every other intermediate is recomputed from the weights (`ctxmix.layer.layer_forward`), and
`Trace.reconstruction_error` says how far that recomputation is from the model's own states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layer import LayerState, layer_forward
from .models import Model


@dataclass
class Trace:
    """Per-layer internals of one sequence. hidden[l] is layer l's input, (n, d)."""

    model: Model
    input_ids: list[int]
    tokens: list[str]
    hidden: list[torch.Tensor]  # L+1 entries; the last is the raw last-layer output (no final norm)
    states: list[LayerState]
    logits: torch.Tensor | None  # (n, vocab) or (n_labels,) or None
    reconstruction_error: float
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.input_ids)


def _build_trace(model: Model, input_ids: list[int], hs: list[torch.Tensor], atts: list[torch.Tensor],
                 logits: torch.Tensor | None, notes: list[str] | None) -> Trace:
    """Rebuild every layer of one sequence from its hidden states hs (L+1 of (n, d)) and
    attention probabilities atts (L of (H, n, n))."""
    if atts is None or len(atts) != model.n_layers or atts[0] is None:
        raise RuntimeError("the model returned no attention weights; it must be loaded with attn_implementation='eager'")
    states = []
    err = 0.0
    for l, lw in enumerate(model.layers):
        st = layer_forward(lw, hs[l], atts[l])
        states.append(st)
        real = hs[l + 1]
        if l == model.n_layers - 1 and model.spec.final_norm is not None:
            # transformers hands back the last hidden state after the final norm
            final = lw.next_norm
            err = max(err, float((final(st.y) - real).abs().max()))
        else:
            err = max(err, float((st.y - real).abs().max()))
    hidden = hs[:-1] + [states[-1].y]
    return Trace(model=model, input_ids=list(input_ids), tokens=model.tokens(input_ids), hidden=hidden,
                 states=states, logits=logits, reconstruction_error=err, notes=list(notes or []))


def _forward(model: Model, ids: torch.Tensor, mask: torch.Tensor):
    out = model.hf(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    if out.attentions is None or any(a is None for a in out.attentions):
        raise RuntimeError("the model returned no attention weights; it must be loaded with attn_implementation='eager'")
    return out


@torch.no_grad()
def trace_ids(model: Model, input_ids: list[int], notes: list[str] | None = None) -> Trace:
    """Run the model once on one unpadded sequence and rebuild every layer from its weights."""
    ids = torch.tensor([input_ids], device=model.device)
    out = _forward(model, ids, torch.ones_like(ids))
    logits = getattr(out, "logits", None)
    return _build_trace(model, input_ids, [h[0] for h in out.hidden_states], [a[0] for a in out.attentions],
                        None if logits is None else logits[0], notes)


def trace_batch(model: Model, batch: list[list[int]], notes: list[list[str]] | None = None) -> list[Trace]:
    """Trace several sequences with one padded forward pass (right padding, masked keys).

    Masked keys get exactly zero attention, so each sequence's states equal its unpadded
    trace up to float rounding (tests/test_methods.py checks it for every family); the layer
    rebuilding and every decomposition then run per sequence on the unpadded part."""
    return list(iter_trace_batch(model, batch, notes))


@torch.no_grad()
def iter_trace_batch(model: Model, batch: list[list[int]], notes: list[list[str]] | None = None):
    """`trace_batch` as a generator: one forward pass, each Trace rebuilt only when asked for,
    so a corpus loop holds one sequence's layer states at a time."""
    if not batch or any(len(ids) == 0 for ids in batch):
        raise ValueError("trace_batch needs non-empty sequences")
    notes = notes or [[] for _ in batch]
    if len(batch) == 1:
        yield trace_ids(model, batch[0], notes[0])
        return
    n_max = max(len(ids) for ids in batch)
    pad = model.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    ids = torch.full((len(batch), n_max), pad, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(batch):
        ids[b, : len(seq)] = torch.tensor(seq, device=model.device)
        mask[b, : len(seq)] = 1
    out = _forward(model, ids, mask)
    logits = getattr(out, "logits", None)
    for b, seq in enumerate(batch):
        n = len(seq)
        lg = None if logits is None else (logits[b] if logits.dim() == 2 else logits[b, :n])
        yield _build_trace(model, seq, [h[b, :n] for h in out.hidden_states],
                           [a[b, :, :n, :n].contiguous() for a in out.attentions], lg, notes[b])


def trace(model: Model, text: str) -> Trace:
    """Tokenise (special tokens included, truncated to the model's limit with a warning) and trace."""
    ids, notes = model.encode(text)
    return trace_ids(model, ids, notes)
