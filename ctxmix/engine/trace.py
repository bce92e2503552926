"""One forward pass that captures what every decomposition needs.

The model's own forward gives the layer inputs, and ctxmix's attention (`ctxmix.engine.attention`) the
attention probabilities beside the fast kernel's outputs, for this call only (a context variable, so two
threads can trace one shared model at once). Every other intermediate is recomputed from the weights
(`ctxmix.engine.layer.layer_forward`), and `Trace.reconstruction_error` says how far that
recomputation is from the model's own states.

A long input's trace is *streamed* (`ctxmix.engine.streaming`): its layers are rebuilt when a
method reads them instead of held, with the same numbers; each layer's reconstruction error is
measured when it is first rebuilt.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxmix.engine.attention import Rows, ctxmix_pass, every_row, within_pass
from ctxmix.engine.layer import LayerState, layer_forward
from ctxmix.engine.models import Model
from ctxmix.engine.streaming import (
    CALLS,
    NotReplayable,
    ReplayedStates,
    can_stream,
    install_call_hooks,
    map_states,
    streams,
)


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
    token_type_ids: list[int] | None = None  # what the model read (sentence pairs on BERT-like models)
    segments: list[int] | None = None  # 0 / 1: text A / B of a pair; -1: special token
    logits_start: int = 0  # logits[i] is position logits_start + i (trace_ids(logits_from=...))
    inputs: Any = None  # what the model read when it is not token ids (`ctxmix.engine.inputs.ImageInput`)

    @property
    def n(self) -> int:
        return len(self.input_ids)

    def local(self, Q: torch.Tensor) -> torch.Tensor:
        """Positions Q as indices into the states (a full trace's states hold every position;
        `ctxmix.engine.rows.RowsTrace` holds some rows)."""
        return Q

    def logits_at(self, rows: torch.Tensor) -> torch.Tensor:
        """(k, vocab) the logits of positions `rows` (k,), whichever rows the trace kept."""
        assert self.logits is not None
        if self.logits_start and bool((rows < self.logits_start).any()):
            raise ValueError(f"the trace kept logits from position {self.logits_start} only")
        return self.logits[rows - self.logits_start]

    @property
    def streamed(self) -> bool:
        """Whether the states are rebuilt on demand (a long input; see the module docstring)."""
        return isinstance(self.states, ReplayedStates)

    def type_ids_kwargs(self, batch: int | None = None) -> dict:
        """The token_type_ids keyword of every forward pass on this sequence (or {})."""
        return self.model.type_ids_kwargs([self.token_type_ids], batch=batch)


@dataclass
class TraceBatch:
    """Per-layer internals of B right-padded sequences, batch-first: states[l].x is (B, n, d)
    with n the longest sequence, alpha (B, H, n, n). Padded keys have exactly zero attention;
    padded rows hold finite values that every consumer crops (`lengths`, `mask`)."""

    model: Model
    input_ids: list[list[int]]
    states: list[LayerState]
    logits: torch.Tensor | None  # (B, n, vocab) or (B, n_labels) or None
    errors: torch.Tensor  # (B,) reconstruction error of each sequence, on the device
    notes: list[list[str]] = field(default_factory=list)
    ids: torch.Tensor | None = None  # (B, n) padded input ids on the device
    _mask: torch.Tensor | None = None
    token_type_ids: list | None = None  # per sequence: a list or None
    segments: list | None = None  # per sequence: a list or None
    inputs: list | None = None  # per sequence: its non-id input (`Trace.inputs`) or None

    @property
    def B(self) -> int:
        return len(self.input_ids)

    @property
    def n(self) -> int:
        return max(self.lengths)

    @property
    def streamed(self) -> bool:
        """Whether the states are rebuilt on demand (a long input: maps then go to the host layer by layer)."""
        return isinstance(self.states, ReplayedStates)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    @property
    def mask(self) -> torch.Tensor:
        """(B, n) bool on the device: True at real tokens."""
        if self._mask is None:
            lens = torch.tensor(self.lengths, device=self.states[0].x.device)
            self._mask = torch.arange(self.n, device=lens.device)[None] < lens[:, None]
        return self._mask

    def trace(self, b: int, error: float | None = None) -> Trace:
        """Sequence b as a one-sequence Trace (views into the batch, cropped to its tokens)."""
        n = len(self.input_ids[b])
        lg = None if self.logits is None else (self.logits[b] if self.logits.dim() == 2 else self.logits[b, :n])
        states = map_states(self.states, lambda st: st.select(b, n))
        if isinstance(states, ReplayedStates):
            hidden = states.hidden
        else:  # no states: a logits-only trace (trace_ids(..., layers=False))
            hidden = [st.x for st in states] + [states[-1].y] if states else []
        inp = (self.inputs or [None] * self.B)[b]
        return Trace(
            model=self.model,
            input_ids=list(self.input_ids[b]),
            tokens=self.model.tokens(self.input_ids[b]) if inp is None else inp.labels(),
            hidden=hidden,
            states=states,
            logits=lg,
            reconstruction_error=self.sequence_errors()[b] if error is None else error,
            notes=list(self.notes[b]) if self.notes else [],
            token_type_ids=(self.token_type_ids or [None] * self.B)[b],
            segments=(self.segments or [None] * self.B)[b],
            inputs=inp,
        )

    def sequence_errors(self) -> list[float]:
        """Each sequence's reconstruction error; a streamed trace's covers every layer (those no
        method has read yet are rebuilt now)."""
        errs = self.errors.tolist()
        if isinstance(self.states, ReplayedStates):
            errs[0] = max(errs[0], self.states.reconstruction_error())
        return errs

    @classmethod
    def of(cls, tr: Trace | TraceBatch) -> TraceBatch:
        """A Trace as a batch of one (views), or a TraceBatch as it is."""
        if isinstance(tr, TraceBatch):
            return tr
        # a streamed trace's own error is its states' (measured as they are built, see `sequence_errors`)
        given = tr._given_error if isinstance(tr, StreamedTrace) else tr.reconstruction_error
        lg = None if tr.logits is None else tr.logits.unsqueeze(0)
        # not states[0]: that would rebuild a streamed trace's first layer; a logits-only trace has neither
        dev = tr.hidden[0].device if tr.hidden else tr.model.device
        # on the device, as a batch's: the decompositions update it per chunk, and it is read once per call
        err = torch.tensor([given], dtype=torch.float64, device=dev)
        return cls(
            model=tr.model,
            input_ids=[list(tr.input_ids)],
            states=map_states(tr.states, LayerState.as_batch),
            logits=lg,
            errors=err,
            notes=[list(tr.notes)],
            ids=torch.tensor([tr.input_ids], device=dev),
            _mask=torch.ones(1, tr.n, dtype=torch.bool, device=dev),
            token_type_ids=[tr.token_type_ids],
            segments=[tr.segments],
            inputs=[tr.inputs],
        )


def _rebuild(model: Model, hs: list[torch.Tensor], atts: list[torch.Tensor], mask: torch.Tensor | None):
    """Rebuild every layer from hidden states hs (L+1 of (..., n, d)) and attention probabilities
    atts (L of (..., H, n, n)). Returns the states and the largest error per sequence against the
    model's own states, counted on real tokens only (mask (..., n), or all tokens)."""
    if atts is None or len(atts) != model.n_layers or atts[0] is None:
        raise RuntimeError(
            "the model returned no attention weights: wrap it with ctxmix.model_from_hf "
            "or load it with ctxmix.load_model"
        )
    states = []
    err = torch.zeros(hs[0].shape[:-2], dtype=torch.float64, device=hs[0].device)
    for l, lw in enumerate(model.layers):
        st = layer_forward(lw, hs[l], atts[l])
        states.append(st)
        real = hs[l + 1]
        mine = st.y
        if l == model.n_layers - 1 and model.spec.final_norm is not None and model.spec.hidden_after_final_norm:
            mine = lw.next_norm(st.y)  # transformers hands back a text model's last hidden state after the final norm
        diff = (mine - real).abs().amax(-1).double()
        if mask is not None:
            diff = torch.where(mask, diff, 0)
        err = torch.maximum(err, diff.amax(-1))
    return states, err


