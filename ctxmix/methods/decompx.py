"""DecompX (Modarressi, Fayyaz, Aghazadeh, Yaghoobzadeh, Pilehvar, ACL 2023): every input token's part
of every hidden state, carried through every layer and through the task head, so that each token gets
a signed contribution to each logit and the parts sum to the logits.

For each position i and input token k a vector x^l_{i<=k} (d,) is kept, with sum_k x^l_{i<=k} = x^l_i:
an (n, n, d) tensor per layer, propagated linearly with the nonlinear quantities frozen at their real
values (attention probabilities, each norm's scale on the real vector it reads, the activation ratio
f(u)/u). Post-LN layer l (the paper's and its code's, `DecompXConfig(aggregation="vector")`):

    a_{i<=k}  = sum_h sum_j alpha^h_ij (x_{j<=k} W_V^h) W_O^h                          attention
    z+_{i<=k} = S_{b_att}[a_{i<=.} + x_{i<=.}]_k,  b_att = sum_h (sum_j alpha^h_ij) b_V^h W_O^h + b_O
    z~_{i<=k} = S_{beta1}[gamma1 (z+_{i<=k} - mean) / s(z+_i)]_k                      LN1, real std
    zeta      = S_{b1}[z~ W_1],  eta = theta_i * zeta,  phi = S_{b2}[eta W_2]            FF
    x'_{i<=k} = S_{beta2}[gamma2 (z~ + phi - mean) / s(q_i)]_k                           RES2 + LN2

S_b (bias "absdot", the default): the bias b is spread over the row's token pieces v_k with weights
|<b, v_k>| / sum_k' |<b, v_k'>| (the "prior term" is the site's linear output before b; at the attention
site the code's choice, attention plus residual, not the paper's Eq. 5 attention alone). "none" drops
the biases from the pieces (the real statistics keep them): the parts then miss a remainder, reported
in `logit_terms["bias"]`. Layer 1 follows the code: x^1_{i<=k} = delta_ik e_i, the value bias goes to
token k through alpha^h_ik and only b_O is spread. The FF: "zero_origin" (default, the paper's GeLU_ZO)
scales each piece by theta = f(u)/u of the real pre-activation u (the zero-baseline Integrated
Gradients closed form; ctxmix takes f'(0) at u = 0 where the code divides by u + 1e-12); "tangent"
(GeLU_LA) uses the slope f'(u) and spreads the intercept f(u) - f'(u) u by AbsDot.

Other shapes follow the same rules (derived here, not in the paper; each has its completeness test):
pre-LN h = x + ATTN(LN1 x), y = h + FF(LN2 h): LN1 acts on every attended position's pieces with its
real scale; parallel (GPT-NeoX, Phi-1/2) y = x + ATTN(LN1 x) + FF(LN2 x); sandwich (Gemma 2/3) with
LNa and LNf on the blocks' outputs; RMSNorm is LayerNorm without centring and without beta (Gemma's
1 + w is its gamma); gated FFs (SwiGLU, GeGLU) share a piece's gate and up projections by the exact
zero-baseline IG of act(g) * u (ctxmix.engine.layer.gated_ig_weights). After the last pre-LN layer the
final norm is decomposed the same way.

Heads, each with its rule (the pooler's tanh and the other activations by the same f(v)/v):
BERT's pooler + classifier and RoBERTa's and ELECTRA's classification heads (dense, activation, out
projection; the paper's H1-H3: the classifier bias gets one AbsDot weight per token over all classes),
DistilBERT's pre_classifier + ReLU + classifier, and a causal LM's unembedding at the explained
position (Gemma 2's soft-capping is not linear: the pre-cap logits are decomposed). Others are
refused. With `head=False` (the paper's "w/o classifier head") the saliency is the norm of the
explained position's parts after the last layer.

`global_maps["decompx"][l, i, k]` = ||x^{l+1}_{i<=k}||, already aggregated (never rolled out again).
Cost: the FF's n^2 d d' products per layer, as the scope maps; memory: about 6 (n, n, d) tensors at
the peak (`pieces_bytes`, measured; refused before any work above the budget module's memory budget)
and the FF in row chunks sized by the budget module's chunk (as the scope maps').
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ctxmix.engine.layer import gated_ig_weights, head_values, ig_ratio, value_bias_rows
from ctxmix.engine.models import Model
from ctxmix.engine.trace import Trace
from ctxmix.errors import BadInput
from ctxmix.methods.readout import explained_logits, softcap, unembedding

BIASES = ("absdot", "none")
FF_RULES = ("zero_origin", "tangent")
EPS = 1e-12  # the code's guard in AbsDot's denominator
# DecompX's peak memory, counted by what is alive at once. Measured by recording every tensor storage
# allocated while `decompx` runs (a TorchDispatchMode over the aten ops: an output that shares no
# input's storage is a new allocation, freed when the last tensor on it dies; `_LivePeak` in
# tests/test_decompx.py, which checks these counts on every layer shape), on random float32 models of
# every shape (n 96-192, d 64-256, d' 8-1024, H dh from d/2 to 2d, chunks of 4 rows to all n), and
# cross-checked on CPU against the RSS high-water mark of a fresh process with glibc mapping every block
# >= 128 KiB (MALLOC_MMAP_THRESHOLD_; VmHWM reset just before): the same counts, except the output
# buffer, whose pages are only touched as the FF writes its rows. Two phases per layer:
# - attention: R (n, n, d) tensors (input pieces, the LN1 pieces the values read (not post-LN), the
#   attention output) and 3 of width H dh (value heads, their attention mix, its (n, n, H dh) copy),
#   or, while h is formed, R + 3 of width d (a + x, the spread's product, h);
# - FF: 3 (n, n, d) tensors (input pieces, h, output) and one chunk of c rows: FF_ROW_COPIES (c, n, d)
#   (the FF's input and output pieces, the spreads' products, the LN2 pieces), or at its widest the FF
#   input pieces and FF_WIDE_COPIES (c, n, d') (zeta, the spread's product and eta; gated: both
#   projections, their spreads and the two products; tangent: also the slope's product), or, through
#   the output projection, eta and 4 (c, n, d) (the FF input pieces, eta W_2, the spread's product and
#   the FF's output pieces).
ATTN_RESIDENT = {"post": 2}  # R; 3 in every other layer shape (LN1 pieces)
HEAD_COPIES = 3
FF_RESIDENT = 3
FF_ROW_COPIES = 5
FF_WIDE_COPIES = {"gated": 5, "tangent": 4, "zero_origin": 3}
SMALL_COPIES = 3  # (n, n) beside them: AbsDot's weights and their normalisation, a norm's per-piece means


def _ff_row_elements(lw, n: int, ff: str) -> int:
    """Elements one FF row's temporaries hold at their widest: n x max(5 d, d + k d', 4 d + d')."""
    d = lw.Wo.shape[1]
    width = lw.Wu.shape[1] if lw.gated else lw.W1.shape[1]
    wide = FF_WIDE_COPIES["gated" if lw.gated else ff]
    return n * max(FF_ROW_COPIES * d, d + wide * width, 4 * d + width)


