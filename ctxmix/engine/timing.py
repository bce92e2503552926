"""Timing work that may run on a GPU. CUDA kernels run asynchronously: `time.perf_counter` around a
block measures only the launches unless the block synchronises, and a synchronisation inside a
per-layer loop would stall the pipeline it measures. So on CUDA each timed span is a pair of CUDA
events recorded on the current stream, and their elapsed times are read once, after one
synchronisation, when the totals are asked for; on a CPU a span is two `time.perf_counter` readings."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Stopwatch:
    """Seconds per name, summed over the spans timed under it: `t = sw.mark()` ... `sw.add(t, "a", "b")`
    adds the span from t to now to both "a" and "b" (`with sw.time("a"):` is the same around a block);
    `seconds()` reads the totals."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._spans: dict[str, list] = defaultdict(list)  # name -> [(start, end)]

    def mark(self):
        """Now: a recorded CUDA event on CUDA, perf_counter's seconds on a CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start, *names: str) -> None:
        """Add the span from `start` (a `mark()`) to now to each of `names`."""
        end = self.mark()
        for name in names:
            self._spans[name].append((start, end))

    @contextmanager
    def time(self, *names: str) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            self.add(start, *names)

    def seconds(self) -> dict[str, float]:
        """{name: seconds}; on CUDA, waits for the timed work once (and only here)."""
        if not self.cuda:
            return {name: sum(e - s for s, e in spans) for name, spans in self._spans.items()}
        if self._spans:
            torch.cuda.synchronize(self.device)
        return {name: sum(s.elapsed_time(e) for s, e in spans) / 1000.0 for name, spans in self._spans.items()}