def _forward(
    model: Model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    types: dict,
    attentions: bool = True,
    hidden: bool = True,
    keep: int | None = None,
):
    # an encoder-decoder's Model describes its encoder (`ctxmix.engine.seq2seq` traces the decoder)
    net = model.hf.get_encoder() if model.spec.encoder_decoder else model.hf
    params = inspect.signature(net.forward).parameters
    if not attentions and "use_cache" in params:
        types = {**types, "use_cache": False}  # a replayed attention call must not append to a KV cache
    if keep is not None and "logits_to_keep" in params:
        # the LM head on the last `keep` rows only: at n = 4,096 on smollm2 the full (n, 49,152) logits are
        # 0.8 GB and ~1/5 of the forward's multiply-adds
        types = {**types, "logits_to_keep": keep}
    # every row's probabilities where they are read (a full trace), else the fast kernel alone (or the rows an
    # enclosing rows trace asks for)
    with ctxmix_pass(rows=every_row()) if attentions else within_pass():
        out = net(
            input_ids=ids, attention_mask=mask, output_hidden_states=hidden, output_attentions=attentions, **types
        )
    if attentions and (out.attentions is None or any(a is None for a in out.attentions)):
        raise RuntimeError(
            "the model returned no attention weights: wrap it with ctxmix.model_from_hf "
            "or load it with ctxmix.load_model"
        )
    return out


