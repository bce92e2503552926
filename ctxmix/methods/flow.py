"""Attention flow (Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020).

The layered attention graph has a node (l, i) for every layer l = 0..L (0 = input tokens) and
position i, and an edge (l, i) -> (l-1, j) of capacity Â^l[i, j] = r·δ_ij + (1-r)·mean_h A^{l,h}[i, j]
(r = `residual`, 0.5 in the paper). The attention flow from node (l, i) to input token j is the
value of ONE maximum flow from (l, i) to (0, j), computed separately for every j, then normalised
over j (the paper's §3, "Attention flow"; the official code's `compute_flows`). One max-flow to a
super-sink joined to all the inputs is a different quantity (its total is 1, the per-pair flows
sum to more, and its per-sink shares are not unique): do not "optimise" the per-pair flows into one.

Cost: one row (one output position, all L layers) is L·n max-flows on graphs of up to L·n² edges:
n⁴-n⁵ in the worst case, about n³ measured up to 512 tokens (about 1 s at n=128 and a minute at
n≈460 for MiniLM's 6 layers, `flow_cost_seconds`); ctxmix computes only the rows asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_flow

from ctxmix.errors import BadInput

# Capacities (each <= 1) are scaled by FLOW_SCALE and rounded to integers for scipy's Dinic solver,
# which keeps capacities, per-edge flows and residuals in int32 (and starts its search at 2**31 - 1).
# A node's out-capacity is then at most FLOW_SCALE·(row sum) + (out-degree)/2: with rows of Â
# summing to 1 within ROW_SUM_TOL, 2**30 is the largest power of two that keeps it below
# 2**31 - 1 for any n < 2**29 (2**31 overflows already at row sum 1), so no flow value overflows.
FLOW_SCALE = 2**30
# Post-softmax rows sum to 1 up to rounding (bf16 attention: ~1e-3); anything further off is not
# an attention matrix (e.g. padding rows or un-normalised scores).
ROW_SUM_TOL = 1e-2

# One row (one position, all layers, L·n max-flows) on random softmax attention of MiniLM's shape
# (H=12, logits N(0, 1)), timed on this project's shared 2-core CPU (load ~2; scipy runs on one core):
#   L=6:  n=16 0.06 s, 32 0.07 s, 64 0.22 s, 128 1.1 s, 256 9.2 s, 384 30 s, 448 52 s, 512 88 s
#   L=12: n=64 1.0 s, 128 4.2 s, 256 41 s;  L=3: n=128 0.35 s, 256 2.5 s
# Below n=64 the per-call overhead dominates; least squares over n >= 128:
# seconds ≈ 4.7e-7 · n^3.04 · (L/6)^1.90 (every point within 0.88-1.2 of it). The local exponent grows
# with n (3.0 at 128-256, 3.8 at 448-512), towards the n⁴-n⁵ of the worst case.
_COST_C = 4.7e-7
_COST_EXP = 3.04
_COST_L_EXP = 1.90
FLOW_ROW_SECONDS = 60.0  # what "too slow" means for pages and the benchmark runner

# The paper defines and evaluates attention flow on encoders only, and warns (§5) that on decoders
# flow and rollout favour early tokens, asking for a normalisation "based on the receptive field"
# without a formula; ctxmix shows the raw values.
CAUSAL_CAVEAT = (
    "attention flow on a causal model: Abnar & Zuidema define and evaluate it on encoders only. Under a "
    "causal mask token i reaches only tokens 0..i, so flow (like rollout) is biased towards early tokens, "
    "the first ones most; the paper (§5) asks for a normalisation by the receptive field and gives no "
    "formula, so these are the raw values: compare tokens at similar positions, not early with late ones."
)


Progress = bool | Callable[[int, int], None] | None


def augmented_attention(attention: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """The flow graph's capacities Â^l = residual·I + (1 - residual)·mean_h A^{l,h}, float64 (L, n, n).

    attention: post-softmax weights (L, H, n, n) or already head-averaged (L, n, n); row i = query
    (output position), column j = key; rows must sum to 1 (within ROW_SUM_TOL: crop padding first).
    residual: weight of the identity (the paper's 0.5, a heuristic: identity and attention weighed
    equally), in [0, 1].

    The official code computes (Ā + I) / rowsum(Ā + I), which equals 0.5·Ā + 0.5·I exactly when the
    rows of Ā sum to 1 (post-softmax attention); this function uses the paper's formula and does not
    renormalise, so a row sum of 1 - ε stays 1 - ε(1 - residual).
    """
    A = _as_array(attention, "attention")
    if A.ndim not in (3, 4) or A.shape[-1] != A.shape[-2] or min(A.shape) < 1:
        raise BadInput(f"attention must have shape (L, H, n, n) or (L, n, n) with L, H, n >= 1, got {tuple(A.shape)}")
    if isinstance(residual, bool) or not isinstance(residual, (int, float, np.floating)):
        raise BadInput(f"residual must be a number in [0, 1], got {residual!r}")
    if not 0.0 <= float(residual) <= 1.0:
        raise BadInput(f"residual must be in [0, 1], got {residual}")
    if not np.isfinite(A).all():
        raise BadInput("attention holds NaN or infinite values")
    if (A < 0).any():
        raise BadInput(f"attention must be post-softmax weights (>= 0); its minimum is {A.min():.3g}")
    Abar = A.mean(1) if A.ndim == 4 else A
    dev = float(np.abs(Abar.sum(-1) - 1.0).max())
    if dev > ROW_SUM_TOL:
        raise BadInput(
            f"attention rows must sum to 1 (post-softmax, padding cropped); the furthest is off by {dev:.3g}"
        )
    r = float(residual)
    return r * np.eye(A.shape[-1]) + (1.0 - r) * Abar


def scaled_capacities(ahat: np.ndarray) -> np.ndarray:
    """Integer capacities round(FLOW_SCALE·Â), int32 (L, n, n); each is off by at most 0.5 / FLOW_SCALE."""
    caps = np.rint(np.asarray(ahat, dtype=np.float64) * FLOW_SCALE)
    if caps.size and caps.sum(-1).max() > np.iinfo(np.int32).max:  # a row far above 1: not from augmented_attention
        raise BadInput("capacities too large for int32 max-flow: rows of Â must sum to about 1")
    return caps.astype(np.int32)


def flow_graph(caps: np.ndarray, layer: int, position: int) -> tuple[csr_array, np.ndarray]:
    """The flow network seen from node (layer, position), and which input tokens it reaches.

    caps: integer capacities (L, n, n) (`scaled_capacities`); layer in 1..L. Node (l, i) has index
    l·n + i. Only layers <= `layer`, only nodes reachable from the source, and only positive capacities
    make edges: for causal attention (Â zero above the diagonal) the reachable positions are exactly
    0..position, so the graph shrinks to about layer·position²/2 edges. Returns the CSR matrix
    (((layer + 1)·n)², int32, sorted indices) and a boolean (n,) mask of the input tokens reached.
    """
    n = caps.shape[-1]
    reach = np.zeros(n, dtype=bool)
    reach[position] = True
    rows, cols, data = [], [], []
    for l in range(layer, 0, -1):  # top-down; reversed below so that node indices ascend
        block = caps[l - 1] * reach[:, None]  # only rows of reachable nodes
        i, j = np.nonzero(block)
        rows.append(l * n + i)
        cols.append((l - 1) * n + j)
        data.append(block[i, j])
        reach = np.zeros(n, dtype=bool)
        reach[j] = True
    r = np.concatenate(rows[::-1])
    c = np.concatenate(cols[::-1]).astype(np.int32)
    size = (layer + 1) * n
    indptr = np.zeros(size + 1, dtype=np.int32)
    np.cumsum(np.bincount(r, minlength=size), out=indptr[1:])
    graph = csr_array((np.concatenate(data[::-1]).astype(np.int32), c, indptr), shape=(size, size))
    graph.has_sorted_indices = True  # np.nonzero is row-major: columns ascend within each row
    return graph, reach


def max_flows(caps: np.ndarray, layer: int, position: int) -> np.ndarray:
    """Unnormalised max-flow values (n,) from node (layer, position) to every input token, float64.

    One scipy Dinic max-flow per input token on one shared graph (`flow_graph`); tokens the source
    cannot reach get 0 without a solve. Values are in units of 1 (divided by FLOW_SCALE).
    """
    graph, reached = flow_graph(caps, layer, position)
    source = layer * caps.shape[-1] + position
    out = np.zeros(caps.shape[-1])
    for j in np.flatnonzero(reached):
        out[j] = maximum_flow(graph, source, int(j), method="dinic").flow_value
    return out / FLOW_SCALE


def attention_flow(
    attention: np.ndarray,
    rows: Iterable[int] | None = None,
    *,
    residual: float = 0.5,
    layers: Iterable[int] | None = None,
    normalise: bool = True,
    progress: Progress = None,
) -> np.ndarray:
    """Attention flow (L, n, n): [l, i, j] = max-flow from node (layer l+1, position i) to input token j.

    attention: (L, H, n, n) post-softmax (rows = query) or head-averaged (L, n, n); see
    `augmented_attention` for the capacities and `residual`. Each value is ONE maximum flow per (source
    node, input token) pair in the graph of layers 1..l+1 (not a super-sink flow: see the module
    docstring), then, with normalise=True, each row is divided by its sum over j (the official code's
    normalisation). normalise=False returns the raw flows (each <= 1; many saturate at 1 in deep models,
    so ranks tie: report them beside the normalised ones). With rows summing to 1 every row of raw flows
    sums to at least 1 (the super-sink flow: pushing each node's inflow down in proportion to Â fits
    every capacity), so normalising never divides by 0.

    rows: the output positions i to compute (negative counts from the end); default None = every
    position. Entries of rows (and layers) not computed are NaN. By default ctxmix computes only the
    explained position's row, since the cost grows steeply in n (`flow_cost_seconds`, `check_flow_cost`).
    layers: output layer indices l (0-based, as the result's first axis) to compute; default all.
    progress: None/False (silent), True (a tqdm bar) or a callable(done, total) counting max-flows.

    Accuracy: scipy's max-flow needs integer capacities, so Â is scaled by FLOW_SCALE = 2**30 and
    rounded; each capacity is off by at most 0.5 / 2**30 ≈ 4.7e-10, so a max-flow value is off by at
    most (#edges of a minimum cut)·0.5 / 2**30 <= (#edges of the graph)·0.5 / 2**30 (`flow_error_bound`):
    for n = 128 and L = 12 (the top layer's 12·128² = 196,608 edges) that is 9.2e-5 a priori. Rounding
    errors are of both signs and rarely share one cut, so the errors seen against networkx are about
    1e-9 (tests/test_attention_flow.py). A normalised value (row sum >= 1) is off by at most (n + 1)
    times the raw bound.
    """
    ahat = augmented_attention(attention, residual)
    L, n, _ = ahat.shape
    pos = _indices(rows, n, "rows", "position")
    lays = _indices(layers, L, "layers", "layer")
    caps = scaled_capacities(ahat)
    out = np.full((L, n, n), np.nan)
    total = len(pos) * len(lays) * n
    done = 0
    bar = None
    if progress is True:
        from ctxmix.progress import progress_bar

        bar = progress_bar(total, "attention flow", unit="max-flow", leave=False)
    try:
        for l in lays:
            for i in pos:
                f = max_flows(caps, l + 1, i)
                if normalise:
                    s = f.sum()
                    f = f / s if s > 0 else f
                out[l, i] = f
                done += n
                if bar is not None:
                    bar.update(n)
                if callable(progress):
                    progress(done, total)
    finally:
        if bar is not None:
            bar.close()
    return out


def flow_warnings(causal: bool) -> list[str]:
    """The caveats an explanation by attention flow carries: the paper's one for causal models (its §5)."""
    return [CAUSAL_CAVEAT] if causal else []


def flow_error_bound(n: int, n_layers: int, causal: bool = False) -> float:
    """A priori bound on the error of one raw max-flow value from the top layer: (#edges)·0.5 / FLOW_SCALE,
    with L·n² edges (L·n(n+1)/2 for causal attention). n=128, L=12: 9.2e-5."""
    edges = n_layers * (n * (n + 1) // 2 if causal else n * n)
    return edges * 0.5 / FLOW_SCALE


def flow_cost_seconds(n: int, n_layers: int = 6) -> float:
    """Estimated seconds for one row (one position, all layers) of encoder attention flow on one core
    of the project's 2-core CPU (fit of the measurements beside _COST_C; causal rows cost less)."""
    return _COST_C * float(n) ** _COST_EXP * (n_layers / 6) ** _COST_L_EXP


def flow_max_tokens(n_layers: int = 6, seconds: float = FLOW_ROW_SECONDS) -> int:
    """The most tokens for which one row is estimated to take at most `seconds`."""
    return int(math.floor((seconds / (_COST_C * (n_layers / 6) ** _COST_L_EXP)) ** (1.0 / _COST_EXP)))


FLOW_ROW_MAX_TOKENS = flow_max_tokens(6)  # MiniLM's 6 layers, one minute per row


def check_flow_cost(n: int, n_layers: int, seconds: float = FLOW_ROW_SECONDS) -> None:
    """Refuse (BadInput) a row that would take longer than `seconds`, with a message for the user."""
    limit = flow_max_tokens(n_layers, seconds)
    if n > limit:
        est = flow_cost_seconds(n, n_layers)
        when = f"{est:.0f} seconds" if est < 90 else f"{est / 60:.{1 if est < 600 else 0}f} minutes"
        raise BadInput(
            f"attention flow on {n} tokens would take about {when} per row ({n_layers} layers); "
            f"it is limited to {limit} tokens here"
        )


# ----------------------------------------------------------------------------- helpers


def _as_array(x, what: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().float().cpu().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{what} must be an array of numbers ({e})") from None


def _indices(given: Iterable[int] | None, size: int, what: str, one: str) -> list[int]:
    """Validated indices in 0..size-1 (negative ones count from the end), in the order given, no repeats."""
    if given is None:
        return list(range(size))
    if isinstance(given, (int, np.integer)) and not isinstance(given, bool):
        given = [int(given)]
    out: list[int] = []
    for k in given:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise BadInput(f"{what} must hold whole numbers, got {k!r}")
        if not -size <= int(k) < size:
            raise BadInput(f"{one} {int(k)} is outside 0..{size - 1}")
        if int(k) % size not in out:
            out.append(int(k) % size)
    return out
