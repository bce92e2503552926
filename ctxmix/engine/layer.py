"""One Transformer layer recomputed from its weights, and its exact decompositions.
(Over 500 lines on purpose: every layer shape's forward pass and its decompositions stay side by
side, so a new shape is read and checked in one place.)

Shapes: B sequences, n tokens, d model width, d' FF width, H heads, dh head width. Rows i
index output tokens, columns j input tokens; "pieces" are tensors (B, c, n, d) holding, for a
chunk of c output rows of each sequence, the contribution vector of every input token j.

Everything is batch-first: a `LayerState` holds (B, n, ...) tensors of B right-padded
sequences, and one call decomposes the whole batch. Padding cannot leak into a real token's
pieces: padded keys get exactly zero attention, every norm and FF acts on one token at a time,
and padded rows are cropped by the caller. The functions also accept an unbatched state
((n, ...) tensors, as `Trace.states` holds) and then return unbatched pieces.

The attention probabilities come from the model's own eager forward pass; everything else
is recomputed here from `LayerWeights`, and `tests/test_reconstruction.py` checks that the
recomputation and every decomposition give back the hidden states the model computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ctxmix.engine.arch import LayerWeights
from ctxmix.engine.workspace import Workspace, act_into, linear

# ---------------------------------------------------------------- attention parts


def head_values(lw: LayerWeights, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """v^h(x_j) = x_j W_V^h [+ b_V^h] for every (query) head: x (..., n, d) -> (..., H, n, dh).

    Grouped-query attention (Hkv < H) shares each value head among H/Hkv query heads.
    """
    v = linear(x, lw.Wv, lw.bv if with_bias else None)
    v = v.view(*x.shape[:-1], lw.n_kv_heads, lw.head_dim)
    if lw.n_kv_heads != lw.n_heads:
        v = v.repeat_interleave(lw.n_heads // lw.n_kv_heads, dim=-2)
    return v.transpose(-3, -2)


def head_vectors(lw: LayerWeights, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """f^h(x_j) = (x_j W_V^h [+ b_V^h]) W_O^h for every head: x (..., n, d) -> (..., H, n, d)."""
    return values_through_heads(lw, head_values(lw, x, with_bias))


def values_through_heads(lw: LayerWeights, v: torch.Tensor) -> torch.Tensor:
    """v^h W_O^h for every head: v (..., H, n, dh) -> (..., H, n, d), a view of (..., n, H, d) storage.

    The per-chunk products (`mix_T`) read the head vectors in (j, h) order. Stored that way once per
    layer, `mix_T`'s contiguous operand is this storage itself; stored (h, j) it copied all n x H x d of
    them for every chunk of rows (537 MB per chunk at 1,024 tokens and Llama-3-8B's widths). One GEMM per
    head writes its (n, d) slice in place (BLAS takes the row stride H x d)."""
    Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)
    out = v.new_empty(*v.shape[:-3], v.shape[-2], lw.n_heads, Wo.shape[-1])  # (..., n, H, d)
    for h in range(lw.n_heads):
        torch.matmul(v[..., h, :, :], Wo[h], out=out[..., h, :])
    return out.transpose(-3, -2)


def ff_in_norm(lw: LayerWeights):
    """The norm whose output the FF reads: LN1 in post-LN layers, LN2 in pre-LN layers."""
    return lw.ln1 if lw.position == "post" else lw.ln2


def ff_input_projections(lw: LayerWeights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W, b) of the FF's input projections: [(W_1, b_1)], or [(W_g, b_g), (W_u, b_u)] when gated."""
    return [(lw.Wg, lw.bg), (lw.Wu, lw.bu)] if lw.gated else [(lw.W1, lw.b1)]


def head_ff_maps(lw: LayerWeights) -> list[torch.Tensor]:
    """Per FF input projection W, M^h = W_O^h C diag(gamma) W, (H, dh, d'): C centres (LayerNorm;
    identity for RMSNorm). A head vector's normalised share times W is then v^h M^h, so the
    factorised paths project the n*H head values (n*d*d' FLOPs) instead of the n*H head vectors
    (n*H*d*d'). Depends only on the weights: kept with them while one layer's maps are small
    (`HEAD_FF_CACHE_BYTES`), computed again per call otherwise (Llama-3-8B's would hold 470 MB a layer,
    15 GB for the model's life)."""
    norm = ff_in_norm(lw)

    def make() -> list[torch.Tensor]:
        Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)
        if norm.kind == "layernorm":
            Wo = Wo - Wo.mean(-1, keepdim=True)
        return [torch.matmul(Wo * norm.gamma, W) for W, _ in ff_input_projections(lw)]

    def small(maps: list[torch.Tensor]) -> bool:
        return sum(m.numel() * m.element_size() for m in maps) <= HEAD_FF_CACHE_BYTES

    return _kept(lw, "head_ff_maps", [lw.Wo, norm.gamma, *(W for W, _ in ff_input_projections(lw))], make, small)


def _kept(lw: LayerWeights, key: str, weights: list, make, keep=lambda value: True):
    """make(), a product of `weights` alone, kept in `lw.extra[key]` (when keep(value)) and served again while
    the same weights stand at the same versions (see `_weights_stamp`)."""
    stamp = _weights_stamp(weights)
    cached = lw.extra.get(key)
    if cached is not None and _same_weights(cached[0], stamp):
        return cached[1]
    value = make()
    if stamp is not None and keep(value):
        lw.extra[key] = (stamp, value)
    return value


def _weights_stamp(tensors: list[torch.Tensor | None]) -> tuple | None:
    """What tells a weight changed since a product of it was kept: each tensor itself (held: the layer holds it
    anyway) and its version counter, which an in-place edit moves (a notebook's ablation under torch.no_grad()).
    Edits through `.data` bypass the counter: `Model.weights_changed()` then drops what was kept. None for
    inference tensors, which have no counter: nothing is kept for them."""
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tuple((t, t._version) if t is not None else None for t in tensors)


def _same_weights(kept: tuple | None, now: tuple | None) -> bool:
    """Whether two stamps name the same tensors at the same versions."""
    if kept is None or now is None or len(kept) != len(now):
        return False
    return all(
        (a is None and b is None) or (a is not None and b is not None and a[0] is b[0] and a[1] == b[1])
        for a, b in zip(kept, now)
    )


HEAD_FF_CACHE_BYTES = 32 * 2**20  # one layer's head_ff_maps kept with its weights up to this size (BERT-base: 9 MB)


def project_heads(
    lw: LayerWeights, v: torch.Tensor, precision: str = "float32", contiguous: bool = True
) -> list[torch.Tensor]:
    """Each head value's normalised share (before 1/s) times each FF input projection:
    v (B, H, n, dh) -> [(B, n, H, d')], contiguous in (j, h) order for the per-chunk GEMMs; with
    `contiguous=False` a (j, h) view of the products' own (B, H, n, d') layout, for callers that take a few
    tokens' rows per chunk (a gather copies them anyway: no (n, H, d') copy of the whole)."""
    out = [big_matmul(v, M, precision).transpose(1, 2) for M in head_ff_maps(lw)]
    return [t.contiguous() for t in out] if contiguous else out


