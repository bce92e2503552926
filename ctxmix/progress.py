"""The one progress helper: a tqdm bar on the terminal, silent when progress is off.

Long work (corpus analyses, the benchmark runner, building minilm-sentiment) reports through it;
the dashboard passes its own callback to the analyses instead.
"""

from __future__ import annotations

import sys


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
