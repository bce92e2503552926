"""The one progress helper: a tqdm bar on the terminal, silent when progress is off.

Long work (corpus analyses, the benchmark runner, building minilm-sentiment) reports through it;
the dashboard passes its own callback to the analyses instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# the reporter of the call running in this thread or task (`reporting`): never the model's, never process-wide
_REPORTER: ContextVar[Callable[[str, float], None] | None] = ContextVar("ctxmix_progress", default=None)


@contextmanager
def reporting(callback: Callable[[str, float], None]) -> Iterator[None]:
    """Within the block, the engine's long loops (the norm family and ALTI, value zeroing, the FF scopes: per layer
    and chunk) call callback(stage, fraction), fraction in (0, 1] of that stage. It is set for this thread or task
    only: another session's call on the same model reports nothing here (the dashboard's progress bars)."""
    token = _REPORTER.set(callback)
    try:
        yield
    finally:
        _REPORTER.reset(token)


def report(stage: str, done: float, total: float) -> None:
    """Tell the enclosing `reporting` block (if any) that `done` of `total` of `stage` is done."""
    callback = _REPORTER.get()
    if callback is not None and total > 0:
        callback(stage, min(1.0, done / total))


def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "it", leave: bool = True):
    """A tqdm bar (usable as a context manager); redrawn at most every 0.2 s on a terminal and every
    15 s when stderr is a log file, so logs stay short."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled,
        leave=leave,
        dynamic_ncols=True,
        mininterval=0.2 if sys.stderr.isatty() else 15.0,
    )
