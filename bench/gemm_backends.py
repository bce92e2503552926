"""Which float32 product is fastest on this CPU at the engine's shapes: torch.mm (MKL's sgemm on x86 builds), MKL's
packed product, oneDNN's linear on the weight as nn.Linear stores it, and oneDNN's linear on a weight reordered
once. `ctxmix.engine.workspace.PACKER` picks MKL's packed product on Intel CPUs and oneDNN's on AMD CPUs from runs
of this table; run it on a new kind of CPU before changing that gate.

Shapes: value zeroing's and the scope maps' W_2 product (M rows of d' = 3,072 into d = 768, M = 1,408 at 64 tokens
on BERT-base), the rebuilt layer's W_1 and W_2 at 64 and 512 tokens, and a few tokens. Each backend runs in
interleaved rounds; the table has each one's median GFLOP/s and its ratio to torch.mm measured in the same rounds,
and the one-off cost of packing a weight.

    python bench/gemm_backends.py
    python bench/gemm_backends.py --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch
from perf_common import log, table_text

SHAPES = [  # (M, K, N, what)
    (1408, 3072, 768, "value zeroing's W_2, 22 zeroed tokens x 64 rows"),
    (1280, 3072, 768, "the same, 20 zeroed tokens"),
    (64, 768, 3072, "the rebuilt layer's W_1, 64 tokens"),
    (64, 3072, 768, "the rebuilt layer's W_2, 64 tokens"),
    (512, 768, 3072, "the rebuilt layer's W_1, 512 tokens"),
    (8, 3072, 768, "W_2, 8 rows"),
]


def backends() -> dict:
    """name -> (prepare(W (K, N), M) -> state, run(a, state) -> (M, N)); only those this torch has."""
    from ctxmix.engine import workspace

    out = {"torch.mm": (lambda W, M: W, lambda a, W: torch.mm(a, W))}
    if workspace.MKL_PACKING:
        out["MKL packed"] = (
            lambda W, M: (torch.ops.mkl._mkl_reorder_linear_weight(W.t().contiguous(), M), W),
            lambda a, s: torch.ops.mkl._mkl_linear(a, s[0], s[1].t(), None, a.shape[0]),
        )
    if workspace.ONEDNN_PACKING:
        out["oneDNN"] = (
            lambda W, M: W.t(),
            lambda a, Wt: torch.ops.mkldnn._linear_pointwise(a, Wt, None, "none", [], ""),
        )
        out["oneDNN packed"] = (
            lambda W, M: torch.ops.mkldnn._reorder_linear_weight(W.t().contiguous(), M),
            lambda a, p: torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], ""),
        )
    return out


def _seconds(run, a: torch.Tensor, state, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        run(a, state)
    return (time.perf_counter() - start) / reps


def measure(rounds: int) -> pd.DataFrame:
    from ctxmix.engine.workspace import PACKER, _cpu_vendor

    torch.manual_seed(0)
    rows = []
    ways = backends()
    for M, K, N, what in SHAPES:
        W = torch.randn(N, K).t() / K**0.5  # (K, N) as LayerWeights holds an nn.Linear's weight
        a = torch.randn(M, K)
        want = a.double() @ W.double()
        reps = max(1, int(2e9 / (2 * M * K * N)))  # about 2 GFLOP a timing
        states, runs, pack_ms = {}, {}, {}
        for name, (prepare, run) in ways.items():
            start = time.perf_counter()
            states[name] = prepare(W, M)
            pack_ms[name] = 1e3 * (time.perf_counter() - start)
            runs[name] = run
            err = float((runs[name](a, states[name]).double() - want).abs().max() / want.abs().max())
            if err > K * 2.0**-24:
                raise AssertionError(f"{name} at {M}x{K}x{N}: relative error {err:.1e} over K * 2^-24")
            for _ in range(2):
                runs[name](a, states[name])
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(ways)[::-1]
            for name in order:
                rates[name].append(2 * M * K * N / _seconds(runs[name], a, states[name], reps) / 1e9)
        base = statistics.median(rates["torch.mm"])
        for name in ways:
            rate = statistics.median(rates[name])
            rows.append(
                {
                    "shape (M x K x N)": f"{M} x {K} x {N}",
                    "what": what,
                    "backend": name,
                    "GFLOP/s (median)": round(rate, 1),
                    "/ torch.mm": round(rate / base, 3),
                    "pack, ms": "-" if name in ("torch.mm", "oneDNN") else round(pack_ms[name], 2),
                }
            )
    log(f"CPU vendor {_cpu_vendor() or 'unknown'}; Workspace.product packs with: {PACKER}")
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds per shape (default 8)")
    a = ap.parse_args()
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(table_text(measure(a.rounds)))


if __name__ == "__main__":
    main()
