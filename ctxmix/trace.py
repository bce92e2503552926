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


@torch.no_grad()
def trace_ids(model: Model, input_ids: list[int], notes: list[str] | None = None) -> Trace:
    """Run the model once on one unpadded sequence and rebuild every layer from its weights."""
    ids = torch.tensor([input_ids], device=model.device)
    out = model.hf(input_ids=ids, attention_mask=torch.ones_like(ids),
                   output_hidden_states=True, output_attentions=True)
    hs = [h[0] for h in out.hidden_states]
    atts = out.attentions
    if atts is None or len(atts) != model.n_layers or atts[0] is None:
        raise RuntimeError("the model returned no attention weights; it must be loaded with attn_implementation='eager'")
    states = []
    err = 0.0
    for l, lw in enumerate(model.layers):
        st = layer_forward(lw, hs[l], atts[l][0])
        states.append(st)
        real = hs[l + 1]
        if l == model.n_layers - 1 and model.spec.final_norm is not None:
            # transformers hands back the last hidden state after the final norm
            final = lw.next_norm
            err = max(err, float((final(st.y) - real).abs().max()))
        else:
            err = max(err, float((st.y - real).abs().max()))
    hidden = hs[:-1] + [states[-1].y]
    logits = getattr(out, "logits", None)
    if logits is not None:
        logits = logits[0]
    return Trace(model=model, input_ids=list(input_ids), tokens=model.tokens(input_ids), hidden=hidden,
                 states=states, logits=logits, reconstruction_error=err, notes=list(notes or []))


def trace(model: Model, text: str) -> Trace:
    """Tokenise (special tokens included, truncated to the model's limit with a warning) and trace."""
    ids, notes = model.encode(text)
    return trace_ids(model, ids, notes)