def _kept_logits(out, n: int, logits_from: int | None) -> tuple[torch.Tensor | None, int]:
    """One sequence's logits (rows from `logits_from`, or all) and the position of its first row."""
    logits = getattr(out, "logits", None)
    if logits is None:
        return None, 0
    logits = logits[0]
    if logits_from is None or logits.dim() == 1:
        return logits, 0
    return logits[logits.shape[0] - (n - logits_from) :], logits_from  # models without logits_to_keep: cut


def _activations(model: Model, t: torch.Tensor) -> torch.Tensor:
    """The model's activations on the engine's device, in the dtype the decompositions run in (its layer
    weights' dtype). A model spread over devices hands each layer's states back where that layer ran."""
    return t.to(device=model.device, dtype=model.work_dtype)


@torch.no_grad()
def trace_ids(
    model: Model,
    input_ids: list[int],
    notes: list[str] | None = None,
    token_type_ids: list[int] | None = None,
    segments: list[int] | None = None,
    streamed: bool | None = None,
    layers: bool = True,
    logits_from: int | None = None,
) -> Trace:
    """Run the model once on one unpadded sequence and rebuild every layer from its weights.
    token_type_ids: what a BERT-like model reads for a sentence pair; segments: recorded as given.
    streamed: rebuild the layers on demand instead of holding them (None: when `streams` says so).
    layers=False: the logits only (no hidden states, attention weights or rebuilt layers: `hidden`
    and `states` empty, reconstruction_error 0 as nothing is recomputed), for callers that read
    only the ids and the prediction (the gradient and perturbation methods run their own passes).
    logits_from: a causal LM's logits for positions logits_from .. n-1 only (`Trace.logits_at` reads them;
    context attribution reads only the response rows)."""
    ids = torch.tensor([input_ids], device=model.device)
    _check_rows(input_ids, token_type_ids, segments)
    if logits_from is not None and not 0 <= logits_from < len(input_ids):
        raise ValueError(f"logits_from {logits_from} outside the {len(input_ids)} positions")
    keep = None if logits_from is None else len(input_ids) - logits_from
    if not layers:
        types = model.type_ids_kwargs([token_type_ids])
        out = _forward(model, ids, torch.ones_like(ids), types, attentions=False, hidden=False, keep=keep)
        logits, start = _kept_logits(out, len(input_ids), logits_from)
        return Trace(
            model=model,
            input_ids=list(input_ids),
            tokens=model.tokens(input_ids),
            hidden=[],
            states=[],
            logits=logits,
            reconstruction_error=0.0,
            notes=list(notes or []),
            token_type_ids=token_type_ids,
            segments=segments,
            logits_start=start,
        )
    if streamed is None:
        streamed = streams(model, len(input_ids))
    if streamed and can_stream(model):
        tr = _streamed_trace(model, ids, model.type_ids_kwargs([token_type_ids]), logits_from)
        if tr is not None:
            tr.notes, tr.token_type_ids, tr.segments = list(notes or []), token_type_ids, segments
            return tr
    out = _forward(model, ids, torch.ones_like(ids), model.type_ids_kwargs([token_type_ids]), keep=keep)
    logits, start = _kept_logits(out, len(input_ids), logits_from)
    hs = [_activations(model, h[0]) for h in out.hidden_states]
    states, err = _rebuild(model, hs, [_activations(model, a[0]) for a in out.attentions], None)
    return Trace(
        model=model,
        input_ids=list(input_ids),
        tokens=model.tokens(input_ids),
        hidden=hs[:-1] + [states[-1].y],
        states=states,
        logits=logits,
        reconstruction_error=float(err),
        notes=list(notes or []),
        token_type_ids=token_type_ids,
        segments=segments,
        logits_start=start,
    )


