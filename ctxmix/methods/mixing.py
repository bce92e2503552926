"""The context-mixing methods: a registry, rollout, and chunked per-layer computation.

Every method gives per-layer maps (L, n, n), row i = output token, column j = input token,
and aggregated maps (L, n, n) by rollout. Methods that share a decomposition are computed
together from one trace (`compute_maps`), so asking for all of them costs about as much as
the most expensive one.
"""

from __future__ import annotations

import numpy as np
import torch

from ctxmix.engine.budget import card_elements, chunk_elements, chunk_rows, memory_budget
from ctxmix.engine.layer import (
    first_receiving_rows,
    head_vectors,
    norm_family_row_maps,
    scope_pieces,
    value_zeroing_columns,
    value_zeroing_prepare,
)
from ctxmix.engine.precision import engine_precision
from ctxmix.engine.trace import Trace, TraceBatch
from ctxmix.engine.workspace import Workspace
from ctxmix.methods.registry import MIXING_METHODS, scope_names
from ctxmix.progress import report

# Elements of the largest (rows, n, width) tensor a chunk may hold; 2**25 float32 = 128 MiB.
CHUNK_ELEMENTS = 2**25


def clipped_rows_note(
    layer_maps: np.ndarray, global_maps: np.ndarray, tokens: list[str], what: str = "alti"
) -> str | None:
    """A warning when ALTI left rows all zero (every contribution clipped: the block's output is dominated by its
    bias, or its residual is cancelled by the attention), so that rollout rows reading them sum to less than one;
    None when every row is complete. layer_maps, global_maps (L, n, n)."""
    empty = np.argwhere(layer_maps.sum(-1) < 0.5)  # (layer, row) pairs: a row sums to one or to zero
    if not len(empty):
        return None
    where = ", ".join(f"layer {l + 1} {tokens[i]!r}" for l, i in empty[:4]) + (" ..." if len(empty) > 4 else "")
    least = float(global_maps[-1].sum(-1).min())
    return (
        f"{what}: {len(empty)} row(s) have every contribution clipped ({where}); they are zero, so the mass that "
        f"reaches them is attributed to no token and rollout rows sum to as little as {least:.3f}"
    )


def rollout(maps: np.ndarray, add_identity: bool = False, row_normalise: bool = False) -> np.ndarray:
    """Aggregate per-layer maps (L, n, n): R^1 = M^1, R^l = M^l R^{l-1} (newest layer left), float64.

    add_identity: use 0.5*M + 0.5*I (Abnar & Zuidema; for maps without a residual).
    row_normalise: divide each layer's rows by their sums first (ALTI's norm rollout);
    GlobEnc's code does not, and that changes the result, so the default is off.
    """
    M = np.asarray(maps, dtype=np.float64)
    if M.ndim != 3 or M.shape[1] != M.shape[2]:
        raise ValueError(f"rollout needs maps of shape (L, n, n), got {M.shape}")
    return rollout_tensor(torch.from_numpy(M), add_identity, row_normalise).numpy()


def rollout_tensor(maps: torch.Tensor, add_identity: bool = False, row_normalise: bool = False) -> torch.Tensor:
    """`rollout` on the maps' own device: (L, n, n) -> (L, n, n) float64 there (L n^3 FLOPs: 4.4 TFLOP at
    4k tokens and 12 layers, which the device does and the host need not receive first).

    Float64, as the host rollout was: the maps' products are the exact aggregation, and n roundings
    per layer of a float32 product would move rows of a 4k-token rollout by ~n L 2^-24. On this
    project's CPU float64 products ran as fast as float32 ones at n = 512, L = 12 (docs/performance.md);
    cards without fast float64 run it at their float64 rate, still without the host round trip."""
    if maps.dim() != 3 or maps.shape[1] != maps.shape[2]:
        raise ValueError(f"rollout needs maps of shape (L, n, n), got {tuple(maps.shape)}")
    eye = torch.eye(maps.shape[-1], dtype=torch.float64, device=maps.device) if add_identity else None

    def layer(l: int) -> torch.Tensor:  # one layer prepared at a time: a long input's maps are not copied whole
        m = maps[l].to(torch.float64)
        if row_normalise:
            m = m / m.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
        return 0.5 * m + 0.5 * eye if eye is not None else m

    out = torch.empty(maps.shape, dtype=torch.float64, device=maps.device)
    out[0] = layer(0)
    for l in range(1, len(maps)):
        torch.matmul(layer(l), out[l - 1], out=out[l])
    return out


