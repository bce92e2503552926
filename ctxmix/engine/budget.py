"""How much memory the engine may use, and the batch sizes that follow from it.

The budget on CUDA is min(free device memory + what torch's allocator holds unused,
per-process fraction x total - what is allocated), so `torch.cuda.set_per_process_memory_fraction`
(a small card simulated on a big one) is honoured, which `mem_get_info` alone ignores. Concurrent
engine jobs of one process share it (`job_slot`). On a CPU it is a quarter of the available
memory, at most 4 GiB.

`keep_cpu_buffers` is the opt-in for whole programs (the CLI, the benchmark runner, bench/) that lets glibc
keep the chunks' freed temporaries instead of returning them to the system.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

_ACTIVE = 0
_LOCK = threading.Lock()

CPU_MAX_BYTES = 4 * 2**30
CPU_MAX_BATCH = 8  # sequences per batch on a CPU: larger batches hold more states for no speed
CUDA_MAX_BATCH = 64


@contextmanager
def job_slot():
    """Count this engine job among the concurrent ones that share the memory budget."""
    global _ACTIVE
    with _LOCK:
        _ACTIVE += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE -= 1


def _meminfo(field: str, default: int) -> int:
    """A field of /proc/meminfo in bytes (`default` where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return default


def _cpu_available() -> int:
    return _meminfo("MemAvailable", 8 * 2**30)


def cpu_total() -> int:
    """The host's memory (MemTotal)."""
    return _meminfo("MemTotal", _cpu_available())


def memory_budget(device) -> int:
    """Bytes one engine job may use on `device` now (shared among the concurrent jobs)."""
    dev = torch.device(device)
    share = max(1, _ACTIVE)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        cached = torch.cuda.memory_reserved(dev) - allocated
        frac = torch.cuda.get_per_process_memory_fraction(dev)
        budget = min(free + cached, int(frac * total) - allocated)
        return max(0, budget) // share
    return min(CPU_MAX_BYTES, _cpu_available() // 4) // share


def sequence_bytes(model, n: int, n_maps: int = 6) -> int:
    """Memory one sequence of n tokens holds during a corpus pass (`ctxmix.engine.memory`): its traced layer
    states (`trace_states_bytes`: 8 vectors of width d and 2 of width d' per token, H x n x n attention per
    layer) and `n_maps` float64 maps per layer with their ranks and sort indices."""
    from ctxmix.engine.memory import maps_bytes, trace_states_bytes, widths_of

    W = widths_of(model)
    return trace_states_bytes(W, n) + maps_bytes(W, n, 3 * n_maps)


def batch_size_for(model, n: int, max_batch: int | None = None, budget: int | None = None) -> int:
    """Sequences of up to n tokens per batch: as many as half the budget holds (the other half is
    for the chunked decompositions), at least 1, at most `max_batch`."""
    dev = torch.device(model.device)
    if max_batch is None:
        max_batch = CUDA_MAX_BATCH if dev.type == "cuda" else CPU_MAX_BATCH
    budget = memory_budget(dev) if budget is None else budget
    return int(max(1, min(max_batch, (budget // 2) // max(1, sequence_bytes(model, n)))))


ROUTES_CHUNK_ELEMENTS = 1 << 24  # elements of one chunk of routes' (targets x sources x heads x d) temporaries, CPU
MIN_CHUNK_ROWS = 8  # on a card, rows per chunk before the products fall back to matrix-vector shape


def card_elements(device) -> int | None:
    """A CUDA card's per-process share in float32 words (None off CUDA): fixed per card, not read from
    free memory, because chunking changes GEMM shapes and so float rounding, and a resumed benchmark
    must repeat its numbers."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(dev).total_memory
    return int(torch.cuda.get_per_process_memory_fraction(dev) * total) // 4


def chunk_elements(device, default: int) -> int:
    """Elements of the temporaries of one chunk of a decomposition: `default` on a CPU (sized to
    stay near the cache); on CUDA 1/64 of the card's per-process share in float32 words, so that
    fewer, larger products keep the GPU busy (see `card_elements`)."""
    card = card_elements(device)
    return default if card is None else max(default, card // 64)


def chunk_rows(n: int, width: int, copies: int, batch: int, elements: int, card: int | None = None) -> int:
    """Output rows per chunk of a decomposition whose temporaries hold about batch x rows x n x width x
    copies words: as many as `elements` (`chunk_elements`) allow, at least 1, at most n. On a card
    (`card`: its share in float32 words, `card_elements`) at least MIN_CHUNK_ROWS while their
    temporaries fit a quarter of it: at a wide FF (d' = 14336) and thousands of tokens 1/64 of the card
    holds less than one row, and one-row chunks turn every product into a matrix-vector one that
    re-reads the layer's per-head projections (n x H x d') for each row."""
    per_row = max(1, batch * n * width * copies)
    rows = elements // per_row
    if card is not None:
        rows = max(rows, min(MIN_CHUNK_ROWS, card // 4 // per_row))
    return int(max(1, min(n, rows)))


_ALLOCATOR_TUNED = False


def keep_cpu_buffers() -> bool:
    """Let glibc keep freed blocks of up to 32 MB in the heap instead of returning them to the
    system, once per process (set CTXMIX_MALLOC_TUNING=0 to leave malloc alone). An explicit
    opt-in of whole programs that own their process (the CLI, the benchmark runner, bench/):
    loading a model never changes the malloc settings of a notebook or a server that imports ctxmix.

    The chunked n^2 paths allocate and free (c, n, d') temporaries of up to 22 MB per chunk;
    with glibc's defaults each is a fresh mmap whose pages fault in on first touch, which cost
    15-25 % of value zeroing's time on a 2-core virtual machine. Peak memory is unchanged (the
    chunks bound it); only the release of freed memory to the system is deferred.
    Returns whether the settings were applied (False off glibc)."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or os.environ.get("CTXMIX_MALLOC_TUNING", "1") == "0":
        return _ALLOCATOR_TUNED
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # from malloc.h
        ok = (
            libc.mallopt(m_mmap_threshold, 32 * 2**20) == 1  # glibc's largest allowed value
            and libc.mallopt(m_trim_threshold, 2**30) == 1
            and libc.mallopt(m_top_pad, 64 * 2**20) == 1
        )
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        ok = False
    _ALLOCATOR_TUNED = ok
    return ok