# ---------------------------------------------------------------- streamed traces (`ctxmix.engine.streaming`)


class StreamedTrace(Trace):
    """A Trace whose states are `ReplayedStates`: its reconstruction error is theirs (every layer,
    rebuilt now if no method has read it), joined with any error given at construction."""

    @property
    def reconstruction_error(self) -> float:
        assert isinstance(self.states, ReplayedStates)
        return max(self._given_error, self.states.reconstruction_error())

    @reconstruction_error.setter
    def reconstruction_error(self, value: float) -> None:
        self._given_error = float(value)


def _streamed_trace(model: Model, ids: torch.Tensor, types: dict, logits_from: int | None = None) -> Trace | None:
    """One sequence's trace whose states are rebuilt on demand. None when the model's attention
    modules cannot be replayed."""
    install_call_hooks(model)
    calls: list = [None] * model.n_layers
    token = CALLS.set(calls)
    try:
        keep = None if logits_from is None else ids.shape[1] - logits_from
        # no rows kept now, but the masks built for the probabilities the replays compute (SDPA's, not a flash
        # kernel's): the recorded calls are replayed with every row's
        with ctxmix_pass(rows=Rows([])):
            out = _forward(model, ids, torch.ones_like(ids), types, attentions=False, keep=keep)
    finally:
        CALLS.reset(token)
    if any(c is None for c in calls):
        return None
    hs = [_activations(model, h[0]) for h in out.hidden_states]
    states = ReplayedStates(model, hs[:-1], calls, targets=hs)
    try:
        last = states[-1]  # the first rebuild also tells whether the attention modules can be replayed
    except NotReplayable:
        return None
    states.hidden = hs[:-1] + [last.y]  # the raw last output, as a stored trace's
    logits, start = _kept_logits(out, ids.shape[1], logits_from)
    ids_ = ids[0].tolist()
    return StreamedTrace(
        model=model,
        input_ids=ids_,
        tokens=model.tokens(ids_),
        hidden=states.hidden,
        states=states,  # type: ignore[arg-type]
        logits=logits,
        reconstruction_error=0.0,
        logits_start=start,
    )


def _check_rows(ids: list[int], *rows) -> None:
    for r in rows:
        if r is not None and len(r) != len(ids):
            raise ValueError(f"token_type_ids / segments of length {len(r)} for {len(ids)} tokens")


@torch.no_grad()
def trace_batch_tensors(
    model: Model,
    batch: list[list[int]],
    notes: list[list[str]] | None = None,
    token_type_ids: list | None = None,
    segments: list | None = None,
) -> TraceBatch:
    """Trace B sequences with one padded forward pass (right padding, masked keys) and rebuild
    every layer for the whole batch at once. Masked keys get exactly zero attention, so each
    sequence's states equal its unpadded trace up to float rounding (tests check every family)."""
    if not batch or any(len(ids) == 0 for ids in batch):
        raise ValueError("trace_batch needs non-empty sequences")
    n_max = max(len(ids) for ids in batch)
    pad = model.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    ids = torch.tensor([list(seq) + [pad] * (n_max - len(seq)) for seq in batch], dtype=torch.long, device=model.device)
    lens = torch.tensor([len(seq) for seq in batch], device=model.device)
    mask = torch.arange(n_max, device=model.device)[None] < lens[:, None]
    for rows in (token_type_ids, segments):
        if rows is not None:
            if len(rows) != len(batch):
                raise ValueError("token_type_ids / segments need one entry (or None) per sequence")
            for seq, r in zip(batch, rows):
                _check_rows(seq, r)
    out = _forward(model, ids, mask.long(), model.type_ids_kwargs(token_type_ids, n_max) if token_type_ids else {})
    logits = getattr(out, "logits", None)
    hs = [_activations(model, h) for h in out.hidden_states]
    atts = [_activations(model, a) for a in out.attentions]
    if not bool(mask.all()):
        # padded rows are the model's business: with a sliding window a padded query can see no key
        # at all, and its NaN would reach real rows through 0-weighted sums (0 * NaN = NaN)
        keep = mask[:, :, None]
        if not bool(torch.stack([torch.isfinite(torch.where(keep, h, 0)).all() for h in hs]).all()):  # one sync
            # the model's own padded pass is not finite at real tokens (ModernBERT's and Mistral's eager
            # sliding windows can leave a padded query no key at all): trace each sequence alone
            return _stack_traces(
                model,
                [
                    trace_ids(
                        model,
                        list(seq),
                        (notes or [[]] * len(batch))[b],
                        (token_type_ids or [None] * len(batch))[b],
                        (segments or [None] * len(batch))[b],
                    )
                    for b, seq in enumerate(batch)
                ],
            )
        hs = [torch.where(keep, h, 0) for h in hs]
        atts = [torch.where(keep[:, None] & mask[:, None, None, :], a, 0) for a in atts]
    states, err = _rebuild(model, hs, atts, mask)
    return TraceBatch(
        model=model,
        input_ids=[list(s) for s in batch],
        states=states,
        logits=logits,
        errors=err,
        notes=[list(x) for x in (notes or [[] for _ in batch])],
        ids=ids,
        _mask=mask,
        token_type_ids=None if token_type_ids is None else list(token_type_ids),
        segments=None if segments is None else list(segments),
    )