def _chunks(n: int, width: int, copies: int = 4, batch: int = 1, device="cpu") -> list[torch.Tensor]:
    """Row index chunks so that a (batch, rows, n, width) tensor times `copies` stays in budget, with
    several rows per chunk on a card where it holds them (`chunk_rows`)."""
    size = chunk_rows(n, width, copies, batch, chunk_elements(device, CHUNK_ELEMENTS), card_elements(device))
    if n > 0:  # as many chunks, of even sizes: no thin last chunk (a slow product)
        size = -(-n // -(-n // max(1, size)))
    return [torch.arange(i, min(n, i + size)) for i in range(0, n, size)]


MIN_ROWS = 16  # fewest output rows per chunk before the batch is split instead


def _tick(stage: str, layer: int, layers: int, part: int, parts: int, chunk: int, chunks: int) -> None:
    """Progress (`ctxmix.progress.report`) as a chunk of a part of a layer starts: the work before it is done."""
    report(stage, layer + (part + chunk / max(1, chunks)) / max(1, parts), layers)


def _sub_batches(B: int, n: int, width: int, copies: int, device) -> list[slice]:
    """Split a batch so that each part gets chunks of at least MIN_ROWS rows (or all n): every row
    chunk re-reads the per-layer products of its whole part (B x n x H x d'), so many thin chunks
    of a big batch cost more than a few thick chunks of a smaller one."""
    per_seq = n * width * copies * min(n, MIN_ROWS)
    size = max(1, min(B, chunk_elements(device, CHUNK_ELEMENTS) // max(1, per_seq)))
    return [slice(i, min(B, i + size)) for i in range(0, B, size)]


def _norms(F: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    if keep is not None:
        F = F[..., keep]
    return F.norm(dim=-1)


def _ff_width(lw) -> int:
    return (lw.W1 if lw.W1 is not None else lw.Wg).shape[1]


def _crop(maps: torch.Tensor, tb: TraceBatch) -> torch.Tensor:
    """Zero the padded rows and columns of batched maps (B, ..., n, n) (padded rows hold values of
    no real token; padded columns are exactly zero already)."""
    if tb.B == 1:
        return maps
    m = tb.mask.to(maps.device)
    keep = m[:, :, None] & m[:, None, :]
    return maps * keep.view(tb.B, *[1] * (maps.dim() - 3), tb.n, tb.n)


def map_buffer(tb: TraceBatch, dtype: torch.dtype, *middle: int) -> torch.Tensor:
    """Zeros (B, L, *middle, n, n) for per-layer maps: on the device in `dtype`, or, for a streamed
    trace (a long input), on the host in float64, filled layer by layer, so that the maps returned
    are the only L n^2 arrays held (no device copy, no float32 copy)."""
    shape = (tb.B, tb.model.n_layers, *middle, tb.n, tb.n)
    if tb.streamed:
        return torch.zeros(shape, dtype=torch.float64)
    return torch.zeros(shape, dtype=dtype, device=tb.states[0].x.device)


def layer_targets(dests: dict[str, torch.Tensor], dev) -> dict[str, torch.Tensor]:
    """Where one layer's chunks are written, {name: (B, ..., n, n)}: the maps' own layer (maps on the
    device), or, for maps on the host (a streamed trace) computed on another device, zeros on that
    device copied back once per layer by `flush_layer`: one transfer per layer instead of a host sync per
    chunk. Only while the layer's buffers fit a quarter of the memory budget; past that, per chunk."""
    dev = torch.device(dev)
    if all(t.device == dev for t in dests.values()):
        return dests
    size = sum(t.numel() * t.element_size() for t in dests.values())
    if size > memory_budget(dev) // 4:
        return dests
    return {k: torch.zeros(t.shape, dtype=t.dtype, device=dev) for k, t in dests.items()}


def flush_layer(dests: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    """Copy the layer buffers of `layer_targets` into the maps (nothing when they are the maps)."""
    for k, t in targets.items():
        if t is not dests[k]:
            dests[k].copy_(t)


def _span(rows: torch.Tensor) -> slice:
    """A chunk of consecutive indices as a slice (writes into a host buffer from any device)."""
    return slice(int(rows[0]), int(rows[-1]) + 1)


def _numpy(maps: torch.Tensor) -> np.ndarray:
    """A batch of one's maps (1, L, n, n) as float64 numpy (L, n, n)."""
    return maps[0].double().cpu().numpy()


@torch.no_grad()
def scope_maps_batch(
    tb: TraceBatch,
    res2: str = "exact",
    keep_dims: list | None = None,
    next_ln: bool = False,
    factorised: bool = True,
    precision: str = "float32",
    check: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-layer scope maps of a batch {scope: (B, L, n, n)} on the model's device, padding zeroed:
    cell = ||F_i(x_j)||_2 of the exact pieces. One decomposition per layer and row chunk for the
    whole batch; nothing leaves the device.

    keep_dims: per layer a boolean (d,) mask of the dimensions that enter the norm (the FF
    paper's outlier ablation drops the lowest-gamma 1 %), or None for all dimensions.
    check: also check each scope's pieces plus bias against the real vector they decompose; the
    largest error of each sequence's real rows joins `tb.errors` (an Explanation's
    `reconstruction_error` then covers the decompositions it computed). Off in the corpus loops,
    which report no per-sequence error: it costs one more pass over the pieces.
    """
    model = tb.model
    names = list(scope_names(model.spec.position))
    if next_ln and model.spec.position == "pre":
        names.append("AtbLnFfResLn")
    if next_ln and model.spec.position == "parallel":
        names.append("AtbFfResLn")
    if next_ln and model.spec.position == "sandwich":
        names.append("AtbLnFfLnResLn")
    B, n = tb.B, tb.n
    dev = tb.states[0].x.device
    maps = {s: map_buffer(tb, tb.states[0].x.dtype) for s in names}
    work = Workspace()  # this call's temporaries, reused by every chunk of every layer
    with engine_precision(precision, dev):
        for l, (lw, st_all) in enumerate(zip(model.layers, tb.states)):
            keep = None if keep_dims is None else keep_dims[l]
            dests = {s: v[:, l] for s, v in maps.items()}
            out = layer_targets(dests, dev)
            parts = _sub_batches(B, n, _ff_width(lw), 6, dev)
            for p, part in enumerate(parts):
                st = st_all.sub_batch(part)
                cache: dict = {}  # per-layer products shared by the row chunks
                chunks = _chunks(n, _ff_width(lw), copies=6, batch=st.x.shape[0], device=dev)  # as value zeroing's
                for k, rows in enumerate(chunks):
                    _tick("FF scopes", l, len(tb.states), p, len(parts), k, len(chunks))
                    rows_d = rows.to(dev)
                    pieces = scope_pieces(
                        lw,
                        st,
                        rows_d,
                        res2=res2,
                        next_ln=next_ln,
                        cache=cache,
                        factorised=factorised,
                        precision=precision,
                        work=work,
                    )
                    real = _scope_targets(lw, st, rows_d) if check and res2 == "exact" else {}
                    real_rows = tb.mask[part][:, rows_d]
                    for s, (F, b) in pieces.items():
                        if s in out:
                            out[s][part, _span(rows)] = _norms(F, keep).to(out[s])
                        if real.get(s) is not None:
                            err = (F.sum(2) + b - real[s]).abs().amax(-1).double()
                            err = torch.where(real_rows, err, 0).amax(-1)
                            tb.errors[part] = torch.maximum(tb.errors[part], err.to(tb.errors.device))
            flush_layer(dests, out)
    report("FF scopes", 1, 1)
    return {s: _crop(v, tb) for s, v in maps.items()}


def _scope_targets(lw, st, rows: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The real vector each scope decomposes, for output rows `rows` (B, c, d)."""
    if lw.position == "post":
        return {"Atb": st.z[:, rows], "AtbFf": st.ff[:, rows], "AtbFfRes": st.r2[:, rows], "AtbFfResLn": st.y[:, rows]}
    if lw.position == "sandwich":
        return {
            "Atb": st.r1[:, rows],
            "AtbLn": st.z[:, rows],
            "AtbLnFf": st.ff[:, rows],
            "AtbLnFfLn": lw.post_ff_norm(st.ff[:, rows]),
            "AtbLnFfLnRes": st.y[:, rows],
            "AtbLnFfLnResLn": None if lw.next_norm is None else lw.next_norm(st.y[:, rows]),
        }
    if lw.position == "parallel":
        return {
            "Atb": st.attn[:, rows],
            "AtbFf": (st.attn + st.ff)[:, rows],
            "AtbFfRes": st.y[:, rows],
            "AtbFfResLn": None if lw.next_norm is None else lw.next_norm(st.y[:, rows]),
        }
    return {
        "Atb": st.r1[:, rows],
        "AtbLn": st.z[:, rows],
        "AtbLnFf": st.ff[:, rows],
        "AtbLnFfRes": st.y[:, rows],
        "AtbLnFfResLn": None if lw.next_norm is None else lw.next_norm(st.y[:, rows]),
    }


def scope_layer_maps(
    tr: Trace,
    res2: str = "exact",
    keep_dims: list | None = None,
    next_ln: bool = False,
    factorised: bool = True,
    precision: str = "float32",
) -> dict[str, np.ndarray]:
    """Per-layer scope maps of one sequence {scope: (L, n, n)} as float64 numpy (see scope_maps_batch)."""
    maps = scope_maps_batch(TraceBatch.of(tr), res2, keep_dims, next_ln, factorised, precision)
    return {s: _numpy(v) for s, v in maps.items()}


@torch.no_grad()
def norm_maps_batch(tb: TraceBatch, names: list[str]) -> dict[str, torch.Tensor]:
    """GlobEnc's N family and ALTI per layer, {name: (B, L, n, n)} on the device, padding zeroed."""
    model = tb.model
    B, n = tb.B, tb.n
    dev = tb.states[0].x.device
    maps = {m: map_buffer(tb, torch.promote_types(tb.states[0].x.dtype, torch.float32)) for m in names}
    causal = model.spec.causal
    stage = "ALTI and the norm family" if "alti" in names else "the norm family"
    for l, (lw, st_all) in enumerate(zip(model.layers, tb.states)):
        d = st_all.x.shape[-1]
        dests = {m: v[:, l] for m, v in maps.items()}
        out = layer_targets(dests, dev)
        parts = _sub_batches(B, n, d, 6, dev)
        for p, part in enumerate(parts):
            st = st_all.sub_batch(part)
            f = head_vectors(lw, st.x if lw.position == "post" else st.x1, with_bias=True)  # once per layer
            chunks = _chunks(n, d, copies=6, batch=st.x.shape[0], device=dev)
            for k, rows in enumerate(chunks):
                _tick(stage, l, len(tb.states), p, len(parts), k, len(chunks))
                rows_d = rows.to(dev)
                J = int(rows[-1]) + 1 if causal else n  # later columns are zero in a causal model's rows
                for m, v in norm_family_row_maps(lw, st, rows_d, names, f, J).items():
                    out[m][part, _span(rows), :J] = v.to(out[m])
            del f  # before the next layer's: two layers' head vectors (n x H x d each) are never alive at once
        flush_layer(dests, out)
    report(stage, 1, 1)
    return {m: _crop(v, tb) for m, v in maps.items()}


def norm_layer_maps(tr: Trace, names: list[str]) -> dict[str, np.ndarray]:
    """GlobEnc's N family and ALTI, per layer, from one shared decomposition per chunk."""
    return {m: _numpy(v) for m, v in norm_maps_batch(TraceBatch.of(tr), names).items()}


@torch.no_grad()
def value_zeroing_maps_batch(tb: TraceBatch, factorised: bool = True, precision: str = "float32") -> torch.Tensor:
    """Row-normalised value-zeroing maps (B, L, n, n) in float64 on the device, one batched layer
    call per chunk of zeroed tokens for the whole batch; `factorised=False` applies the FF input
    projection to every perturbed vector."""
    model = tb.model
    B, n = tb.B, tb.n
    dev = tb.states[0].x.device
    out = map_buffer(tb, torch.float64)
    work = Workspace()  # this call's temporaries, reused by every chunk of every layer
    with engine_precision(precision, dev):
        for l, (lw, st_all) in enumerate(zip(model.layers, tb.states)):
            dests = {"vz": out[:, l]}
            vz = layer_targets(dests, dev)["vz"]
            parts = _sub_batches(B, n, _ff_width(lw), 6, dev)
            for p, part in enumerate(parts):
                st = st_all.sub_batch(part)
                prep = None  # the previous part's products go before this part's are made
                prep = value_zeroing_prepare(lw, st, precision) if factorised else None
                first_rows = first_receiving_rows(st.alpha)  # one host read per layer, none per chunk
                # copies=6 (as for the scopes): smaller chunks keep the (B, c, n, d') temporaries nearer the
                # cache, 5-20 % faster on CPU than chunks twice as large
                chunks = _chunks(n, _ff_width(lw), copies=6, batch=st.x.shape[0], device=dev)
                for k, cols in enumerate(chunks):
                    _tick("value zeroing", l, len(tb.states), p, len(parts), k, len(chunks))
                    first = min(first_rows[int(cols[0]) : int(cols[-1]) + 1])
                    D = value_zeroing_columns(lw, st, cols, prep, factorised, precision, first, work)
                    vz[part, :, _span(cols)] = D.transpose(1, 2).to(vz)
            layer = _crop(vz, tb)  # normalised one layer at a time: no second (B, L, n, n) copy
            s = layer.sum(-1, keepdim=True)
            vz.copy_(layer / torch.where(s > 0, s, torch.ones_like(s)))
            flush_layer(dests, {"vz": vz})
    report("value zeroing", 1, 1)
    return out


def value_zeroing_maps(tr: Trace, factorised: bool = True, precision: str = "float32") -> np.ndarray:
    """Row-normalised value-zeroing maps (L, n, n) of one sequence (see value_zeroing_maps_batch)."""
    return _numpy(value_zeroing_maps_batch(TraceBatch.of(tr), factorised, precision))


@torch.no_grad()
def attention_maps_batch(tb: TraceBatch) -> torch.Tensor:
    """Head-mean attention probabilities (B, L, n, n) in float64 (on the host for a streamed trace),
    padding zeroed."""
    out = map_buffer(tb, torch.float64)
    for l, st in enumerate(tb.states):
        out[:, l] = _crop(st.alpha.double().mean(1), tb).to(out)
    return out


def attention_maps(tr: Trace) -> np.ndarray:
    """Head-mean attention probabilities (L, n, n)."""
    return _numpy(attention_maps_batch(TraceBatch.of(tr)))


@torch.no_grad()
def head_maps_batch(tb: TraceBatch, methods: list[str]) -> dict[str, torch.Tensor]:
    """Per-head maps {method: (B, L, H, n, n)} in float64 for the methods with a per-head form
    (PER_HEAD_METHODS; see each MethodInfo.per_head). Norm per head is alpha^h_ij ||f^h(x_j)||:
    alpha is a non-negative scalar, so the norm of head h's piece needs no n^2 x d tensor."""
    want: list[str] = [m for m in ("attention", "norm") if m in methods]
    H = tb.model.n_heads
    out = {m: map_buffer(tb, torch.float64, H) for m in want}
    for l, (lw, st) in enumerate(zip(tb.model.layers, tb.states)):
        if "attention" in out:
            out["attention"][:, l] = _crop(st.alpha.double(), tb).to(out["attention"])
        if "norm" in out:
            src = st.x if lw.position == "post" else st.x1
            f = head_vectors(lw, src, with_bias=True).double()  # (B, H, n, d)
            if lw.position == "sandwich":  # N is what the block adds: LNa's share of each head's vector
                na = lw.post_attn_norm
                f = (f - f.mean(-1, keepdim=True) if na.kind == "layernorm" else f) * na.gamma.double()
                per = st.alpha.double() * f.norm(dim=-1)[:, :, None, :] / na.scale(st.attn).double()[:, None]
            else:
                per = st.alpha.double() * f.norm(dim=-1)[:, :, None, :]
            out["norm"][:, l] = _crop(per, tb).to(out["norm"])
    return out


def mixing_maps_batch(
    tb: TraceBatch, methods: list[str], res2: str = "exact", precision: str = "float32"
) -> dict[str, torch.Tensor]:
    """Per-layer maps {method: (B, L, n, n)} on the device for the mixing methods among `methods`;
    methods that share a decomposition share one computation."""
    want = [m for m in methods if m in MIXING_METHODS]
    layer: dict[str, torch.Tensor] = {}
    if {"attention", "attention_rollout"} & set(want):
        A = attention_maps_batch(tb)
        layer["attention"] = A
        eye = torch.eye(tb.n, dtype=A.dtype, device=A.device) * tb.mask.to(A.device)[:, None, :, None]
        layer["attention_rollout"] = 0.5 * A + 0.5 * eye
    norm_names = [m for m in want if MIXING_METHODS[m].group == "norm"]
    if norm_names:
        layer.update(norm_maps_batch(tb, norm_names))
    if "value_zeroing" in want:
        layer["value_zeroing"] = value_zeroing_maps_batch(tb, precision=precision)
    if any(MIXING_METHODS[m].group == "scope" for m in want):
        layer.update(scope_maps_batch(tb, res2=res2, precision=precision, check=True))
    return {m: layer[m] for m in want}


def compute_maps(
    tr: Trace, methods: list[str], res2: str = "exact", precision: str = "float32"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{method: (layer maps, aggregated maps)} for the mixing methods among `methods`, one sequence."""
    res: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for m, maps in mixing_maps_batch(TraceBatch.of(tr), methods, res2, precision).items():
        # attention_rollout's layer map already holds 0.5*A + 0.5*I
        gm = rollout_tensor(maps[0], row_normalise=MIXING_METHODS[m].rollout_normalise)
        res[m] = (_numpy(maps), gm.cpu().numpy())
    return res
