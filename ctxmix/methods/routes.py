"""Information flow routes (Ferrando & Voita, EMNLP 2024): the subgraph of a Transformer's computation
that carries the information reaching one position's top residual state, extracted top-down.
(Over 500 lines: the rules of every architecture, the top-down extraction and the Routes result with
its exports read as one unit; the docstring below is the specification the tests check.)

Nodes, as the LM Transparency Tool names them (layers 0-based): ``X0_t`` the embedding of token t,
``A{l}_t`` the residual state after layer l's attention, ``M{l}_t`` layer l's FFN, ``I{l}_t`` the state
after layer l. A node's vector y is the sum of its incoming vectors z_k (plus biases nobody gets); each
incoming edge's importance is the ALTI proximity, normalised per target node (IFR Eq. 1-2)::

    prox(z, y) = max(||y||_p - ||y - z||_p, eps),   importance(z_k, y) = prox(z_k, y) / sum_k' prox(z_k', y)

with p = 1 and eps = 1e-5 the tool's defaults (eps = 0 is the paper's max(., 0)). Into ``A{l}_t`` come
one sub-edge per head h and source j <= t, alpha^h_tj f^h(x_j), with f^h(x_j) = norm(x_j) W_V^h W_O^h
(the source's own norm, exact), and the residual x_t; into ``I{l}_t`` the FFN's output (its bias
included, as the tool's hook_mlp_out) and ``A{l}_t``. Masked sources (j > t) count as zero parts, each
worth eps in the denominator, as the tool computes them.

Thresholding (`mode`): "subedge_renorm" (the paper's rule and the tool's default) drops every sub-edge
and residual part with importance <= tau, renormalises the rest, then sums heads into one edge per
source (the residual joins the self edge, IFR Eq. 4); "summed_edge" sums first and keeps the summed
edges > tau. Extraction is Algorithm 1: from ``I{L-1}_position`` down, keeping every edge above the
threshold and recursing into its source. Only the nodes the routes reach are computed, in chunks of
targets (the tool builds a dense pos x pos x head x d tensor per layer).

Biases (the tool's defects are not copied): b_O is never attributed; b_V, by default, neither (the tool
folds it into b_O; it adds it twice on raw weights), value_bias="distribute" gives it to the sources in
proportion to alpha (ALTI's convention). The FFN renormalisation is per node (the tool's PR #33 bug
renormalises over all positions).

Architectures (the paper covers pre-LN decoders; the rest is the note's derivation, §1.10): pre-LN
decoders and encoders as above; Gemma 2/3 (sandwich) scale each head part by the post-attention norm's
g / rms of the real attention output, and the FFN node reads the post-FFN norm's output; parallel blocks
(GPT-NeoX, Phi-1/2) have one node per layer whose parts are the sub-edges, the FFN (read from
``I{l-1}_t``) and the residual; post-LN encoders (BERT) linearise LN1 and LN2 with the target's real
scale, so every part of a node is centred and multiplied by gamma / sigma_t (ALTI's rule), and the whole
is the norm's output. Encoder-decoders are out of scope.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ctxmix.engine.budget import ROUTES_CHUNK_ELEMENTS as CHUNK_ELEMENTS  # chunks of (targets x sources x H x d)
from ctxmix.engine.layer import LayerState, head_vectors
from ctxmix.engine.models import Model
from ctxmix.engine.trace import Trace
from ctxmix.errors import BadInput

MODES = ("subedge_renorm", "summed_edge")
VALUE_BIAS = ("unattributed", "distribute")
EPS = 1e-5  # the tool's clip (routes/contributions.py); 0 is the paper's max(., 0)
NODE_TYPES = {"X": "original", "A": "after_attn", "M": "ffn", "I": "after_ffn"}


def node_name(kind: str, layer: int, position: int) -> str:
    """The tool's node id: X0_t, A{l}_t, M{l}_t, I{l}_t."""
    return f"{kind}{layer}_{position}"


def parse_node(name: str) -> tuple[str, int, int]:
    """(kind, layer, position) of a node id."""
    try:
        kind, rest = name[0], name[1:]
        layer, pos = rest.split("_")
        if kind not in NODE_TYPES:
            raise ValueError
        return kind, int(layer), int(pos)
    except ValueError:
        raise BadInput(f"{name!r} is not a routes node (X0_t, A<l>_t, M<l>_t or I<l>_t)") from None