def pieces_bytes(model: Model, n: int, ff: str = "zero_origin") -> int:
    """Bytes DecompX holds at its peak on n tokens (the counts above; the FF chunk as `ff_chunk_rows`
    sizes it), plus the per-layer (n, n) norms it keeps, SMALL_COPIES (n, n) and two rows (n, max(d, d'))."""
    lw = model.layers[0]
    d, hd = lw.Wo.shape[1], lw.n_heads * lw.head_dim
    width = lw.Wu.shape[1] if lw.gated else lw.W1.shape[1]
    r = ATTN_RESIDENT.get(lw.position, 3)
    attention = n * n * (r * d + HEAD_COPIES * max(hd, d))
    ff_phase = FF_RESIDENT * n * n * d + ff_chunk_rows(lw, n, model.device, None, ff) * _ff_row_elements(lw, n, ff)
    small = (model.n_layers + SMALL_COPIES) * n * n + 2 * n * max(d, width)
    return (max(attention, ff_phase) + small) * (torch.finfo(model.work_dtype).bits // 8)


def check_pieces_fit(model: Model, n: int, ff: str = "zero_origin") -> None:
    """Refuse, before any work, an input whose peak memory (`pieces_bytes`) exceeds the device's memory
    budget (`ctxmix.engine.budget.memory_budget`), naming the longest input that fits."""
    from ctxmix.engine.budget import memory_budget

    budget = memory_budget(model.device)
    need = pieces_bytes(model, n, ff)
    if need > budget:
        lo, hi = 0, n  # pieces_bytes grows with n: the longest length within the budget, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pieces_bytes(model, mid, ff) <= budget else (lo, mid - 1)
        raise BadInput(
            f"decompx on {n} tokens holds {need / 2**30:.1f} GiB at its peak (about 6 x n x n x d: every "
            f"token's part of every hidden state, and their temporaries), more than this device's memory "
            f"budget of {budget / 2**30:.1f} GiB; inputs up to about {lo} tokens fit (a GPU's budget is larger)"
        )


def ff_chunk_rows(lw, n: int, device, chunk: int | None, ff: str = "zero_origin") -> int:
    """FF rows per chunk: the chunk's temporaries (`_ff_row_elements` per row) within the budget
    module's chunk size; at most n."""
    if chunk:
        return int(chunk)
    from ctxmix.engine.budget import chunk_elements
    from ctxmix.methods.mixing import CHUNK_ELEMENTS  # the scope maps' chunk, the same products

    return max(1, min(n, chunk_elements(device, CHUNK_ELEMENTS) // max(1, _ff_row_elements(lw, n, ff))))


def spread(V: torch.Tensor, b: torch.Tensor | None, rule: str = "absdot") -> torch.Tensor:
    """S_b: bias b (D,) or per row (c, D) over the token pieces V (c, n, D) of each row by AbsDot.
    rule "none" drops it. A row whose every piece is orthogonal to b keeps b nowhere (as the code)."""
    if b is None or rule == "none":
        return V
    bb = b.expand(V.shape[0], -1) if b.dim() == 1 else b
    w = torch.einsum("ckd,cd->ck", V, bb).abs()
    w = w / (w.sum(-1, keepdim=True) + EPS)
    return V + w.unsqueeze(-1) * bb.unsqueeze(1)


def norm_pieces(norm, V: torch.Tensor, real: torch.Tensor, rule: str) -> torch.Tensor:
    """A norm applied to pieces V (c, n, d) of rows whose real input is `real` (c, d): each piece's own
    mean removed (LayerNorm), divided by the real vector's scale, times gamma; beta spread by AbsDot on
    those normalised pieces (the code's weights)."""
    if norm.kind == "identity":
        return V
    P = norm.decompose_pieces(V, norm.scale(real))
    return spread(P, norm.beta, rule)


@dataclass
class DecompXOptions:
    bias: str = "absdot"
    ff: str = "zero_origin"
    head: bool = True
    chunk: int | None = None  # FF rows per chunk (None: from the budget module's chunk size)

    def check(self) -> DecompXOptions:
        if self.bias not in BIASES:
            raise BadInput(
                f"decompx's bias must be one of {', '.join(BIASES)}, got {self.bias!r}; "
                "e.g. explain(..., decompx={'bias': 'none'})"
            )
        if self.ff not in FF_RULES:
            raise BadInput(
                f"decompx's ff must be one of {', '.join(FF_RULES)}, got {self.ff!r}; "
                "e.g. explain(..., decompx={'ff': 'zero_origin'}) (the default)"
            )
        if not isinstance(self.head, bool):
            raise BadInput(
                f"decompx's head must be True or False, got {self.head!r}; e.g. explain(..., decompx={{'head': False}})"
            )
        return self


def _slope(act, u: torch.Tensor) -> torch.Tensor:
    """f'(u) of an elementwise activation (autograd, one pass)."""
    with torch.enable_grad():
        x = u.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(act(x).sum(), x)
    return g.detach()


def ff_pieces(lw, z: torch.Tensor, u: torch.Tensor, up: torch.Tensor | None, Z: torch.Tensor, o: DecompXOptions):
    """The FF's output pieces for rows whose FF input pieces are Z (c, n, d): the real FF input z (c, d)
    and pre-activations u (gate) and up (gated FFs) freeze the activation."""
    if lw.gated:
        if o.ff == "tangent":
            raise BadInput(
                "decompx's ff 'tangent' applies to plain FFs; a gated FF takes decompx={'ff': 'zero_origin'} "
                "(the default, exact IG)"
            )
        I1, I2 = gated_ig_weights(u, lw.act)
        gz = spread(Z @ lw.Wg, lw.bg, o.bias)
        uz = spread(Z @ lw.Wu, lw.bu, o.bias)
        eta = gz * (up * I1).unsqueeze(1) + uz * I2.unsqueeze(1)
        del gz, uz  # only eta stays alive through the output projection (the memory count's 4 d + d')
    else:
        zeta = spread(Z @ lw.W1, lw.b1, o.bias)
        if o.ff == "zero_origin":
            eta = zeta * ig_ratio(u, lw.act).unsqueeze(1)
        else:
            m = _slope(lw.act, u)
            eta = spread(zeta * m.unsqueeze(1), lw.act(u) - m * u, o.bias)
        del zeta
    return spread(eta @ lw.W2, lw.b2, o.bias)


def _attention(lw, alpha: torch.Tensor, N: torch.Tensor) -> torch.Tensor:
    """a_{i<=k} = sum_h sum_j alpha^h_ij (N_{j<=k} W_V^h) W_O^h for pieces N (n_j, n_k, d) -> (n_i, n_k, d)."""
    n, K, d = N.shape
    v = head_values(lw, N, with_bias=False)  # (n_j, H, n_k, dh), value heads shared as in GQA by the engine
    mixed = torch.einsum("hij,jhke->ikhe", alpha, v)  # (n_i, n_k, H, dh)
    return mixed.reshape(n, K, -1) @ lw.Wo


def decompx_layer(lw, st, V: torch.Tensor | None, o: DecompXOptions) -> torch.Tensor:
    """One layer: input pieces V (n_i, n_k, d) (None: the first layer, x_{i<=k} = delta_ik x_i) ->
    output pieces (n, n, d), summing over k to the layer's real output."""
    n, d = st.x.shape
    alpha = st.alpha
    eye = torch.eye(n, dtype=st.x.dtype, device=st.x.device)
    first = V is None
    X = eye.unsqueeze(-1) * st.x.unsqueeze(0) if first else V  # (n_i, n_k, d)
    src = X if lw.position == "post" else norm_pieces(lw.ln1, X, st.x, o.bias)  # what the values read
    if first:  # the code's layer 1: the value bias goes to token k through alpha^h_ik
        f = head_values(lw, st.x if lw.position == "post" else lw.ln1(st.x), with_bias=True)  # (H, n, dh)
        a = torch.einsum("hik,hke->ikhe", alpha, f).reshape(n, n, -1) @ lw.Wo
        b_att = lw.bo.expand(n, d)
    else:
        a = _attention(lw, alpha, src)
        b_att = value_bias_rows(lw, None, alpha) + lw.bo  # the sums of alpha kept (float32 softmaxes)
    if lw.position == "sandwich":  # h = x + LNa(a): the bias spread on the attention pieces, then LNa
        h = X + norm_pieces(lw.post_attn_norm, spread(a, b_att, o.bias), st.attn, o.bias)
    else:
        h = spread(a + X, b_att, o.bias)  # the code's prior term: attention plus residual
    del a, src  # only h and the output stay alive through the FF
    out = torch.empty_like(h)
    step = ff_chunk_rows(lw, n, st.x.device, o.chunk, o.ff)
    for r0 in range(0, n, step):
        r = slice(r0, min(n, r0 + step))
        up = None if st.u_up is None else st.u_up[r]
        if lw.position == "post":
            Z = norm_pieces(lw.ln1, h[r], st.r1[r], o.bias)
            out[r] = norm_pieces(lw.ln2, Z + ff_pieces(lw, st.z[r], st.u[r], up, Z, o), st.r2[r], o.bias)
        elif lw.position == "parallel":  # the FF reads LN2(x): x's pieces, not h's
            Z = norm_pieces(lw.ln2, X[r], st.x[r], o.bias)
            out[r] = h[r] + ff_pieces(lw, st.z[r], st.u[r], up, Z, o)
        else:
            Z = norm_pieces(lw.ln2, h[r], st.r1[r], o.bias)
            F = ff_pieces(lw, st.z[r], st.u[r], up, Z, o)
            if lw.position == "sandwich":
                F = norm_pieces(lw.post_ff_norm, F, st.ff[r], o.bias)
            out[r] = h[r] + F
    return out


# ---------------------------------------------------------------- heads


def head_kind(model: Model) -> str:
    """Which head rule applies: "pooler" (BERT), "dense" (RoBERTa, ELECTRA: dense, act, out_proj),
    "distilbert", "lm" (a causal LM's unembedding), "none" (an encoder without a head)."""
    cls = type(model.hf).__name__
    if model.kind == "encoder":
        return "none"
    if model.kind == "causal_lm":
        return "lm"
    if model.kind == "classifier":
        if cls == "BertForSequenceClassification":
            return "pooler"
        if cls in (
            "RobertaForSequenceClassification",
            "XLMRobertaForSequenceClassification",
            "CamembertForSequenceClassification",
            "ElectraForSequenceClassification",
        ):
            return "dense"
        if cls == "DistilBertForSequenceClassification":
            return "distilbert"
    raise BadInput(
        f"decompx has no rule for the head of {model.name} ({cls}); supported: BERT's pooler + classifier, "
        "RoBERTa's, XLM-R's, CamemBERT's and ELECTRA's classification heads, DistilBERT's, a causal LM's "
        "unembedding; or explain(..., decompx={'head': False}) (the saliency is then the norm of the explained "
        "row's parts)"
    )


def _dense_head_parts(x_cls: torch.Tensor, P: torch.Tensor, lin1, act, lin2, o: DecompXOptions) -> torch.Tensor:
    """Token pieces P (n_k, d) of the row a head reads (real x_cls (d,)) through dense -> act -> out:
    (n_k, C), summing over k to the logits. The activation by f(v)/v of its real pre-activation; the
    out projection's bias with one AbsDot weight per token over all classes (the code's H3)."""
    W1, b1 = lin1.weight.T.to(P.dtype), lin1.bias.to(P.dtype)
    v = x_cls @ W1 + b1
    Pp = spread((P @ W1).unsqueeze(0), b1, o.bias)[0] * ig_ratio(v, act)
    W2, b2 = lin2.weight.T.to(P.dtype), lin2.bias.to(P.dtype)
    return spread((Pp @ W2).unsqueeze(0), b2, o.bias)[0]


def head_parts(
    model: Model, V: torch.Tensor, x_last: torch.Tensor, position: int, tokens: list[int] | None, o: DecompXOptions
) -> tuple[torch.Tensor, list[str]]:
    """(K, n) signed parts of the K logits (every class; or the LM's `tokens` at `position`) from the
    last pieces V (n, n, d) and the real last states x_last (n, d)."""
    kind = head_kind(model)
    hf = model.hf
    if kind == "pooler":
        pool = hf.bert.pooler.dense
        return _dense_head_parts(x_last[0], V[0], pool, torch.tanh, hf.classifier, o).T, []
    if kind == "dense":
        c = hf.classifier
        act = torch.tanh if "Roberta" in type(hf).__name__ or "Camembert" in type(hf).__name__ else c.activation
        return _dense_head_parts(x_last[0], V[0], c.dense, act, c.out_proj, o).T, []
    if kind == "distilbert":
        return _dense_head_parts(x_last[0], V[0], hf.pre_classifier, torch.relu, hf.classifier, o).T, []
    # a causal LM: the unembedding rows of the target (and foil) at the explained position
    U, ub = unembedding(model, tokens)
    parts = V[position] @ U.T  # (n_k, K)
    if ub is not None:  # one AbsDot weight per token over the explained rows, as the classifier's bias
        parts = spread(parts.unsqueeze(0), ub, o.bias)[0]
    notes = []
    if softcap(model):
        notes.append(f"{model.name} soft-caps its logits: decompx decomposes the pre-cap logits")
    return parts.T, notes


# ---------------------------------------------------------------- the whole model


@dataclass
class DecompXResult:
    """norms (L, n, n): ||x^{l+1}_{i<=k}||; parts (K, n) signed logit parts (None without the head);
    logits (K,) the model's own logits of those rows (an LM that soft-caps: the recomputed pre-cap ones,
    `ctxmix.methods.readout.explained_logits`); completeness (L,) max |sum_k pieces -
    real state| / max |state| per layer; notes."""

    norms: np.ndarray
    parts: np.ndarray | None
    logits: np.ndarray | None
    completeness: np.ndarray
    notes: list[str] = field(default_factory=list)


@torch.no_grad()
def decompx(model: Model, tr: Trace, position: int, tokens: list[int] | None, o: DecompXOptions) -> DecompXResult:
    """DecompX on one traced sequence; `tokens`: the LM rows to explain (target, foil), else every class."""
    V = None
    norms, comp = [], []
    for lw, st in zip(model.layers, tr.states):
        V = decompx_layer(lw, st, V, o)
        norms.append(V.norm(dim=-1))
        comp.append(float((V.sum(1) - st.y).abs().max() / st.y.abs().max().clamp(min=1e-30)))
    x_last = tr.states[-1].y
    final = model.final_norm
    if final is not None and model.spec.position != "post":
        V = norm_pieces(final, V, x_last, o.bias)
        x_last = final(x_last)
    parts = logits = None
    notes: list[str] = []
    if o.head and head_kind(model) != "none":
        P, notes = head_parts(model, V, x_last, position, tokens, o)
        parts = P.double().cpu().numpy()
        if model.kind == "causal_lm":  # the recomputed pre-cap logits where the model soft-caps
            own = tr.logits[position] if tr.logits is not None else None
            lg = explained_logits(model, tr.states[-1].y[position], tokens, own)
        else:
            lg = tr.logits
        logits = lg.reshape(-1).double().cpu().numpy()
    return DecompXResult(
        norms=torch.stack(norms).double().cpu().numpy(),
        parts=parts,
        logits=logits,
        completeness=np.array(comp),
        notes=notes,
    )


def decompx_fields(ex, model: Model, tr: Trace, target, foil, options: dict | None) -> None:
    """Fill an Explanation's decompx fields (its position set): global_maps (L, n, n) of the parts'
    norms; with a head, logit_contributions (C, n) (an LM: the target's and the foil's rows) and the
    signed saliency of the target (minus the foil); without, the explained row's last-layer norms."""
    from ctxmix.methods.saliency import resolve_foil, resolve_target

    o = DecompXOptions(**(options or {})).check()
    t = ex.position
    use_head = o.head and head_kind(model) != "none"
    tgt = f = None
    if use_head:
        tgt = resolve_target(model, tr, target, t)
        f = resolve_foil(model, tr, foil, tgt, t)
    tokens = None if model.kind != "causal_lm" else [tgt] + ([f] if f is not None else [])
    res = decompx(model, tr, t, tokens, o)
    ex.global_maps["decompx"] = res.norms
    for note in res.notes:
        if note not in ex.warnings:
            ex.warnings.append(note)
    ex.options["decompx"] = {"bias": o.bias, "ff": o.ff, "head": o.head}
    if res.parts is None:
        ex.saliency["decompx"] = res.norms[-1][t].copy()
        return
    ex.target, ex.foil = tgt, f
    rows = (0, 1) if model.kind == "causal_lm" else (tgt, f)
    ex.logit_contributions["decompx"] = res.parts
    sal = res.parts[rows[0]] - (res.parts[rows[1]] if f is not None else 0)
    ex.saliency["decompx"] = sal
    want = float(res.logits[rows[0]] - (res.logits[rows[1]] if f is not None else 0))
    # with biases spread every part is some token's; without, what they leave is reported
    ex.logit_terms["decompx"] = {"bias": want - float(sal.sum())} if o.bias == "none" else {}
    if model.kind == "classifier":
        labels = getattr(model.config, "id2label", None) or {}
        name = lambda c: str(labels.get(c, c))  # noqa: E731
        what = f"logit({name(tgt)})" + (f" - logit({name(f)})" if f is not None else "")
        ex.prediction = {**(ex.prediction or {}), "explained": {"what": what, "value": want}}