def _stack_traces(model: Model, traces: list[Trace]) -> TraceBatch:
    """One-sequence traces as a right-padded TraceBatch (zeros at padded positions, as a padded
    forward pass leaves them once cleaned)."""
    n_max = max(tr.n for tr in traces)
    dev = traces[0].states[0].x.device

    def pad(t: torch.Tensor, dims: int) -> torch.Tensor:  # zero-pad the last `dims` token axes to n_max
        if dims == 1:
            return torch.nn.functional.pad(t, (0, 0, 0, n_max - t.shape[-2]))
        return torch.nn.functional.pad(t, (0, n_max - t.shape[-1], 0, n_max - t.shape[-2]))

    states = []
    for l in range(len(traces[0].states)):
        fields: dict[str, torch.Tensor | None] = {}
        for k, v0 in traces[0].states[l].__dict__.items():
            if v0 is None:
                fields[k] = None
            else:
                fields[k] = torch.stack([pad(getattr(tr.states[l], k), 2 if k == "alpha" else 1) for tr in traces])
        states.append(LayerState(**fields))
    logits = None
    if traces[0].logits is not None:
        lg = [tr.logits for tr in traces]
        logits = torch.stack(lg) if lg[0].dim() == 1 else torch.stack([pad(x, 1) for x in lg])
    pad_id = model.tokenizer.pad_token_id or 0
    ids = torch.tensor([tr.input_ids + [pad_id] * (n_max - tr.n) for tr in traces], device=dev)
    mask = torch.arange(n_max, device=dev)[None] < torch.tensor([tr.n for tr in traces], device=dev)[:, None]
    return TraceBatch(
        model=model,
        input_ids=[list(tr.input_ids) for tr in traces],
        states=states,
        logits=logits,
        errors=torch.tensor([tr.reconstruction_error for tr in traces], dtype=torch.float64, device=dev),
        notes=[list(tr.notes) for tr in traces],
        ids=ids,
        _mask=mask,
        token_type_ids=[tr.token_type_ids for tr in traces],
        segments=[tr.segments for tr in traces],
    )


def trace_batch(model: Model, batch: list[list[int]], notes: list[list[str]] | None = None) -> list[Trace]:
    """Trace several sequences with one padded forward pass; one Trace per sequence."""
    return list(iter_trace_batch(model, batch, notes))


def iter_trace_batch(model: Model, batch: list[list[int]], notes: list[list[str]] | None = None):
    """`trace_batch` as a generator of one-sequence Traces (views into one batched trace)."""
    if len(batch) == 1 and batch[0]:
        yield trace_ids(model, batch[0], (notes or [[]])[0])
        return
    tb = trace_batch_tensors(model, batch, notes)
    errs = tb.errors.tolist()
    for b in range(tb.B):
        yield tb.trace(b, errs[b])


def trace(model: Model, text) -> Trace:
    """Tokenise one text or a pair (text_a, text_b) (special tokens included, truncated to the
    model's limit with a warning) and trace."""
    e = model.encode_input(text)
    return trace_ids(model, e.ids, e.notes, e.token_type_ids, e.segments)
