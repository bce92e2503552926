"""Which attention implementation a forward pass runs: eager for the passes that read every row's
probabilities, blocks of rows for the pass that reads a few, the model's memory-efficient one for the passes
that need only outputs.

ctxmix loads every model with eager attention, because its full traces read the n x n probabilities that eager
returns. Eager holds ~8 bytes x heads x n^2 per layer while it runs (matmul, mask, float32 softmax, cast):
4.3 GB at 4,096 tokens on an 8B model. Passes that never read the probabilities (ContextCite's and
leave-one-out's ablations, `evaluate`'s held-out ablations, AT2's training labels, generation, long gradient
passes) run inside `output_only(model)` with the implementation the user's model had before ctxmix switched
it (`Model.output_attention`: "sdpa" unless the user configured another, e.g. "flash_attention_2"), whose
kernels keep O(n) per head. The values are the same to float rounding: both compute softmax(q k^T * scale +
mask) v, in another order of operations. The rows trace (`ctxmix.engine.rows.trace_rows`: `logit`,
`attention`, `at2_exact`) switches to `ctxmix.engine.rows.ROWS_ATTENTION`, the family's own eager function
run over blocks of query rows, keeping the probabilities of the rows it explains: no n x n map per head,
eager's numbers.

Families whose attention the fast kernels cannot compute (Gemma 2's soft-capped logits: transformers marks it
`_supports_sdpa = False` and refuses the switch) stay eager for output-only passes; the rows implementation
takes them (it calls their eager function).

Thread safety: transformers 5 reads `config._attn_implementation` at every attention call and takes no
per-call choice, so the switch is model state. `attention_implementation` holds the model's lock for the
whole block (switched passes of one model run one at a time; other models are not held up), checks the
current implementation under it, and restores exactly the value it found. A trace of the same Model in
another thread during an output-only block would get no probabilities: it stops with an error ("returned no
attention weights"; the rows trace falls back to a full trace, which does), never with wrong numbers; during
a rows block it gets eager's (the rows implementation is exactly eager outside its own thread's trace).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from ctxmix.engine.models import Model

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF module -> its switch's lock
_LOCKS_LOCK = threading.Lock()


def _switch_lock(hf) -> threading.RLock:
    """The model's own lock (re-entrant: an output-only pass may run inside another switched block of the same
    thread); other models are not held up."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(hf)
        if lock is None:
            lock = _LOCKS[hf] = threading.RLock()
        return lock


def current_attention(model: Model) -> str:
    """The implementation the model's next forward pass runs ("eager" when unset)."""
    return getattr(model.hf.config, "_attn_implementation", None) or "eager"


@contextmanager
def attention_implementation(model: Model, impl: str) -> Iterator[str]:
    """The model's attention run as `impl` ("sdpa", "eager", ...) inside the block, the value found restored
    after it; yields the implementation really used (the one found when the class lacks `impl`)."""
    hf = model.hf
    with _switch_lock(hf):
        before = current_attention(model)
        if before == impl or not hasattr(hf, "set_attn_implementation"):
            yield before
            return
        try:
            hf.set_attn_implementation(impl)
        except (ValueError, ImportError, KeyError):  # a class without that implementation (soft-capping): as it is
            yield before
            return
        try:
            yield current_attention(model)
        finally:
            hf.set_attn_implementation(before)


@contextmanager
def output_only(model: Model) -> Iterator[str]:
    """A block of forward passes whose attention probabilities nobody reads: the model's memory-efficient
    attention (`Model.output_attention`) instead of eager. Yields the implementation used."""
    with attention_implementation(model, model.output_attention) as used:
        yield used


def accepts(hf, name: str) -> bool:
    """Whether the module's forward takes keyword `name` (e.g. `logits_to_keep`, `use_cache`)."""
    try:
        return name in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return False