def value_bias_rows(lw: LayerWeights, ln_beta: torch.Tensor | None, alpha: torch.Tensor) -> torch.Tensor:
    """What each output row receives from the value bias (and, in pre-LN, from LN1's beta):
    sum_h (sum_j alpha^h_ij) (beta W_V^h + b_V^h) W_O^h, (B, c, d) for alpha (B, H, c, n).

    The weights of a row sum to one only up to the precision the model's softmax ran in
    (float32 even in float64 models of some families), so the sums are kept, not assumed."""
    base = ln_beta if ln_beta is not None else torch.zeros(lw.Wv.shape[0], dtype=lw.Wv.dtype, device=lw.Wv.device)
    per_head = head_vectors(lw, base[None], with_bias=True)[:, 0]  # (H, d)
    return torch.einsum("...hi,hd->...id", alpha.sum(-1), per_head)


def mix_T(alpha: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Attention-weighted pieces in (j, i) order: alpha (B, H, c, n), f (B, H, n, d) -> (B, n, c, d),
    sum over heads. One batched GEMM over (b, j) on contiguous operands: with strided operands (and
    with einsum) the same product runs 40x slower on CPU because the inner dimension is only H."""
    return torch.matmul(alpha.permute(0, 3, 2, 1).contiguous(), f.transpose(1, 2).contiguous())


def mix(alpha: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Attention-weighted pieces: alpha (B, H, c, n), f (B, H, n, d) -> (B, c, n, d), sum over heads."""
    return mix_T(alpha, f).transpose(1, 2)


# ---------------------------------------------------------------- precision

PRECISIONS = ("float32", "tf32", "bf16")


def big_matmul(
    a: torch.Tensor, W: torch.Tensor, precision: str = "float32", work: Workspace | None = None, name: str = "W"
) -> torch.Tensor:
    """a @ W for the large products (pieces x W_1, FF activations x W_2), in the engine's precision, set per call:
    nothing process-wide is switched (another session's float32 call is untouched).

    "float32" (and float64 models): a plain product in the operands' dtype. "tf32": on CUDA, three bfloat16
    products of the operands' split parts on the tensor cores, accumulated in float32 (`split_bf16_matmul`: about
    2^-16 relative per term, finer than TF32's 2^-11); on a CPU a plain float32 product. "bf16": both operands
    rounded to bfloat16, products accumulated in float32 (tensor cores on CUDA, oneDNN on CPU); the result comes
    back in the operands' dtype. Everything else (norms, LayerNorm statistics, activation shares, cosines) never
    goes through here. `work`: the call's `Workspace`, whose `product` packs W once for a CPU's MKL when the
    chunks of a layer multiply by the same W (under `name`), within float32 rounding of the plain product."""
    if precision == "tf32" and a.is_cuda and a.dtype == torch.float32 and W.dtype == torch.float32:
        return split_bf16_matmul(a, W)
    if precision != "bf16" or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        if work is not None and W.dim() == 2 and a.is_contiguous():
            return work.product(name, a.view(-1, a.shape[-1]), W).view(*a.shape[:-1], W.shape[-1])
        return torch.matmul(a, W)
    Wb = W.to(torch.bfloat16)
    ab = a.to(torch.bfloat16)
    if a.is_cuda and a.dim() >= 2 and W.dim() == 2:
        try:  # float32 output straight from the tensor cores' accumulator (torch >= 2.9, CUDA)
            out = torch.mm(ab.reshape(-1, ab.shape[-1]), Wb, out_dtype=torch.float32)
            return out.view(*a.shape[:-1], W.shape[-1]).to(a.dtype)
        except (RuntimeError, TypeError):
            pass
    return torch.matmul(ab, Wb).to(a.dtype)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = high + low + r, high and low bfloat16, |r| <= 2^-16 |x|."""
    high = x.to(torch.bfloat16)
    return high, (x - high.float()).to(torch.bfloat16)


def split_bf16_matmul(a: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """a @ W (float32) as a_h W_h + a_h W_l + a_l W_h, each part bfloat16 (`_split`), accumulated in float32: on
    CUDA on the tensor cores (torch.mm's float32 output); elsewhere as float32 products of the same bfloat16 values,
    which are exact (8 + 8 significant bits), so only the accumulation order differs. Each term's error is at most
    3 x 2^-16 of |a_i W_ij| (the split's remainders and the dropped a_l W_l) plus float32 accumulation:
    `ctxmix.engine.precision.split_product_bound`."""
    ah, al = _split(a.reshape(-1, a.shape[-1]))
    Wh, Wl = _split(W)
    if a.is_cuda:
        try:
            out = torch.mm(ah, Wh, out_dtype=torch.float32)
            out += torch.mm(ah, Wl, out_dtype=torch.float32)
            out += torch.mm(al, Wh, out_dtype=torch.float32)
            return out.view(*a.shape[:-1], W.shape[-1])
        except (RuntimeError, TypeError):
            pass
    ahf, Whf = ah.float(), Wh.float()
    out = ahf @ Whf
    out += ahf @ Wl.float()
    out += al.float() @ Whf
    return out.view(*a.shape[:-1], W.shape[-1])


# ---------------------------------------------------------------- FF closed forms


@lru_cache(maxsize=8)
def _gauss_legendre(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.legendre.leggauss(nodes)
    return (x + 1) / 2, w / 2  # on [0, 1]


def act_slope_at_zero(act) -> float:
    """g'(0) by a central difference in float64 (0.5 for GELU, gelu_new and SiLU; 0 or 0.5
    for ReLU, irrelevant there because all pieces of a zero pre-activation cancel)."""
    h = 1e-6
    x = torch.tensor([-h, h], dtype=torch.float64)
    y = act(x)
    return float((y[1] - y[0]) / (2 * h))


def ig_ratio(u: torch.Tensor, act) -> torch.Tensor:
    """r = g(u)/u: zero-baseline Integrated Gradients of g(sum of pieces) gives piece k the
    share x_k * g(u)/u exactly (ff-blocks notes §2.5), so no numeric integration is needed."""
    safe = torch.where(u == 0, torch.ones_like(u), u)
    return torch.where(u == 0, torch.full_like(u, act_slope_at_zero(act)), act(u) / safe)


def gated_ig_weights(g: torch.Tensor, act, nodes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-baseline IG of act(g) * u over pieces (g_j, u_j): piece j's share is
    g_j * u * I1(g) + u_j * I2(g) with I1 = int_0^1 a act'(a g) da, I2 = int_0^1 act(a g) da.

    Both integrals depend only on the totals, so one Gauss-Legendre rule per element does.
    I1 is taken from the identity g*I1 + I2 = act(g) where |g| > 1, which makes the shares
    sum to act(g) * u to rounding whatever the quadrature error; near 0 both come from the rule.
    """
    a_np, w_np = _gauss_legendre(nodes)
    a = torch.as_tensor(a_np, dtype=g.dtype, device=g.device)
    w = torch.as_tensor(w_np, dtype=g.dtype, device=g.device)
    I2 = torch.zeros_like(g)
    I1q = torch.zeros_like(g)
    for ak, wk in zip(a, w):
        ag = (ak * g).detach().requires_grad_(True)
        with torch.enable_grad():
            y = act(ag)
            (dy,) = torch.autograd.grad(y.sum(), ag)
        I2 = I2 + wk * y.detach()
        I1q = I1q + wk * ak * dy
    big = g.abs() > 1
    I1 = torch.where(big, (act(g) - I2) / torch.where(big, g, torch.ones_like(g)), I1q)
    return I1, I2


# ---------------------------------------------------------------- forward from weights


@dataclass
class LayerState:
    """The real intermediate vectors of one layer: (B, n, d) or (B, n, d') for a batch, (n, ...)
    for one sequence (`Trace.states`).

    post-LN: r1 = x + attn, z = LN1(r1), r2 = z + ff, y = LN2(r2)
    pre-LN:  x1 = LN1(x), h = x + attn(x1), z = LN2(h), y = h + ff
    parallel (GPT-NeoX, Phi-1/2): x1 = LN1(x), r1 = x + attn(x1), z = LN2(x), y = r1 + ff
    sandwich (Gemma 2/3): x1 = LN1(x), r1 = x + LNa(attn(x1)), z = LN2(r1), y = r1 + LNf(ff); `attn`
    and `ff` are the blocks' outputs before LNa and LNf
    `ff_in` is the vector the FF reads (z), `bypass` the vector RES2 adds around it.
    """

    x: torch.Tensor
    alpha: torch.Tensor  # (B, H, n, n)
    attn: torch.Tensor  # attention block output before RES1, incl. b_O
    r1: torch.Tensor  # after RES1 (post-LN: pre-LN1; pre-LN: the residual stream h)
    z: torch.Tensor  # FF input
    u: torch.Tensor  # FF pre-activation (gate pre-activation for gated FFs)
    u_up: torch.Tensor | None  # gated FFs: the up projection
    ff: torch.Tensor  # FF output incl. b_2
    r2: torch.Tensor  # after RES2
    y: torch.Tensor  # layer output
    x1: torch.Tensor | None = None  # pre-LN: LN1(x)

    @property
    def batched(self) -> bool:
        return self.x.dim() == 3

    def as_batch(self) -> LayerState:
        """This state with a leading batch dimension (views; a no-op when already batched)."""
        if self.batched:
            return self
        return LayerState(**{k: (None if v is None else v.unsqueeze(0)) for k, v in self.__dict__.items()})

    def sub_batch(self, part: slice) -> LayerState:
        """Sequences `part` of a batch (views)."""
        return LayerState(**{k: (None if v is None else v[part]) for k, v in self.__dict__.items()})

    def select(self, b: int, n: int) -> LayerState:
        """Sequence b of a batch, cropped to its n real tokens (views)."""
        crop = {k: (None if v is None else v[b, ..., :n, :]) for k, v in self.__dict__.items() if k != "alpha"}
        return LayerState(alpha=self.alpha[b, :, :n, :n], **crop)


def ff_forward(lw: LayerWeights, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FF on (..., d): returns (output, pre-activation, up projection or None)."""
    if lw.gated:
        g = linear(z, lw.Wg, lw.bg)
        up = linear(z, lw.Wu, lw.bu)
        return linear(lw.act(g) * up, lw.W2, lw.b2), g, up
    u = linear(z, lw.W1, lw.b1)
    return linear(lw.act(u), lw.W2, lw.b2), u, None


def after_attention(lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer once the attention output is known: (..., n, d) -> output.
    Value zeroing runs this on a batch of perturbed attention outputs."""
    return state_from_attention(lw, x, None, attn, None).y


def layer_forward(lw: LayerWeights, x: torch.Tensor, alpha: torch.Tensor) -> LayerState:
    """Recompute the layer on x (..., n, d) with the model's attention probabilities (..., H, n, n)."""
    x1 = None
    src = x
    if lw.position != "post":
        x1 = lw.ln1(x)
        src = x1
    attn = attention_output(lw, alpha, head_values(lw, src, with_bias=True))
    return state_from_attention(lw, x, alpha, attn, x1)


def attention_output(lw: LayerWeights, alpha: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention block's output sum_h (alpha^h v^h) W_O^h + b_O: alpha (..., H, m, n), v (..., H, n, dh) ->
    (..., m, d). As the model computes it: the heads' context vectors side by side, one product with W_O. Mixing
    the (H, n, d) head vectors instead costs H times the multiply-adds, in products of inner width n that ran at
    a tenth of the matmul rate (a third of the trace's time at 64 tokens on BERT-base)."""
    ctx = torch.matmul(alpha, v)  # (..., H, m, dh)
    ctx = ctx.transpose(-3, -2).reshape(*ctx.shape[:-3], ctx.shape[-2], -1)  # (..., m, H dh)
    return linear(ctx, lw.Wo, lw.bo)


def state_from_attention(
    lw: LayerWeights, x: torch.Tensor, alpha: torch.Tensor | None, attn: torch.Tensor, x1: torch.Tensor | None
) -> LayerState:
    """The rest of the layer from its input x (..., m, d) and the attention block's output attn
    (..., m, d) at the same positions (`layer_forward`; `ctxmix.engine.rows` passes some rows only;
    `after_attention` reads only y, so alpha may be None there)."""
    r1 = attn + x if lw.position != "sandwich" else x + lw.post_attn_norm(attn)
    if lw.position == "post":
        z = lw.ln1(r1)
        ff, u, up = ff_forward(lw, z)
        r2 = z + ff
        y = lw.ln2(r2)
    elif lw.position == "sandwich":  # Gemma 2/3: both blocks' outputs normalised before their residual
        z = lw.ln2(r1)
        ff, u, up = ff_forward(lw, z)
        r2 = r1 + lw.post_ff_norm(ff)
        y = r2
    elif lw.position == "parallel":  # GPT-NeoX, Phi-1/2: y = x + attn(LN1 x) + FF(LN2 x)
        z = lw.ln2(x)
        ff, u, up = ff_forward(lw, z)
        r2 = r1 + ff
        y = r2
    else:
        z = lw.ln2(r1)
        ff, u, up = ff_forward(lw, z)
        r2 = r1 + ff
        y = r2
    return LayerState(x=x, alpha=alpha, attn=attn, r1=r1, z=z, u=u, u_up=up, ff=ff, r2=r2, y=y, x1=x1)


# ---------------------------------------------------------------- decompositions


def _unbatched(fn):
    """Let a batch-first decomposition take one sequence's (n, ...) state too: the state gets a
    batch of one and every returned tensor loses it again."""
    import functools

    def strip(v):
        if isinstance(v, torch.Tensor):
            return v[0]
        if isinstance(v, tuple):
            return tuple(strip(t) for t in v)
        if isinstance(v, dict):
            return {k: strip(t) for k, t in v.items()}
        return v

    @functools.wraps(fn)
    def wrapper(lw, st, *args, **kwargs):
        if st.batched:
            return fn(lw, st, *args, **kwargs)
        return strip(fn(lw, st.as_batch(), *args, **kwargs))

    return wrapper


def _diag_add(F: torch.Tensor, rows: torch.Tensor, vec: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """F (B, c, n, d): add vec[:, k] (B, c, d) to F[:, k, rows[k]] (the residual enters only i == j); `in_place`
    for a temporary the caller owns (no copy of the (B, c, n, d) pieces)."""
    F = F if in_place else F.clone()
    F[:, torch.arange(len(rows), device=F.device), rows] += vec
    return F


def _diag(F: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """F[:, k, rows[k]] for every k: (B, c, n, d) -> (B, c, d)."""
    return F[:, torch.arange(len(rows), device=F.device), rows]


def layer_gated_ig_weights(
    lw: LayerWeights, st: LayerState, rows: torch.Tensor | slice, cache: dict | None, nodes: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_ig_weights` of rows `rows` (B, c, d'). The integrals depend only on the totals, so with a
    per-layer `cache` they are computed once for all n rows (B, n, d') and sliced per chunk: one
    quadrature (64 autograd calls) per layer instead of one per chunk."""
    if cache is None:
        return gated_ig_weights(st.u[:, rows], lw.act, nodes)
    key = ("gated_ig", nodes)
    if key not in cache:
        cache[key] = gated_ig_weights(st.u, lw.act, nodes)
    I1, I2 = cache[key]
    return I1[:, rows], I2[:, rows]


def ff_pieces(
    lw: LayerWeights,
    st: LayerState,
    rows: torch.Tensor,
    F: torch.Tensor,
    b: torch.Tensor,
    gated_nodes: int = 64,
    cache: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-baseline IG of the FF over the pieces F (B, c, n, d) and bias b (B, c, d) of its input;
    `cache` (per layer) keeps the gated FF's IG weights for the other row chunks."""
    if lw.gated:
        up = st.u_up[:, rows]
        I1, I2 = layer_gated_ig_weights(lw, st, rows, cache, gated_nodes)
        gj = F @ lw.Wg
        uj = F @ lw.Wu
        gb = b @ lw.Wg + lw.bg
        ub = b @ lw.Wu + lw.bu
        hj = gj * (up * I1).unsqueeze(2) + uj * I2.unsqueeze(2)
        hb = gb * up * I1 + ub * I2
    else:
        r = ig_ratio(st.u[:, rows], lw.act)
        hj = (F @ lw.W1) * r.unsqueeze(2)
        hb = (b @ lw.W1 + lw.b1) * r
    return hj @ lw.W2, hb @ lw.W2 + lw.b2


def ff_pieces_factorised(
    lw: LayerWeights,
    st: LayerState,
    rows: torch.Tensor,
    norm,
    s: torch.Tensor,
    b: torch.Tensor,
    cache: dict,
    gated_nodes: int = 64,
    precision: str = "float32",
    work: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ff_pieces` without the second n^2*d*d' product.

    The FF reads pieces norm(sum_h alpha^h_ij f^h_j + [i=j] x_i) / s_i, linear in f and x, so
    W_1 (or W_g, W_u) is applied to the H*n head vectors once per layer (cached in `cache`, through
    the head values and `head_ff_maps`) and mixed with alpha afterwards (H*n^2*d' instead of
    n^2*d*d'). Only the product with W_2,
    which exact maps cannot avoid, stays n^2*d'*d. Works in (j, i) order so that the big
    tensors stay contiguous for the GEMM. cache["v"] (B, H, n, dh) the head values; s (B, c, 1);
    b (B, c, d) the bias piece. `precision` applies to the two large products (see `big_matmul`). `work`: the
    call's `Workspace`, where the (n, c, d') products go from chunk to chunk.
    """
    work = Workspace() if work is None else work
    B, c = st.x.shape[0], len(rows)
    if "G" not in cache:  # (B, n, H, d') per projection; one sequence's (n, H, d') view is a strided batch, no copy
        cache["G"] = project_heads(lw, cache["v"], precision, contiguous=B > 1)
    if "xW" not in cache:  # the residual's piece through each projection, every row at once (B, n, d')
        ones = torch.ones(*st.x.shape[:2], 1, dtype=st.x.dtype, device=st.x.device)
        xg = norm.decompose_pieces(st.x.unsqueeze(2), ones).squeeze(2)  # (B, n, d)
        cache["xW"] = [xg @ W for W, _ in ff_input_projections(lw)]
    ar = torch.arange(c, device=rows.device)
    aT = st.alpha[:, :, rows].permute(0, 3, 2, 1).contiguous()  # (B, n, c, H)

    def project(k, weight):  # (B, n, c, d') = (pieces @ W_k) / s * weight, in (j, i) order
        G = cache["G"][k]
        P = torch.matmul(aT, G, out=work.take(f"P{k}", (*aT.shape[:-1], G.shape[-1]), G.dtype, G.device))
        P[:, rows, ar] += cache["xW"][k][:, rows]
        # one pass over the (n, c, d') product, not two: 1 / s folded into the (c, d') weight
        return P.mul_((weight / s.view(B, c, 1)).unsqueeze(1))

    if lw.gated:
        up = st.u_up[:, rows]
        I1, I2 = layer_gated_ig_weights(lw, st, rows, cache, gated_nodes)
        hT = project(0, up * I1).add_(project(1, I2))
    else:
        hT = project(0, _layer_ig_ratio(lw, st, cache)[:, rows])
    F_ff = big_matmul(hT, lw.W2, precision, work, "W2").transpose(1, 2)
    return F_ff, ff_bias(lw, st, rows, b, cache, gated_nodes)


def _layer_ig_ratio(lw: LayerWeights, st: LayerState, cache: dict) -> torch.Tensor:
    """`ig_ratio` of every row (B, n, d'), once per layer (`cache`)."""
    if "ig_ratio" not in cache:
        cache["ig_ratio"] = ig_ratio(st.u, lw.act)
    return cache["ig_ratio"]


def ff_bias(
    lw: LayerWeights, st: LayerState, rows: torch.Tensor, b: torch.Tensor, cache: dict, gated_nodes: int = 64
) -> torch.Tensor:
    """The FF's zero-baseline IG share of the bias piece b (B, c, d) of its input, plus b_2: (B, c, d). Where the
    per-layer `cache` holds every row's input bias ("ff_bias_in", (B, n, d), put there by `scope_pieces`), the
    products run once per layer for all n rows and each chunk takes its rows: a chunk's c-row product with W_1
    and W_2 reads both matrices for little arithmetic (measured on a CPU at a fifth of the matmul rate)."""
    every = "ff_bias_in" in cache
    if every and "ff_bias" in cache:
        return cache["ff_bias"][:, rows]
    at = slice(None) if every else rows
    b = cache["ff_bias_in"] if every else b
    if lw.gated:
        I1, I2 = layer_gated_ig_weights(lw, st, at, cache, gated_nodes)
        hb = (b @ lw.Wg + lw.bg) * st.u_up[:, at] * I1 + (b @ lw.Wu + lw.bu) * I2
    else:
        hb = (b @ lw.W1 + lw.b1) * _layer_ig_ratio(lw, st, cache)[:, at]
    out = hb @ lw.W2 + lw.b2
    if not every:
        return out
    cache["ff_bias"] = out
    return out[:, rows]


def _buffer(work: Workspace | None, name: str, like: torch.Tensor) -> torch.Tensor | None:
    """A workspace buffer laid out as `like` for a chunk's output pieces, or None (a fresh tensor)."""
    return None if work is None else work.like(name, like)


def _through(
    norm, F: torch.Tensor, b: torch.Tensor, real: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces and bias through a norm, with the scale of the real vector it reads (the pieces into `out`)."""
    s = norm.scale(real)
    return norm.decompose_pieces(F, s, out=out), norm.decompose_bias(b, s)


def _res2(
    F_ff, b_ff, F_atb, b_atb, rows, res2: str, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RES2: the whole attention-block decomposition added ("exact"), or the FF paper's printed
    Eq. 57 ("diagonal": only F^ATB_i(x_i), bias of the FF alone), which does not reconstruct. `out`: where
    the exact sum goes."""
    if res2 == "exact":
        return torch.add(F_ff, F_atb, out=out), b_ff + b_atb
    return _diag_add(F_ff, rows, _diag(F_atb, rows)), b_ff


def _next_ln(
    lw: LayerWeights, st: LayerState, rows, F, b, name: str, out: dict, next_ln: bool, work: Workspace | None = None
) -> None:
    """The layer output's pieces through the norm that reads it next (the dynamics view)."""
    if next_ln and lw.next_norm is not None:
        out[name] = _through(lw.next_norm, F, b, st.y[:, rows], _buffer(work, name, F))


def _bias_rows(
    lw: LayerWeights, st: LayerState, cache: dict, ln_beta: torch.Tensor | None, norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's bias piece after the attention block (the value bias through alpha, b_O, and pre-LN's LN1
    beta) and its share through the norm the FF reads (of r1): (B, n, d) each, once per layer (`cache`), where
    each chunk takes its rows. The FF input's ("ff_bias_in") lets `ff_bias` run its products once per layer."""
    if "bias_rows" not in cache:
        b = value_bias_rows(lw, ln_beta, st.alpha) + lw.bo
        cache["bias_rows"] = (b, norm.decompose_bias(b, norm.scale(st.r1)))
        cache["ff_bias_in"] = cache["bias_rows"][1]
    return cache["bias_rows"]


@_unbatched
def scope_pieces(
    lw: LayerWeights,
    st: LayerState,
    rows: torch.Tensor,
    res2: str = "exact",
    next_ln: bool = False,
    cache: dict | None = None,
    factorised: bool = True,
    precision: str = "float32",
    work: Workspace | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The FF paper's cumulative scopes for output rows `rows`: name -> (pieces (B,c,n,d), bias (B,c,d)).

    The value bias b_V W_O goes to the bias term, as the FF paper writes (not spread over
    tokens through alpha as GlobEnc's and ALTI's code do). `res2="exact"` adds the whole
    attention-block decomposition at RES2 (exact); `"diagonal"` is the paper's printed Eq. 57
    (only F^ATB_i(x_i) on the diagonal, bias b^{ATB+FF}), which does not reconstruct.
    `next_ln` (pre-LN) adds "AtbLnFfResLn": the layer output through the norm that reads it next
    (the next layer's LN1, or the final norm), used for the FF paper's dynamics view on GPT-2.
    `cache` holds per-layer products shared by the row chunks of one layer; `factorised=False`
    runs the straightforward FF product (the reference the tests compare against); `work` the call's
    `Workspace`: the factorised product's temporaries, and the returned pieces of sequential layers, go into
    its buffers, valid until the next call with the same workspace (the chunk loop reads them first).
    """
    cache = {} if cache is None else cache
    if res2 not in ("exact", "diagonal"):
        raise ValueError("res2 must be 'exact' or 'diagonal'")
    alpha = st.alpha[:, :, rows]
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if lw.position == "post":
        if "f_ln1" not in cache:  # LN1's share of each head vector before 1/s: centred, times gamma (s = 1)
            cache["v"] = head_values(lw, st.x, with_bias=False)
            f = values_through_heads(lw, cache["v"])
            cache["f_ln1"] = lw.ln1.decompose_pieces(f, f.new_ones(*f.shape[:-2], 1))  # (n, H, d) storage kept
        b_atb = _bias_rows(lw, st, cache, None, lw.ln1)[1][:, rows]
        s1 = lw.ln1.scale(st.r1[:, rows])  # (B, c, 1)
        # LN1's decomposition is linear in the pieces once s is known: the mix of the decomposed head vectors with
        # alpha / s_i is the decomposed mix, with no pass over the (c, n, d) pieces of its own
        x_ln1 = lw.ln1.decompose_pieces(st.x[:, rows].unsqueeze(-2), s1).squeeze(-2)
        F_atb = _diag_add(mix(alpha / s1.unsqueeze(1), cache["f_ln1"]), rows, x_ln1, in_place=True)
        out["Atb"] = (F_atb, b_atb)
        if factorised:
            F_ff, b_ff = ff_pieces_factorised(lw, st, rows, lw.ln1, s1, b_atb, cache, precision=precision, work=work)
        else:
            F_ff, b_ff = ff_pieces(lw, st, rows, F_atb, b_atb, cache=cache)
        out["AtbFf"] = (F_ff, b_ff)
        out["AtbFfRes"] = F_r, b_r = _res2(F_ff, b_ff, F_atb, b_atb, rows, res2, _buffer(work, "AtbFfRes", F_atb))
        out["AtbFfResLn"] = _through(lw.ln2, F_r, b_r, st.r2[:, rows], _buffer(work, "AtbFfResLn", F_r))
        return out
    if lw.position == "sandwich":
        return _sandwich_scopes(lw, st, rows, alpha, res2, next_ln, cache)
    if lw.position == "parallel":
        if res2 != "exact":
            raise ValueError(
                "res2='diagonal' is the FF paper's printed RES2 of a sequential layer; a parallel "
                "layer adds one residual around both blocks"
            )
        return _parallel_scopes(lw, st, rows, alpha, next_ln, cache)
    # pre-LN: LN1 acts on each token alone; its beta goes to the bias with b_V and b_O
    if "f" not in cache:
        xhat = lw.ln1.decompose_pieces(st.x.unsqueeze(-2), lw.ln1.scale(st.x)).squeeze(-2)  # LN1(x_j) - beta
        cache["v"] = head_values(lw, xhat, with_bias=False)
        cache["f"] = values_through_heads(lw, cache["v"])
    f = cache["f"]
    b_all, b_in = _bias_rows(lw, st, cache, lw.ln1.beta, lw.ln2)
    b, b_ln = b_all[:, rows], b_in[:, rows]
    F_atb = _diag_add(mix(alpha, f), rows, st.x[:, rows], in_place=True)
    out["Atb"] = (F_atb, b)
    s2 = lw.ln2.scale(st.r1[:, rows])
    F_ln = lw.ln2.decompose_pieces(F_atb, s2, out=_buffer(work, "AtbLn", F_atb))
    out["AtbLn"] = (F_ln, b_ln)
    if factorised:
        F_ff, b_ff = ff_pieces_factorised(lw, st, rows, lw.ln2, s2, b_ln, cache, precision=precision, work=work)
    else:
        F_ff, b_ff = ff_pieces(lw, st, rows, F_ln, b_ln, cache=cache)
    out["AtbLnFf"] = (F_ff, b_ff)
    out["AtbLnFfRes"] = F_r, b_r = _res2(F_ff, b_ff, F_atb, b, rows, res2, _buffer(work, "AtbLnFfRes", F_atb))
    _next_ln(lw, st, rows, F_r, b_r, "AtbLnFfResLn", out, next_ln, work)
    return out


def _sandwich_scopes(
    lw: LayerWeights, st: LayerState, rows: torch.Tensor, alpha: torch.Tensor, res2: str, next_ln: bool, cache: dict
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Scopes of a sandwich layer (Gemma 2/3), h = x + LNa(ATTN(LN1 x)), y = h + LNf(FF(LN2 h)), in
    the pre-LN names and order with the output norms where they act: Atb = LN1 + ATTN + LNa + RES1
    (sums to h), AtbLn (LN2, the FF's input), AtbLnFf (the FF output), AtbLnFfLn (LNf),
    AtbLnFfLnRes (RES2: the layer output), AtbLnFfLnResLn (the next norm). Every norm is decomposed
    with the scale of the real vector it reads; the FF by zero-baseline IG on the straightforward
    product (LNa's per-row scale sits between the heads and W_1, so no head factorisation)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if "f" not in cache:
        xhat = lw.ln1.decompose_pieces(st.x.unsqueeze(-2), lw.ln1.scale(st.x)).squeeze(-2)
        cache["f"] = values_through_heads(lw, head_values(lw, xhat, with_bias=False))
    F_a, b = _through(
        lw.post_attn_norm, mix(alpha, cache["f"]), value_bias_rows(lw, lw.ln1.beta, alpha) + lw.bo, st.attn[:, rows]
    )
    F_atb = _diag_add(F_a, rows, st.x[:, rows])
    out["Atb"] = (F_atb, b)
    out["AtbLn"] = F_ln, b_ln = _through(lw.ln2, F_atb, b, st.r1[:, rows])
    out["AtbLnFf"] = F_ff, b_ff = ff_pieces(lw, st, rows, F_ln, b_ln, cache=cache)
    out["AtbLnFfLn"] = F_f, b_f = _through(lw.post_ff_norm, F_ff, b_ff, st.ff[:, rows])
    out["AtbLnFfLnRes"] = F_r, b_r = _res2(F_f, b_f, F_atb, b, rows, res2)
    _next_ln(lw, st, rows, F_r, b_r, "AtbLnFfLnResLn", out, next_ln)
    return out


def _parallel_scopes(
    lw: LayerWeights, st: LayerState, rows: torch.Tensor, alpha: torch.Tensor, next_ln: bool, cache: dict
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Scopes of a parallel layer, y = x + ATTN(LN1 x) + FF(LN2 x), in the post-LN order of the
    FF paper's names: Atb = LN1 + ATTN (no residual: the one residual adds x around both blocks),
    AtbFf = Atb + FF, AtbFfRes = AtbFf + x (the layer output), AtbFfResLn = through the next norm.
    The FF reads LN2(x_i), a function of token i alone: its zero-baseline IG share goes to token i
    (on the diagonal) and to the bias (LN2's beta, b_1, b_2), so the FF mixes no context within the
    layer; what it changes is how much of each token's row is its own."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if "f" not in cache:
        xhat = lw.ln1.decompose_pieces(st.x.unsqueeze(-2), lw.ln1.scale(st.x)).squeeze(-2)
        cache["v"] = head_values(lw, xhat, with_bias=False)
        cache["f"] = values_through_heads(lw, cache["v"])
    F_atb = mix(alpha, cache["f"])
    b_atb = value_bias_rows(lw, lw.ln1.beta, alpha) + lw.bo
    out["Atb"] = (F_atb, b_atb)
    x = st.x[:, rows]
    own = lw.ln2.decompose_pieces(x.unsqueeze(-2), lw.ln2.scale(x))  # (B, c, 1, d): LN2(x_i) - beta
    beta = lw.ln2.beta if lw.ln2.beta is not None else torch.zeros_like(x[0, 0])
    F_ff, b_ff = ff_pieces(lw, st, rows, own, beta.expand_as(x), cache=cache)
    out["AtbFf"] = (_diag_add(F_atb, rows, F_ff[:, :, 0]), b_atb + b_ff)
    F_r = _diag_add(out["AtbFf"][0], rows, x)
    out["AtbFfRes"] = (F_r, out["AtbFf"][1])
    _next_ln(lw, st, rows, F_r, out["AtbFf"][1], "AtbFfResLn", out, next_ln)
    return out


@_unbatched
def norm_family_pieces(lw: LayerWeights, st: LayerState, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pieces (B, c, n, d) of GlobEnc's N, N_Res, N_ResLN, N_Enc and ALTI's T_i(x_j): the definition,
    which the reconstruction tests check; the maps come from `norm_family_row_maps` (their norms
    without building every piece, tested equal to these).

    As in the GlobEnc and ALTI code, the value bias is spread over tokens through alpha
    (f^h includes b_V), and b_O and the norms' beta are attributed to no token.

    post-LN (the papers' setting): N = sum_h alpha f, N_Res adds x_i at j == i, N_ResLN
    decomposes LN1 with the real pre-LN1 std, N_Enc passes those through LN2 with the std of
    the real pre-LN2 vector (FF ignored but for that std). ALTI's T is N_ResLN's pieces.
    pre-LN (ctxmix's extension, as the ALTI repo's pre-LN branch): N and N_Res read LN1(x_j);
    N_ResLN applies LN2 (the norm that reads the residual stream next); N_Enc applies the next
    layer's LN1 (or the final norm) to N_Res's pieces with the std of the real layer output
    (FF ignored but for that std); ALTI's T is N_Res's pieces, compared with the stream h.
    """
    alpha = st.alpha[:, :, rows]
    src = st.x if lw.position == "post" else st.x1
    N = mix(alpha, head_vectors(lw, src, with_bias=True))
    NR = _diag_add(N, rows, st.x[:, rows])
    out = {"norm": N, "norm_res": NR}
    if lw.position == "post":
        s1 = lw.ln1.scale(st.r1[:, rows])
        T = lw.ln1.decompose_pieces(NR, s1)
        out["norm_res_ln"] = T
        out["globenc"] = lw.ln2.decompose_pieces(T, lw.ln2.scale(st.r2[:, rows]))
        out["alti_T"] = T
    elif lw.position == "sandwich":  # N: what the attention block adds to the stream, LNa included
        N = lw.post_attn_norm.decompose_pieces(N, lw.post_attn_norm.scale(st.attn[:, rows]))
        NR = _diag_add(N, rows, st.x[:, rows])
        out = {"norm": N, "norm_res": NR, "norm_res_ln": lw.ln2.decompose_pieces(NR, lw.ln2.scale(st.r1[:, rows]))}
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln2
        out["globenc"] = nxt.decompose_pieces(NR, nxt.scale(st.y[:, rows]))
        out["alti_T"] = NR
    elif lw.position == "parallel":  # no norm reads x + attn: N_ResLN takes the next norm with its std
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln1
        out["norm_res_ln"] = nxt.decompose_pieces(NR, nxt.scale(st.r1[:, rows]))
        out["globenc"] = nxt.decompose_pieces(NR, nxt.scale(st.y[:, rows]))
        out["alti_T"] = NR
    else:
        out["norm_res_ln"] = lw.ln2.decompose_pieces(NR, lw.ln2.scale(st.r1[:, rows]))
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln2
        out["globenc"] = nxt.decompose_pieces(NR, nxt.scale(st.y[:, rows]))
        out["alti_T"] = NR
    return out


def piece_norms(norm, V: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """||norm.decompose_pieces(V, s)||_2 over d without the decomposed tensor: pieces V (B, c, J, d),
    scale s (B, c, 1) -> (B, c, J). gamma enters as a weighted sum of squares (one GEMM); LayerNorm
    centres each piece first (no cancellation-prone moment formula)."""
    if norm.kind == "identity":
        return V.norm(dim=-1)
    if norm.kind == "layernorm":
        V = V - V.mean(-1, keepdim=True)
    ss = torch.matmul(V * V, (norm.gamma * norm.gamma).to(V.dtype))
    return ss.clamp(min=0).sqrt() / s


def norm_family_row_maps(
    lw: LayerWeights, st: LayerState, rows: torch.Tensor, names: list[str], f: torch.Tensor, J: int
) -> dict[str, torch.Tensor]:
    """Rows `rows` of the maps `names` (GlobEnc's N family and "alti") over the first J columns,
    (B, c, J) each: the norms of `norm_family_pieces` (and ALTI's normalised contributions) without
    building the pieces no map needs. f (B, H, n, d): the layer's head vectors with b_V (computed once
    per layer, not per chunk); J: the columns that can be non-zero (a causal model's rows < J attend
    to nothing later, so the columns past J stay zero, in every map and in ALTI's normalisation)."""
    need = set(names)
    out: dict[str, torch.Tensor] = {}
    N = mix(st.alpha[:, :, rows, :J], f[:, :, :J])  # (B, c, J, d)
    if lw.position == "sandwich":  # N: what the attention block adds to the stream, LNa included
        N = lw.post_attn_norm.decompose_pieces(N, lw.post_attn_norm.scale(st.attn[:, rows]))
    if "norm" in need:
        out["norm"] = N.norm(dim=-1)
    NR = N  # the residual enters only at j == i: added in place, N is not needed any more
    NR[:, torch.arange(len(rows), device=N.device), rows] += st.x[:, rows]
    if "norm_res" in need:
        out["norm_res"] = NR.norm(dim=-1)
    if lw.position == "post":
        s1 = lw.ln1.scale(st.r1[:, rows])
        if "alti" in need or "globenc" in need:
            T = lw.ln1.decompose_pieces(NR, s1)
            if "norm_res_ln" in need:
                out["norm_res_ln"] = T.norm(dim=-1)
            if "globenc" in need:
                out["globenc"] = piece_norms(lw.ln2, T, lw.ln2.scale(st.r2[:, rows]))
            if "alti" in need:
                out["alti"] = alti_layer(T, st.z[:, rows])
        elif "norm_res_ln" in need:
            out["norm_res_ln"] = piece_norms(lw.ln1, NR, s1)
        return out
    if lw.position == "sandwich":
        res_ln, res_s = lw.ln2, st.r1
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln2
    elif lw.position == "parallel":  # no norm reads x + attn: N_ResLN takes the next norm with its std
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln1
        res_ln, res_s = nxt, st.r1
    else:
        res_ln, res_s = lw.ln2, st.r1
        nxt = lw.next_norm if lw.next_norm is not None else lw.ln2
    if "norm_res_ln" in need:
        out["norm_res_ln"] = piece_norms(res_ln, NR, res_ln.scale(res_s[:, rows]))
    if "globenc" in need:
        out["globenc"] = piece_norms(nxt, NR, nxt.scale(st.y[:, rows]))
    if "alti" in need:
        out["alti"] = alti_layer(NR, st.r1[:, rows])
    return out


def alti_layer(T: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ALTI (Ferrando et al. 2022, Eq. 9-10): C_ij = max(0, |y_i|_1 - |y_i - T_ij|_1),
    normalised over j. T (..., c, n, d), y (..., c, d) the real block output. Exact L1 (no eps).
    A row whose every contribution is clipped (y_i dominated by the bias) stays all zero
    rather than being given a made-up distribution."""
    acc = torch.promote_types(T.dtype, torch.float32)  # half-precision models: sums and rows in float32
    dist = (y.unsqueeze(-2) - T).abs().sum(-1, dtype=acc)
    C = (y.abs().sum(-1, keepdim=True, dtype=acc) - dist).clamp(min=0)
    return C / C.sum(-1, keepdim=True).clamp(min=torch.finfo(C.dtype).tiny)


def value_zeroing_prepare(lw: LayerWeights, st: LayerState, precision: str = "float32") -> dict:
    """Per-layer products that every chunk of zeroed tokens shares (see value_zeroing_columns):
    the head vectors f^h(x_t) (B, n, H, d), and for each FF input projection W (W_1, or gate and up)
    A = centre(r1) (gamma W) (B, n, d'), B^h_t = centre(f^h(x_t)) (gamma W) (B, n, H, d', a (t, h) view of
    a (B, H, n, d') tensor: `_columns` gathers a chunk's tokens) and the constant beta W + b.

    A is read off the trace's own pre-activation: u = norm(r1) W + b = A / s1 + const (the norm is affine once
    its scale s1 is known), so A = s1 (u - const) and the (n, d) x (d, d') product is not run again."""
    st = st.as_batch()
    src = st.x if lw.position == "post" else st.x1
    norm = ff_in_norm(lw)
    v = head_values(lw, src, with_bias=True)  # (B, H, n, dh)
    f = values_through_heads(lw, v).transpose(1, 2)  # (B, n, H, d), contiguous
    if lw.position == "parallel":  # the FF does not read the attention output: nothing else to share
        return {"f": f, "norm": norm, "proj": []}
    s1 = norm.scale(st.r1)  # (B, n, 1)
    pre = [st.u, st.u_up] if lw.gated else [st.u]
    heads = project_heads(lw, v, precision, contiguous=False)
    proj = [((u - const).mul_(s1), B, const) for u, B, const in zip(pre, heads, ff_input_constants(lw))]
    return {"f": f, "norm": norm, "proj": proj}


def ff_input_constants(lw: LayerWeights) -> list[torch.Tensor]:
    """Per FF input projection (W, b), beta W + b (d'): what the norm's shift gives the pre-activation (b alone for
    RMSNorm). Depends only on the weights: kept with them (d' numbers a projection), so that a call does not read
    each W again for a vector-matrix product (0.8 ms a layer at BERT-base widths on a CPU: memory-bound)."""
    beta = ff_in_norm(lw).beta
    projections = ff_input_projections(lw)
    return _kept(
        lw,
        "ff_input_constants",
        [beta, *(t for W, b in projections for t in (W, b))],
        lambda: [b if beta is None else beta @ W + b for W, b in projections],
    )


def first_receiving_rows(alpha: torch.Tensor) -> list[int]:
    """For each column t of alpha (B, H, n, c), the first row i that gives t any weight in any head
    or sequence (n where none does): value zeroing's rows before it are unchanged. One host read per
    layer, so that the per-chunk loop needs none; one head at a time, to hold no (B, H, n, c) mask."""
    n = alpha.shape[-2]
    gives = torch.zeros(alpha.shape[-2:], dtype=torch.bool, device=alpha.device)  # (rows, columns)
    for h in range(alpha.shape[1]):
        gives |= (alpha[:, h] != 0).any(0)
    first = torch.where(gives.any(0), gives.to(torch.uint8).argmax(0), n)  # argmax: the first maximum
    return first.tolist()


def value_zeroing_columns(
    lw: LayerWeights,
    st: LayerState,
    cols: torch.Tensor,
    prep: dict | None = None,
    factorised: bool = True,
    precision: str = "float32",
    first: int | None = None,
    work: Workspace | None = None,
) -> torch.Tensor:
    """Value zeroing (Mohebbi et al. 2023) for zeroed tokens `cols`: (B, c, n) cosine distances
    between each output y_i and y_i with v_t zeroed in every head (bias included), alpha kept
    ((c, n) for an unbatched state).

    Zeroing v_t only removes R_ti = sum_h alpha^h_it f^h(x_t) from each attention output, so Q, K
    and the weights are not recomputed and the c variants run as one batch. Factorised, the FF
    input projection is not applied to the c*n perturbed vectors: the norm before the FF is
    affine once its scale s_ti is known, so u_ti = (A_i - sum_h alpha^h_it B^h_t) / s_ti + const
    (see value_zeroing_prepare), and only the W_2 product runs on c*n vectors. In "bf16" precision
    that product is applied to the *change* of the FF activation, ff_i + (act(u') - act(u)) W_2,
    so its rounding scales with the (small) change, not with the whole FF output. Rows i that give
    no weight to the zeroed token (i < t in causal models) are unchanged: distance exactly 0.
    Distances in float64. `first`: the first row that gives any zeroed token weight (the least
    `first_receiving_rows` of `cols`, which callers compute once per layer), or None to find it here
    (one host read). `work`: the call's `Workspace`, whose buffers the (c, m, d') temporaries reuse from
    chunk to chunk (a fresh one per call when None).
    """
    if not st.batched:
        return value_zeroing_columns(lw, st.as_batch(), cols, prep, factorised, precision, first, work)[0]
    work = Workspace() if work is None else work
    B, c, n = st.x.shape[0], len(cols), st.x.shape[1]
    out = torch.zeros(B, c, n, dtype=torch.float64, device=st.x.device)
    sel = token_index(cols, st.x.device)  # a slice when consecutive: views, not gathers
    if first is None:
        first = min(first_receiving_rows(st.alpha[..., sel]))
    if first >= n:  # no row gives the zeroed tokens any weight
        return out
    alT = st.alpha[:, :, first:, sel].permute(0, 3, 2, 1).contiguous()  # (B, c, m, H)
    if lw.position == "sandwich":
        factorised = False  # LNa's per-row scale sits between the zeroed value and the FF's projections
    if lw.position == "parallel":  # y' = y - what v_t gave the attention output (the FF reads LN2(x) only)
        f_t = (
            prep["f"][:, sel]
            if prep is not None
            else head_vectors(lw, st.x1[:, sel], with_bias=True).transpose(1, 2).contiguous()
        )
        y = st.y[:, first:].unsqueeze(1) - torch.matmul(alT, f_t)
    elif not factorised:
        src = st.x if lw.position == "post" else st.x1
        f_t = head_vectors(lw, src[:, sel], with_bias=True)  # (B, H, c, d)
        removed = torch.matmul(alT, f_t.transpose(1, 2).contiguous())  # (B, c, m, d)
        y = after_attention(lw, st.x[:, first:].unsqueeze(1), st.attn[:, first:].unsqueeze(1) - removed)
    else:
        prep = prep if prep is not None else value_zeroing_prepare(lw, st, precision)
        norm = prep["norm"]
        # residual stream after attention, v_t zeroed: r1 - alpha f (one product, the subtraction in its epilogue)
        h = _minus_product(
            st.r1[:, first:],
            alT,
            prep["f"][:, sel],
            work.take("h", (B, c, n - first, st.x.shape[-1]), st.x.dtype, st.x.device),
        )  # (B, c, m, d)
        # base: what the FF's output is added to, this chunk's own tensor: LN1's output (post-LN: it is the FF's
        # input and joins the layer output) or the residual stream (pre-LN: LN2's output is never formed)
        if lw.position == "post":  # b_2 folded into LN1's beta (not in bf16, whose FF output carries it)
            base, s = norm.fused_with_scale(h, None if precision == "bf16" else lw.b2)  # (B, c, m, d), (B, c, m, 1)
        else:
            base, s = h, norm.fast_scale(h)
        # u = (A - alpha B) / s + const = (A / s + const) - (alpha / s) B: one pass writes the first term, the
        # batched product subtracts in its epilogue (on c x m x d' tensors each pass costs as much memory traffic
        # as a share of the W_2 product's arithmetic)
        r = s.reciprocal()
        us = []
        for k, (A, Bh, const) in enumerate(prep["proj"]):
            u = work.take(f"u{k}", (B, c, n - first, A.shape[-1]), A.dtype, A.device)
            a_r = torch.addcmul(const, r, A[:, first:].unsqueeze(1), out=u)
            us.append(_minus_product(a_r, alT * r, _columns(Bh, sel)))
        inner = act_into(lw.act, us[0])  # in place where the activation has such a kernel: no fresh (c, m, d')
        if lw.gated:
            inner.mul_(us[1])
        del us
        if precision == "bf16":
            real = lw.act(st.u[:, first:]) * st.u_up[:, first:] if lw.gated else lw.act(st.u[:, first:])
            ff = big_matmul(inner - real.unsqueeze(1), lw.W2, precision).add_(st.ff[:, first:].unsqueeze(1))
            z = ff.add_(base)
        else:
            if lw.b2 is not None and lw.position != "post":
                base.add_(lw.b2)
            if precision == "tf32" and inner.is_cuda:  # `big_matmul`'s split bfloat16 product on the tensor cores
                z = base.add_(big_matmul(inner, lw.W2, precision))
            else:  # float32: the product accumulates onto the base (in its epilogue, or one add of the packed one's)
                flat = base.view(-1, base.shape[-1])
                z = work.product("W2", inner.view(-1, inner.shape[-1]), lw.W2, into=flat).view(base.shape)
        del inner
        y = lw.ln2.fused(z) if lw.position == "post" else z
    # a row that gives no weight to t is unchanged: exactly 0, not the rounding of a recomputation
    out[:, :, first:] = cosine_distances(y, st.y[:, first:], work).mul_((alT != 0).any(-1))
    return out  # (B, c zeroed, n outputs)


def cosine_distances(y_new: torch.Tensor, y: torch.Tensor, work: Workspace | None = None) -> torch.Tensor:
    """1 - cos(y_new, y) in float64, at least 0: y_new (B, c, m, d) against y (B, m, d) -> (B, c, m). As
    cosine_similarity in float64 (a zero vector has cosine 0: the norms' product is clamped at 1e-8), in fewer
    passes over the c x m x d vectors: y_new is cast to float64 once (exact), into `work`'s buffer when given, laid
    out (B, m, c, d) so that the dot products with y are one batched product over (b, m) with no further copy, and
    the norms are a reduction over the same copy."""
    B, c, m, d = y_new.shape
    shape = (B, m, c, d)
    if work is None:
        buf = torch.empty(shape, dtype=torch.float64, device=y_new.device)
    else:
        buf = work.take("y64", shape, torch.float64, y_new.device)
    yn64 = buf.copy_(y_new.transpose(1, 2))
    y64 = y.double()
    dot = torch.matmul(yn64, y64.unsqueeze(-1)).squeeze(-1)  # (B, m, c)
    norms = torch.linalg.vector_norm(yn64, dim=-1) * torch.linalg.vector_norm(y64, dim=-1, keepdim=True)
    return (1.0 - dot / norms.clamp(min=1e-8)).clamp_(min=0.0).transpose(1, 2)


def token_index(cols: torch.Tensor, device) -> torch.Tensor | slice:
    """Tokens `cols` as an index on `device`: a slice when they are consecutive and on the host (the chunks of
    `ctxmix.methods.mixing` are), so that taking them from the per-layer tensors is a view, not a gather; else the
    index tensor on the device (no host read of a device tensor)."""
    if cols.device.type == "cpu" and len(cols) > 0 and int(cols[0]) >= 0 and bool((cols.diff() == 1).all()):
        return slice(int(cols[0]), int(cols[-1]) + 1)
    return cols.to(device)


def _columns(t: torch.Tensor, cols: torch.Tensor | slice) -> torch.Tensor:
    """Tokens `cols` of a (B, n, H, k) tensor, (B, c, H, k): for a (t, h) view of a (B, H, n, k) tensor (see
    `project_heads`) the gather runs along n on the tensor's own layout and returns a view in (t, h) order; a
    slice is a view with no copy (the batched product reads its strides: 0.7 of the gather's time)."""
    if isinstance(cols, slice):
        return t[:, cols]
    return t.transpose(1, 2).index_select(2, cols).transpose(1, 2)


def _minus_product(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """base (B, m, k) broadcast over c, or (B, c, m, k) (overwritten), less a (B, c, m, H) @ b (B, c, H, k):
    (B, c, m, k), as one batched product whose epilogue adds the base, instead of a product, a negation and an
    addition. `out` (B, c, m, k): where a broadcast base is copied (a fresh tensor when None)."""
    B, c, m, H = a.shape
    k = b.shape[-1]
    if base.dim() == 4:
        out = base.reshape(B * c, m, k)
    else:  # a copy: with c = 1 a reshape of the broadcast base would be a view of it (overwritten below)
        out = base.new_empty(B * c, m, k) if out is None else out.view(B * c, m, k)
        out.view(B, c, m, k).copy_(base.unsqueeze(1))
    return out.baddbmm_(a.reshape(B * c, m, H), b.reshape(B * c, H, k), alpha=-1).view(B, c, m, k)
