"""The engine's arithmetic precision: "float32" (exact, the default), "tf32" or "bf16".

Only the large products of the decompositions change (pieces x W_1, value zeroing's FF
evaluations x W_2; see `ctxmix.engine.layer.big_matmul`); norms, LayerNorm statistics, activation
shares, cosines and normalisations stay in float32 (float64 where they always were). On a CPU
"tf32" is float32 and "bf16" rounds the operands of those products to bfloat16 and accumulates
in float32. TF32 is a process-wide switch in torch, so on CUDA every engine call holds one lock
and sets the switch for its own duration: one user's tf32 never leaks into another's float32 run.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from ctxmix.engine.layer import PRECISIONS
from ctxmix.errors import BadInput

_CUDA_LOCK = threading.RLock()


def check_precision(precision) -> str:
    """The precision name, or a BadInput naming the valid ones."""
    if precision not in PRECISIONS:
        raise BadInput(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def resolve_precision(model, precision: str | None) -> str:
    """A per-call precision, else the model's default (set by `load_model(..., precision=...)`)."""
    return check_precision(getattr(model, "precision", "float32") if precision is None else precision)


@contextmanager
def engine_precision(precision: str, device):
    """Run the enclosed engine work in `precision`. On CUDA: under a process-wide lock, with
    torch's TF32 matmul switch on only for "tf32" and restored afterwards. On CPU: nothing to set."""
    check_precision(precision)
    if torch.device(device).type != "cuda":
        yield
        return
    with _CUDA_LOCK:
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
