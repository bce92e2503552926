"""Streamed traces: a long input's layers rebuilt on demand instead of held.

A stored trace keeps every layer's attention probabilities (L x H x n^2), which outgrow
everything else on a long input: 4.5 GB for smollm2 at n = 2,048. Above the budget's share
(`streams`) `ctxmix.engine.trace.trace_ids` streams instead: the forward pass keeps the layer
inputs and what each attention module was called with (a pre-hook, installed once per model and
inert unless this thread's streamed trace is running, as transformers' own output recorder), and
`ReplayedStates` rebuilds a layer when a method reads it, by calling its attention module again
on the same inputs. One layer's probabilities are then held at a time, and the numbers are the
same (tests/test_trace_stream.py, every family).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from functools import partial

import torch

from ctxmix.engine.arch import _get
from ctxmix.engine.budget import memory_budget, sequence_bytes
from ctxmix.engine.layer import LayerState, layer_forward
from ctxmix.engine.models import Model

CALLS: ContextVar[list | None] = ContextVar("ctxmix_attention_calls", default=None)
_HOOK_LOCK = threading.Lock()
STREAM_SHARE = 2  # stream when the stored states would take more than 1/STREAM_SHARE of the budget


def streams(model: Model, n: int) -> bool:
    """Whether a trace of n tokens is streamed: its stored states (L layers of vectors and H x n^2
    attention) would take more than half the memory budget, which the maps and chunks need."""
    return sequence_bytes(model, n, n_maps=0) > memory_budget(model.device) // STREAM_SHARE


def can_stream(model: Model) -> bool:
    """Encoder-decoders' encoders are traced whole (their decoders are traced by `ctxmix.engine.seq2seq`)."""
    return not model.spec.encoder_decoder


def attention_modules(model: Model) -> list[torch.nn.Module]:
    """Each layer's attention module: the parent of its value projection, which computes the
    probabilities and returns them second (transformers 5's eager attention, every family)."""
    parent = model.spec.value.rsplit(".", 1)[0]
    return [_get(layer, parent) for layer in _get(model.hf.base_model, model.spec.layers)]


def _no_cache(v):
    """A KV cache is state a replayed call must neither read nor append to (`_forward` asks for none)."""
    from transformers.cache_utils import Cache

    return None if isinstance(v, Cache) else v


def _record_call(l: int, module, args, kwargs) -> None:
    calls = CALLS.get()
    if calls is not None:
        calls[l] = (module, tuple(_no_cache(a) for a in args), {k: _no_cache(v) for k, v in kwargs.items()})


def hook_attention_once(model: Model, flag: str, register: Callable[[int, torch.nn.Module], object]) -> None:
    """Once per model (`flag` marks it on the HF module, under a lock): register(layer, module) on each
    attention module."""
    hf = model.hf
    if getattr(hf, flag, False):
        return
    with _HOOK_LOCK:
        if getattr(hf, flag, False):
            return
        for l, mod in enumerate(attention_modules(model)):
            register(l, mod)
        setattr(hf, flag, True)


def install_call_hooks(model: Model) -> None:
    """Once per model: a pre-hook on each attention module that records its call while this
    thread's streamed trace runs (a ContextVar, as transformers' own output recorder); inert otherwise."""

    def register(l: int, mod: torch.nn.Module) -> None:
        mod.register_forward_pre_hook(partial(_record_call, l), with_kwargs=True)

    hook_attention_once(model, "_ctxmix_call_hooks", register)


def replayed_alpha(model: Model, call) -> torch.Tensor | None:
    """The attention probabilities (H, n, n) of one recorded attention call, computed again; None when
    the module does not return them (then the model cannot be streamed)."""
    module, args, kwargs = call
    sig = inspect.signature(module.forward)
    if "output_attentions" in sig.parameters:  # DeBERTa's returns None without it
        bound = sig.bind(*args, **kwargs)
        bound.arguments["output_attentions"] = True
        args, kwargs = bound.args, bound.kwargs
    from ctxmix.engine.attention import ctxmix_pass, every_row

    with torch.no_grad(), ctxmix_pass(rows=every_row()):
        out = module(*args, **kwargs)
    alpha = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if not isinstance(alpha, torch.Tensor) or alpha.dim() != 4:
        return None
    return alpha[0].to(model.work_dtype)  # the dtype the decompositions run in, as a stored trace's