def proximity(parts: torch.Tensor, whole: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    """max(||y||_p - ||y - z||_p, eps) for parts z (..., d) and their whole y broadcast to them."""
    return (
        torch.linalg.vector_norm(whole, ord=p, dim=-1) - torch.linalg.vector_norm(parts - whole, ord=p, dim=-1)
    ).clamp(min=eps)


def part_importance(parts: torch.Tensor, whole: torch.Tensor, p: float = 1, eps: float = EPS) -> torch.Tensor:
    """IFR Eq. 1: each part's proximity to the whole, normalised over the parts. parts (m, d), whole (d,)
    -> (m,). (The tool's neuron panel is this with the FFN's neurons and the residual as the parts.)"""
    prox = proximity(parts, whole.expand_as(parts), p, eps)
    return prox / prox.sum()


def threshold_renormalise(
    blocks: torch.Tensor, residual: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's rule per node: importances <= tau dropped, the rest renormalised to sum to one.
    blocks (c, ...), residual (c,) -> the same shapes (a node with nothing left keeps zeros)."""
    b = torch.where(blocks > tau, blocks, torch.zeros_like(blocks))
    r = torch.where(residual > tau, residual, torch.zeros_like(residual))
    z = b.reshape(len(b), -1).sum(-1) + r
    z = torch.where(z > 0, z, torch.ones_like(z))
    return b / z.view(-1, *([1] * (b.dim() - 1))), r / z


# ---------------------------------------------------------------- one layer's parts


@dataclass(kw_only=True)
class _LayerParts:
    """What the nodes of one layer are made of, for every position (n, ...) of one sequence (built by
    name: nine fields, several of the same shape).

    vo (H, n, d): each source's head vector before alpha; sub_scale (n, d) or None: the per-target map
    of head parts (post-LN: gamma / sigma_t after centring, sandwich: g / rms_t); res (n, d): the
    residual part into the attention node (or the parallel node); whole_a (n, d): the attention node
    (the parallel node's whole); ffn, ffn_res, whole_i (n, d): the FFN node's parts and whole (None for
    a parallel layer, whose FFN part is `ffn` and whose node is whole_a)."""

    alpha: torch.Tensor
    vo: torch.Tensor
    sub_scale: torch.Tensor | None
    res: torch.Tensor
    whole_a: torch.Tensor
    ffn: torch.Tensor
    ffn_res: torch.Tensor | None
    whole_i: torch.Tensor | None
    parallel: bool


def _norm_map(norm, real: torch.Tensor) -> torch.Tensor:
    """gamma / s(real) (n, d): the per-target linear map of a norm with its scale frozen."""
    return norm.gamma / norm.scale(real)


def layer_parts(lw, st: LayerState, value_bias: str, dtype: torch.dtype) -> _LayerParts:
    """The parts of one layer's nodes from its traced state (see `_LayerParts`)."""
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, alpha = c(st.x), c(st.alpha)
    src = x if lw.position == "post" else c(st.x1)
    with_bias = value_bias == "distribute"
    vo = head_vectors(lw, src.to(lw.Wv.dtype), with_bias=with_bias).to(dtype)  # (H, n, d)
    if lw.position == "post":
        n1, n2 = lw.ln1, lw.ln2
        m1, m2 = _norm_map(n1, c(st.r1)), _norm_map(n2, c(st.r2))
        return _LayerParts(
            alpha=alpha,
            vo=n1.centre(vo),
            sub_scale=m1,
            res=n1.centre(x) * m1,
            whole_a=c(st.z),
            ffn=n2.centre(c(st.ff)) * m2,
            ffn_res=n2.centre(c(st.z)) * m2,
            whole_i=c(st.y),
            parallel=False,
        )
    if lw.position == "parallel":
        return _LayerParts(
            alpha=alpha,
            vo=vo,
            sub_scale=None,
            res=x,
            whole_a=c(st.y),
            ffn=c(st.ff),
            ffn_res=None,
            whole_i=None,
            parallel=True,
        )
    if lw.position == "sandwich":
        na = lw.post_attn_norm
        r1, y = c(st.r1), c(st.y)
        return _LayerParts(
            alpha=alpha,
            vo=na.centre(vo),
            sub_scale=_norm_map(na, c(st.attn)),
            res=x,
            whole_a=r1,
            ffn=y - r1,
            ffn_res=r1,
            whole_i=y,
            parallel=False,
        )
    r1 = c(st.r1)
    return _LayerParts(
        alpha=alpha,
        vo=vo,
        sub_scale=None,
        res=x,
        whole_a=r1,
        ffn=c(st.ff),
        ffn_res=r1,
        whole_i=c(st.y),
        parallel=False,
    )


def attention_importance(
    P: _LayerParts, targets: list[int], causal: bool, p: float, eps: float, device_chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Importances of the parts into the attention node (or the parallel node) of each target:
    (c, n, H) per source and head, (c,) the residual, (c,) the FFN (parallel layers; else None).
    Targets run in chunks of at most `device_chunk` elements of (targets x sources x heads x d)."""
    H, n, d = P.vo.shape
    vo_T = P.vo.transpose(0, 1)  # (n, H, d)
    subs, ress, ffns = [], [], []
    step = max(1, device_chunk // max(1, n * H * d))
    for s0 in range(0, len(targets), step):
        ts = targets[s0 : s0 + step]
        J = max(ts) + 1 if causal else n  # sources past the last target are masked for all of them
        idx = torch.tensor(ts, device=P.vo.device)
        y = P.whole_a[idx]  # (c, d)
        a = P.alpha[:, idx, :J].permute(1, 2, 0)  # (c, J, H)
        parts = a.unsqueeze(-1) * vo_T[:J].unsqueeze(0)  # (c, J, H, d)
        if P.sub_scale is not None:
            parts = parts * P.sub_scale[idx].view(len(ts), 1, 1, d)
        sub = proximity(parts, y.view(len(ts), 1, 1, d), p, eps)
        del parts
        res = proximity(P.res[idx], y, p, eps)
        z = sub.sum((1, 2)) + res + (n - J) * H * eps  # the masked zero parts, eps each, as the tool
        if P.parallel:
            ffn = proximity(P.ffn[idx], y, p, eps)
            z = z + ffn
        z = torch.where(z > 0, z, torch.ones_like(z))  # eps = 0 and every part farther than the whole
        if P.parallel:
            ffns.append(ffn / z)
        full = torch.zeros((len(ts), n, H), dtype=sub.dtype, device=sub.device)
        full[:, :J] = sub / z.view(-1, 1, 1)
        if causal:  # masked sources are in the denominator, never parts of the routes
            later = torch.arange(n, device=idx.device).view(1, -1) > idx.view(-1, 1)
            full[later] = 0.0
        subs.append(full)
        ress.append(res / z)
    return torch.cat(subs), torch.cat(ress), (torch.cat(ffns) if P.parallel else None)


def ffn_importance(P: _LayerParts, targets: list[int], p: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c,) the FFN's and (c,) the residual's importance into each target's FFN node (sequential layers)."""
    idx = torch.tensor(targets, device=P.ffn.device)
    y = P.whole_i[idx]
    f = proximity(P.ffn[idx], y, p, eps)
    r = proximity(P.ffn_res[idx], y, p, eps)
    z = f + r
    z = torch.where(z > 0, z, torch.ones_like(z))  # eps = 0: a node no part is close to gets zeros
    return f / z, r / z


# ---------------------------------------------------------------- the routes


@dataclass
class Routes:
    """Information flow routes to the top residual state at `position`.

    nodes: node (X0_t, A<l>_t, M<l>_t, I<l>_t), type, layer, position, token: every node on a route.
    edges: source, target, weight, kind ("attention" one head's sub-edge, "residual", "ffn"), layer,
    head (attention only): the kept parts after thresholding and renormalisation (subedge_renorm), or
    the parts of each summed edge kept above the threshold (summed_edge).
    incoming: node, source, kind, head, importance (before any threshold), weight (kept): every part
    into each node the routes computed, from the sources the routes keep (the tool's side panels).
    """

    tokens: list[str]
    position: int
    threshold: float
    mode: str
    p: float
    eps: float
    value_bias: str
    n_layers: int
    n_heads: int
    nodes: pd.DataFrame
    edges: pd.DataFrame
    incoming: pd.DataFrame
    model_name: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def start(self) -> str:
        return node_name("I", self.n_layers - 1, self.position)

    def graph_edges(self) -> pd.DataFrame:
        """One row per (source, target): heads summed, the residual into an attention node merged into
        its self edge (as the tool draws them); kind "attention", "residual" (the bypass around an FFN)
        or "ffn"."""
        into_attention = (self.edges["kind"] == "residual") & ~self.edges["source"].str.startswith("A")
        e = self.edges.assign(kind=self.edges["kind"].where(~into_attention, "attention"))
        if e.empty:
            return e.drop(columns=["head"])
        g = e.groupby(["source", "target", "kind", "layer"], as_index=False, sort=False)["weight"].sum()
        return g[["source", "target", "weight", "kind", "layer"]]

    def node_detail(self, node: str) -> pd.DataFrame:
        """The parts into `node` by source and head (and the FFN's and the residual's shares), each with
        its importance before the threshold and its kept weight, largest first."""
        parse_node(node)
        d = self.incoming[self.incoming["node"] == node]
        if d.empty and node not in set(self.nodes["node"]):
            raise BadInput(f"{node} is not on these routes; nodes: {', '.join(self.nodes['node'].head(8))} ...")
        return d.sort_values("importance", ascending=False).reset_index(drop=True)

    def head_importance(self) -> pd.DataFrame:
        """Per (layer, head) with a sub-edge from a kept source into the routes' attention nodes: the
        summed importance of those sub-edges (before the threshold), and whether the head is activated
        (IFR footnote 4: a kept sub-edge; in summed_edge mode, a sub-edge above the threshold)."""
        d = self.incoming[self.incoming["kind"] == "attention"]
        layer = d["node"].map(lambda s: parse_node(s)[1])
        kept = d["weight"] > 0 if self.mode == "subedge_renorm" else d["importance"] > self.threshold
        g = d.assign(layer=layer, kept=kept).groupby(["layer", "head"], as_index=False)
        return g.agg(importance=("importance", "sum"), activated=("kept", "any"))

    def to_networkx(self):
        """A networkx DiGraph: nodes with their type, layer, position and token; edges as `graph_edges`,
        each with its per-head weights (`heads`: {head: weight})."""
        import networkx as nx

        G = nx.DiGraph()
        for r in self.nodes.itertuples(index=False):
            G.add_node(r.node, type=r.type, layer=int(r.layer), position=int(r.position), token=r.token)
        heads: dict[tuple[str, str], dict[int, float]] = {}
        for r in self.edges[self.edges["kind"] == "attention"].itertuples(index=False):
            heads.setdefault((r.source, r.target), {})[int(r.head)] = float(r.weight)
        for r in self.graph_edges().itertuples(index=False):
            G.add_edge(
                r.source,
                r.target,
                weight=float(r.weight),
                kind=r.kind,
                layer=int(r.layer),
                heads=heads.get((r.source, r.target), {}),
            )
        return G

    def to_dict(self) -> dict:
        return {
            "format": "ctxmix-routes",
            "version": 1,
            "model": self.model_name,
            "tokens": self.tokens,
            "position": self.position,
            "threshold": self.threshold,
            "mode": self.mode,
            "p": self.p,
            "eps": self.eps,
            "value_bias": self.value_bias,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "nodes": self.nodes.to_dict(orient="records"),
            "edges": json.loads(self.edges.to_json(orient="records")),
            "notes": self.notes,
        }

    def to_json(self, indent: int | None = None) -> str:
        """The graph as JSON (nodes, edges with per-head rows, and every parameter)."""
        return json.dumps(self.to_dict(), indent=indent)

    def figure(self, title: str | None = None):
        """The routes as the tool draws them (plotly): tokens as columns, layers as rows, A below I in
        each layer, the FFN as a square beside them; edge width and opacity by weight."""
        from ctxmix.export.plots import routes_figure

        return routes_figure(self, title)

    def __repr__(self) -> str:
        return (
            f"Routes({self.model_name or 'model'}, position {self.position} {self.tokens[self.position]!r}, "
            f"threshold {self.threshold}, {self.mode}: {len(self.nodes)} nodes, {len(self.graph_edges())} edges)"
        )


def check_routes_call(threshold, mode: str, p, eps, value_bias: str) -> None:
    """routes()'s options, checked before any work."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise BadInput(f"threshold must be a number in [0, 1) (the tool's default 0.04), got {threshold!r}")
    if mode not in MODES:
        raise BadInput(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (1 <= p < math.inf):
        raise BadInput(f"p (the distance's norm) must be a finite number >= 1 (1: L1, the default; 2: L2), got {p!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1e-2:
        raise BadInput(f"eps (the proximity's clip) must be in [0, 0.01) (tool: 1e-5, paper: 0), got {eps!r}")
    if value_bias not in VALUE_BIAS:
        raise BadInput(f"value_bias must be one of {', '.join(VALUE_BIAS)}, got {value_bias!r}")


# Below DENSE_THRESHOLD almost every edge survives and the graph is the dense one: every node of every
# layer, each with H parts per source, held as Python rows (edges and incoming parts, one row each). On
# smollm2 (30 layers x 9 heads) at threshold 0 that is 2.2 million rows per table at n = 128, built in
# 18 s on a 2-core AMD EPYC (about 8.5 us a row), so about 8.9 million (75 s) at 256, 35 million
# (several minutes, gigabytes) at 512 and 566 million at 2,048 (it would not finish). Over
# DENSE_MAX_TOKENS tokens such a threshold needs dense=True.
DENSE_THRESHOLD = 0.01
DENSE_MAX_TOKENS = 256


def dense_rows(model: Model, n: int) -> int:
    """Rows of each of the routes' tables (edges, incoming parts) when every edge is kept: one per layer,
    head, target and source, L * H * n(n+1)/2 under causal attention, L * H * n^2 otherwise."""
    pairs = n * (n + 1) // 2 if model.spec.causal else n * n
    return model.n_layers * model.n_heads * pairs


def check_dense(model: Model, n: int, threshold: float, dense) -> None:
    """Refuse, before the forward pass, a threshold below DENSE_THRESHOLD on more than DENSE_MAX_TOKENS
    tokens unless the caller asks for the dense graph (dense=True), with the rows it would build."""
    if not isinstance(dense, bool):
        raise BadInput(f"dense must be True or False, got {dense!r}")
    if dense or threshold >= DENSE_THRESHOLD or n <= DENSE_MAX_TOKENS:
        return
    raise BadInput(
        f"routes with threshold {threshold:g} on {n} tokens keep nearly every edge: up to about "
        f"{dense_rows(model, n):,} rows in each table ({model.n_layers} layers x {model.n_heads} heads x "
        f"{'n(n+1)/2' if model.spec.causal else 'n^2'} token pairs), which can take hours and tens of GB; "
        f"a threshold below {DENSE_THRESHOLD} is allowed up to {DENSE_MAX_TOKENS} tokens. Use threshold >= "
        f"{DENSE_THRESHOLD} (the default 0.04), or pass dense=True (CLI: --dense) to build the dense graph anyway"
    )


def resolve_position(n: int, position, default: int) -> int:
    if position is None:
        return default
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise BadInput(
            f"position must be a whole number (a token index; negative counts from the end), got {position!r}"
        )
    t = int(position) + (n if position < 0 else 0)
    if not 0 <= t < n:
        raise BadInput(f"position {position} is outside the {n} tokens")
    return t


class _Collector:
    """Edges and incoming parts as columns, turned into DataFrames once."""

    def __init__(self):
        self.edges: dict[str, list] = {k: [] for k in ("source", "target", "weight", "kind", "layer", "head")}
        self.incoming: dict[str, list] = {k: [] for k in ("node", "source", "kind", "head", "importance", "weight")}

    def edge(self, source, target, weight, kind, layer, head=None):
        for k, v in zip(self.edges, (source, target, float(weight), kind, layer, head)):
            self.edges[k].append(v)

    def part(self, node, source, kind, head, importance, weight):
        for k, v in zip(self.incoming, (node, source, kind, head, float(importance), float(weight))):
            self.incoming[k].append(v)

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        e = pd.DataFrame(self.edges)
        e["head"] = pd.array(e["head"], dtype="Int64")
        e["layer"] = e["layer"].astype(int)
        i = pd.DataFrame(self.incoming)
        i["head"] = pd.array(i["head"], dtype="Int64")
        return e, i


def _attention_node(
    col: _Collector,
    l: int,
    t: int,
    node: str,
    src_name,
    sub: torch.Tensor,
    res: float,
    ffn: float | None,
    tau: float,
    mode: str,
    parallel: bool,
) -> set[int]:
    """Thresholds one attention (or parallel) node's parts, records its edges and incoming parts, and
    returns the source positions it keeps. sub (n, H) importances."""
    n, H = sub.shape
    raw_sub = sub
    if mode == "subedge_renorm":
        blocks = sub if ffn is None else torch.cat([sub.reshape(-1), sub.new_tensor([ffn])])
        kb, kr = threshold_renormalise(blocks.reshape(1, -1), sub.new_tensor([res]), tau)
        kept_r: float = float(kr[0])
        k_sub = kb[0, : n * H].view(n, H)
        k_ffn = float(kb[0, -1]) if ffn is not None else None
        w = k_sub.sum(-1)
        w[t] += kept_r
        keep_src = (w > 0).nonzero().flatten().tolist()
        keep_ffn = k_ffn is not None and k_ffn > 0
    else:
        # the kept unit is the summed edge: its heads and (on the self edge) the residual are its parts
        k_sub, k_ffn = sub, ffn
        w = sub.sum(-1)
        w[t] += res
        keep_src = (w > tau).nonzero().flatten().tolist()
        kept_r = res if t in keep_src else 0.0
        keep_ffn = ffn is not None and ffn > tau
    ks = k_sub.detach().cpu().numpy()
    rs = raw_sub.detach().cpu().numpy()
    for j in keep_src:
        s = src_name(j)
        for h in range(H):
            col.part(node, s, "attention", h, rs[j, h], ks[j, h])
            if ks[j, h] > 0:
                col.edge(s, node, ks[j, h], "attention", l, h)
        if j == t and kept_r > 0:
            col.edge(s, node, kept_r, "residual", l)
    col.part(node, src_name(t), "residual", None, res, kept_r)
    if parallel and ffn is not None:
        m = node_name("M", l, t)
        col.part(node, m, "ffn", None, ffn, k_ffn if keep_ffn else 0.0)
        if keep_ffn:
            col.edge(src_name(t), m, k_ffn, "ffn", l)
            col.edge(m, node, k_ffn, "ffn", l)
    out = set(keep_src)
    if keep_ffn:
        out.add(t)
    return out


def _source_namer(layer: int):
    """Names of layer `layer`'s sources: the previous layer's I nodes, or the embeddings X0."""
    if layer == 0:
        return lambda j: node_name("X", 0, j)
    return lambda j: node_name("I", layer - 1, j)


@torch.no_grad()
def routes_from_trace(
    model: Model,
    tr: Trace,
    position: int,
    threshold: float = 0.04,
    mode: str = "subedge_renorm",
    p: float = 1,
    eps: float = EPS,
    value_bias: str = "unattributed",
) -> Routes:
    """The routes of a traced sequence (see `routes`)."""
    from ctxmix.engine.budget import chunk_elements

    check_routes_call(threshold, mode, p, eps, value_bias)
    n = tr.n
    position = resolve_position(n, position, n - 1)
    dtype = torch.float64 if model.work_dtype == torch.float64 else torch.float32  # norms never in half (P9)
    causal = model.spec.causal
    L = model.n_layers
    H = model.n_heads
    chunk = chunk_elements(model.device, CHUNK_ELEMENTS)
    col = _Collector()
    frontier = {position}
    for l in range(L - 1, -1, -1):
        lw, st = model.layers[l], tr.states[l]
        P = None  # the layer above's parts (n x H x d head vectors) go before this layer's are made
        P = layer_parts(lw, st, value_bias, dtype)
        src_name = _source_namer(l)
        nxt: set[int] = set()
        ts = sorted(frontier)
        if P.parallel:
            sub, res, ffn = attention_importance(P, ts, causal, p, eps, chunk)
            for k, t in enumerate(ts):
                node = node_name("I", l, t)
                nxt |= _attention_node(
                    col, l, t, node, src_name, sub[k], float(res[k]), float(ffn[k]), threshold, mode, True
                )
        else:
            f, r = ffn_importance(P, ts, p, eps)
            if mode == "subedge_renorm":
                kf, kr = threshold_renormalise(f.view(-1, 1), r, threshold)
                kf = kf.view(-1)
                keep_f, keep_r = kf > 0, kr > 0
            else:
                kf, kr = f, r
                keep_f, keep_r = f > threshold, r > threshold
            mids = []
            for k, t in enumerate(ts):
                a, m, i = node_name("A", l, t), node_name("M", l, t), node_name("I", l, t)
                col.part(i, m, "ffn", None, float(f[k]), float(kf[k]) if keep_f[k] else 0.0)
                col.part(i, a, "residual", None, float(r[k]), float(kr[k]) if keep_r[k] else 0.0)
                if keep_f[k]:
                    col.edge(a, m, float(kf[k]), "ffn", l)
                    col.edge(m, i, float(kf[k]), "ffn", l)
                if keep_r[k]:
                    col.edge(a, i, float(kr[k]), "residual", l)
                if keep_f[k] or keep_r[k]:
                    mids.append(t)
            if mids:
                sub, res, _ = attention_importance(P, mids, causal, p, eps, chunk)
                for k, t in enumerate(mids):
                    nxt |= _attention_node(
                        col, l, t, node_name("A", l, t), src_name, sub[k], float(res[k]), None, threshold, mode, False
                    )
        del P
        frontier = nxt
    edges, incoming = col.frames()
    reached = {node_name("I", L - 1, position)} | set(edges["source"]) | set(edges["target"])
    return Routes(
        tokens=list(tr.tokens),
        position=position,
        threshold=float(threshold),
        mode=mode,
        p=float(p),
        eps=float(eps),
        value_bias=value_bias,
        n_layers=L,
        n_heads=H,
        nodes=_node_frame(reached, tr.tokens),
        edges=edges,
        incoming=incoming,
        model_name=model.name,
        notes=list(tr.notes),
    )


def _node_frame(names: set[str], tokens: list[str]) -> pd.DataFrame:
    rows = []
    for s in names:
        kind, layer, pos = parse_node(s)
        rows.append({"node": s, "type": NODE_TYPES[kind], "layer": layer, "position": pos, "token": tokens[pos]})
    order = {"X": 0, "A": 1, "M": 2, "I": 3}
    df = pd.DataFrame(rows, columns=["node", "type", "layer", "position", "token"])
    if df.empty:
        return df
    key = df["node"].map(lambda s: (parse_node(s)[1], order[s[0]] if s[0] != "X" else -1, parse_node(s)[2]))
    return df.iloc[sorted(range(len(df)), key=lambda i: key.iloc[i])].reset_index(drop=True)


def routes(
    model: Model,
    text=None,
    position: int | None = None,
    threshold: float = 0.04,
    *,
    input_ids: list[int] | None = None,
    mode: str = "subedge_renorm",
    p: float = 1,
    eps: float = EPS,
    value_bias: str = "unattributed",
    dense: bool = False,
) -> Routes:
    """Information flow routes (Ferrando & Voita 2024) to the top residual state at `position` (the
    last token by default on a decoder; [CLS] on an encoder; negative counts from the end).

    The routes explain that residual vector, not a token's logit: they take no target or foil (pair them
    with `explain(..., ["alti_logit"])` for a logit). threshold: tau (the tool's default 0.04; the paper
    uses 0.01-0.04); mode: "subedge_renorm" (the paper's rule) or "summed_edge"; p: the distance's norm
    (1, the default; 2 as some of the tool's tests); eps: the proximity's clip (the tool's 1e-5; 0 is the
    paper's); value_bias: "unattributed" (the tool) or "distribute" (ALTI's). See `ctxmix.methods.routes`
    for the graph and every architecture's rule. Decoders and encoders; not encoder-decoders.
    dense: a threshold below 0.01 (`DENSE_THRESHOLD`) keeps nearly every edge, about L * H * n^2 / 2 rows
    held in Python; on more than 256 tokens (`DENSE_MAX_TOKENS`) it is refused before the forward pass
    unless dense=True asks for that graph explicitly.
    """
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.explain import default_position, encode_one

    check_routes_call(threshold, mode, p, eps, value_bias)
    if model.spec.encoder_decoder:
        raise BadInput("routes explain decoders and encoders; encoder-decoders are out of scope")
    if (text is None) == (input_ids is None):
        raise BadInput("give a text or input_ids (one of them)")
    e = encode_one(model, text if input_ids is None else input_ids, ids=input_ids is not None)
    pos = resolve_position(len(e.ids), position, default_position(model, e.ids))
    check_dense(model, len(e.ids), threshold, dense)
    from ctxmix.methods.memory import check_memory

    check_memory(model, len(e.ids), call="routes")
    tr = trace_ids(model, e.ids, e.notes, e.token_type_ids, e.segments)
    return routes_from_trace(model, tr, pos, threshold, mode, p, eps, value_bias)