class NotReplayable(RuntimeError):
    """An attention module that returns no probabilities when called again (the trace is then stored)."""


class ReplayedStates(Sequence):
    """The layer states of a streamed trace, rebuilt on demand (`layer_forward` on the layer input
    and the replayed attention probabilities). Holds L (n, d) layer inputs and the attention calls'
    inputs; the last layer built is kept, since consumers read several fields of one layer in a row.
    Each layer's reconstruction error is measured the first time it is built (against `targets`, the
    model's own hidden states), so no pass is spent on it. `map(fn)` gives the same states seen
    through fn (a batch-of-one view, a crop), sharing the cache and the errors."""

    def __init__(
        self, model: Model, hidden: list[torch.Tensor], calls: list, targets=None, base=None, view=None
    ) -> None:
        self.model, self.hidden, self.calls = model, hidden, calls  # hidden: L+1, the last the raw output
        self._targets: list[torch.Tensor] | None = targets
        self._errors: list[float | None] = [None] * len(calls)
        self._base: ReplayedStates | None = base
        self._view: Callable[[LayerState], LayerState] | None = view
        self._last: tuple[int, LayerState] | None = None

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, l):
        if isinstance(l, slice):
            return [self[i] for i in range(len(self))[l]]
        l = range(len(self))[l]
        if self._base is not None:
            assert self._view is not None
            return self._view(self._base[l])
        last = self._last  # read once: another thread reading this trace may replace it
        if last is not None and last[0] == l:
            return last[1]
        self._last = None  # free the previous layer first
        with torch.no_grad():  # under the process's own TF32 setting, never switched (`ctxmix.engine.precision`)
            st = self._build(l)
        if self._errors[l] is None and self._targets is not None:
            mine = st.y
            spec = self.model.spec
            if l == len(self) - 1 and spec.final_norm is not None and spec.hidden_after_final_norm:
                mine = self.model.layers[l].next_norm(mine)  # as in `_rebuild`: the model's is after the final norm
            self._errors[l] = float((mine - self._target(l)).abs().max())
        self._last = (l, st)
        return st

    def _build(self, l: int) -> LayerState:
        """Layer l rebuilt: its attention call replayed, then `layer_forward` on its input."""
        alpha = replayed_alpha(self.model, self.calls[l])
        if alpha is None:
            raise NotReplayable(f"layer {l}'s attention module returned no probabilities when called again")
        return layer_forward(self.model.layers[l], self.hidden[l], alpha)

    def _target(self, l: int) -> torch.Tensor:
        """The model's own output of layer l, which the rebuilt one is measured against."""
        assert self._targets is not None
        return self._targets[l + 1]

    def reconstruction_error(self) -> float:
        """The largest error of the rebuilt layers against the model's own states, over every layer."""
        if self._base is not None:
            return self._base.reconstruction_error()
        for l, e in enumerate(self._errors):
            if e is None:
                self[l]
        return max((e for e in self._errors if e is not None), default=0.0)

    def __iter__(self):
        return (self[l] for l in range(len(self)))

    def map(self, fn: Callable[[LayerState], LayerState]) -> ReplayedStates:
        if self._base is None:
            return ReplayedStates(self.model, self.hidden, self.calls, base=self, view=fn)
        inner = self._view
        assert inner is not None
        return ReplayedStates(self.model, self.hidden, self.calls, base=self._base, view=lambda st: fn(inner(st)))


def map_states(states, fn: Callable[[LayerState], LayerState]):
    """fn on every layer state: lazily for a streamed trace's, else a list."""
    return states.map(fn) if isinstance(states, ReplayedStates) else [fn(st) for st in states]
