"""How much memory a call will take, before it runs: `ctxmix.estimate_memory` and the refusal built on it.

Over 500 lines because every call's phases are followed in one place, where they are read together.

The estimate adds the parts of the memory account (`ctxmix.engine.memory`) that a call holds at its peak, per
device, following the call's code path: the weights as placed, the forward pass (the fused kernel's outputs,
and the probabilities a method reads computed a block of rows at a time: every row, or the response rows;
a soft-capped family's eager attention by blocks; a sliding window's boolean mask), the traced states
(stored, or one layer at a time when `ctxmix.engine.streaming.streams` would stream them), the maps in the
engine's dtype and their float64 copies, one layer's head vectors, projected head values and FF maps, the chunk
temporaries at the sizes `ctxmix.engine.budget.chunk_rows` gives, the logits, and the ablation batch that
`ablation_batch_size` picks. Phases that do not overlap (the forward pass, the decomposition, the conversion of
the maps) are estimated each; the peak is the largest, and `parts` are that phase's.

A transformers config works without weights: the parameters are counted on `meta`, and the device's memory is
its capacity (`device_memory`; a CUDA device that is not present is taken as an 80 GB card). A loaded `Model`
is estimated over its loaded weights against what its devices can give now.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxmix.engine import memory as acct
from ctxmix.errors import BadInput

CALLS = ("explain", "scope_maps", "routes", "attribute_context")
GiB = 2**30
DEFAULT_CARD_BYTES = 80 * 10**9  # a CUDA device named but not present: an 80 GB card (H100, A100-80GB)
RESPONSE_TOKENS = 32  # `n_response` when not given: a few sentences of answer
ROUTES_TARGETS = 1  # targets per chunk routes counts: its frontier is the few states over the threshold
# On a CPU, the process's resident memory after the forward pass keeps its largest freed transient: glibc raises
# its mmap threshold to the size of a freed mapped block, so later blocks of that size come from the heap and stay
# resident. Measured at Llama-3-8B's widths, the decompositions' peak ran 25-30 % above the live tensors without it.
ALLOCATOR_KEPT = "freed by the forward pass, kept by the allocator (CPU)"
TOKENS_PER_SOURCE = 30  # `n_sources` when not given: sentences of about 30 tokens
# the context methods' memory phases (their records' `memory`): the response rows of one traced pass, a full
# trace, a forward pass kept for the backward, a batch of ablated prompts of about half the context or of all of it
CONTEXT_PHASES = ("rows", "full_trace", "backward", "ablations", "ablations_whole")


# The published configs of the models ctxmix's users study (their config.json files, trimmed to the widths), so
# that `ctxmix estimate --model llama-3-8b` works with no hub: the estimate needs widths, not weights.
_LLAMA3 = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
REFERENCE_CONFIGS: dict[str, dict] = {
    "llama-3-8b": _LLAMA3,
    "llama-3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
    },
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=36,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
}


def reference_config(name: str):
    """The transformers config of a model in `REFERENCE_CONFIGS` (no download)."""
    import transformers as T

    if name not in REFERENCE_CONFIGS:
        raise BadInput(f"no reference config {name!r}: one of {', '.join(REFERENCE_CONFIGS)}, or a config.json")
    return T.AutoConfig.for_model(**REFERENCE_CONFIGS[name])


@dataclass
class MemoryEstimate:
    """The estimated peak of one call. parts: {device: {part: bytes}} at the peak; `peak_bytes` the largest
    device's sum; `budget` {device: bytes it can give}; `fits()`; `largest` (part, device, bytes) and the option
    that shrinks it (`advice`); `to_frame()` a table; `str()` a readable account."""

    call: str
    n_tokens: int
    methods: tuple[str, ...]
    device: str
    parts: dict[str, dict[str, int]]
    budget: dict[str, int]
    weights_counted: bool
    notes: list[str] = field(default_factory=list)
    advice: dict[str, str] = field(default_factory=dict)
    # the largest device's peak over the phases counting live tensors only (without what the CPU's allocator keeps
    # of a freed transient): what a count of live tensors measures
    live_peak_bytes: int = 0

    @property
    def by_device(self) -> dict[str, int]:
        return {dev: int(sum(p.values())) for dev, p in self.parts.items()}

    @property
    def peak_bytes(self) -> int:
        """The largest device's estimated peak."""
        return max(self.by_device.values(), default=0)

    @property
    def largest(self) -> tuple[str, str, int]:
        """(part, device, bytes) of the largest part on the device that is most over its budget (else the
        fullest device)."""
        dev = max(self.parts, key=lambda d: self.by_device[d] - self.budget.get(d, 0))
        name = max(self.parts[dev], key=lambda k: self.parts[dev][k])
        return name, dev, self.parts[dev][name]

    def fits(self, budget: int | None = None) -> bool:
        """Whether every device's estimate is within its budget (or within `budget` bytes, for all)."""
        return all(b <= (self.budget.get(d, 0) if budget is None else budget) for d, b in self.by_device.items())

    def message(self) -> str:
        name, dev, size = self.largest
        tip = self.advice.get(name, "")
        over = "" if self.weights_counted else " over the loaded weights"
        devs = "; ".join(
            f"{d}: {b / GiB:.1f} GiB of {self.budget.get(d, 0) / GiB:.1f} GiB" for d, b in self.by_device.items()
        )
        return (
            f"{self.call} on {self.n_tokens:,} tokens needs about {self.peak_bytes / GiB:.1f} GiB{over} ({devs}). "
            f"Largest part: {name} on {dev}, {size / GiB:.2f} GiB" + (f"; to shrink it: {tip}" if tip else "")
        )

    def to_frame(self):
        import pandas as pd

        rows = [
            {"device": dev, "part": k, "bytes": v, "GiB": round(v / GiB, 3)}
            for dev, p in self.parts.items()
            for k, v in p.items()
        ]
        return pd.DataFrame(rows).sort_values(["device", "bytes"], ascending=[True, False], ignore_index=True)

    def __str__(self) -> str:
        lines = [self.message()]
        for dev, p in self.parts.items():
            lines.append(f"  {dev}:")
            lines += [f"    {k:<52} {v / GiB:9.3f} GiB" for k, v in sorted(p.items(), key=lambda kv: -kv[1])]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


ADVICE = {
    "weights (as stored)": "dtype='bfloat16', a 4-bit quantization, or a device_map that spreads the layers",
    "attention probabilities of every layer (stored trace)": "fewer tokens; the context methods logit/attention "
    "read only the response rows",
    "maps (float64, returned)": "fewer mixing methods, or fewer tokens",
    "maps (engine dtype, on the device)": "fewer mixing methods, or fewer tokens",
    "ablation batch": "batch_size=1",
    "logits": "fewer tokens (the logits are n x vocabulary)",
    "projected head values G (one layer)": "fewer tokens (n x heads x d' per FF projection)",
    "one layer's forward transient (attention block or MLP)": "fewer tokens",
    "sliding-window mask (n x n, boolean)": "fewer tokens",
    "chunk temporaries": "fewer tokens",
}


def _as_tuple(methods) -> tuple[str, ...]:
    return (methods,) if isinstance(methods, str) else tuple(methods)


def _layer_shares(model_or_config, device_map, engine: str, L: int) -> dict[str, float]:
    """{device: share of the layers} from a Model's `hf_device_map` or the layers_per_device given for a config
    ({device: number of layers or fraction}); everything on the engine device when there is none."""
    from ctxmix.engine.models import Model

    if isinstance(model_or_config, Model):
        dm = getattr(model_or_config.hf, "hf_device_map", None) or {}
        counts: dict[str, int] = {}
        for name, dev in dm.items():
            if ".layers." in f".{name}." or ".h." in f".{name}." or ".layer." in f".{name}.":
                key = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
                key = engine if key in ("cpu", "disk") else key  # offloaded layers run on the engine's device
                counts[key] = counts.get(key, 0) + 1
        total = sum(counts.values())
        return {d: c / total for d, c in counts.items()} if total else {engine: 1.0}
    if not device_map:
        return {engine: 1.0}
    if not isinstance(device_map, dict):
        raise BadInput("layers_per_device must be {device: layers or fraction}, e.g. {'cuda:0': 40, 'cuda:1': 40}")
    vals = {(f"cuda:{k}" if isinstance(k, int) else str(k)): float(v) for k, v in device_map.items()}
    for d in vals:
        if d != "disk":
            try:
                torch.device(d)
            except RuntimeError:
                raise BadInput(
                    f"layers_per_device: {d!r} is not one of 'cuda:N', 'cpu' or 'disk' (as accelerate places layers)"
                ) from None
    share_sum = float(sum(vals.values()))
    if share_sum <= 0 or min(vals.values()) < 0:
        raise BadInput("layers_per_device's shares must be positive")
    return {d: v / share_sum for d, v in vals.items()}


def _running_shares(shares: dict[str, float], engine: str) -> dict[str, float]:
    """Where each share of the layers runs: accelerate runs layers placed on "cpu" or "disk" on the main device
    (their weights are brought there by their hook when they run), so their activations are the engine's."""
    out: dict[str, float] = {}
    for d, s in shares.items():
        key = engine if d in ("cpu", "disk") and d != engine else d
        out[key] = out.get(key, 0.0) + s
    return out


def _capacity(dev: str, loaded: bool, device_memory: int | None, notes: list[str]) -> int:
    """What a device can give: now (a loaded model: free memory on CUDA plus what torch holds unused, available
    memory on the CPU), or its capacity (a config)."""
    from ctxmix.engine.budget import _cpu_available, cpu_total

    d = torch.device(dev)
    if device_memory is not None:
        return int(device_memory)
    if d.type == "cuda":
        if not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count():
            notes.append(f"{dev} is not present here: taken as an {DEFAULT_CARD_BYTES / 1e9:.0f} GB card")
            return DEFAULT_CARD_BYTES
        if loaded:
            free, _ = torch.cuda.mem_get_info(d)
            return int(free + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d))
        return int(torch.cuda.get_device_properties(d).total_memory)
    return _cpu_available() if loaded else cpu_total()


def _chunk_temporaries(
    W: acct.Widths, n: int, width: int, copies: int, dev: str, card: int | None, alive: int | None = None
) -> int:
    """The temporaries of one chunk of rows of a decomposition, at the size the engine picks (`chunk_rows`, which
    sizes a chunk for `copies` copies of rows x n x width), `alive` of them alive at once (default `copies`)."""
    from ctxmix.engine.budget import chunk_rows
    from ctxmix.methods.mixing import CHUNK_ELEMENTS

    elements = CHUNK_ELEMENTS if card is None else max(CHUNK_ELEMENTS, card // 64)
    rows = chunk_rows(n, width, copies, 1, elements, card)
    return rows * n * width * (alive or copies) * W.w


def estimate_memory(
    model_or_config: Any,
    n_tokens: int,
    *,
    call: str = "explain",
    methods=("alti",),
    dtype=None,
    device=None,
    n_response: int | None = None,
    layers_per_device: dict | None = None,
    device_memory: int | None = None,
    n_ablations: int = 32,
    batch_size: int = 8,
    n_sources: int | None = None,
    phases=None,
    device_map: dict | None = None,
) -> MemoryEstimate:
    """The peak memory of `call` on `n_tokens` tokens, per device, before anything runs (module docstring).

    model_or_config: a loaded `Model` (its placement, dtype and quantization as they are; weights not counted,
    they are loaded) or a transformers config (nothing loaded: `dtype` how the weights would be held, default
    the config's; the weights counted). call: "explain" (with `methods`), "scope_maps", "routes",
    "attribute_context" (with context `methods`, `n_response` response tokens, default 32, and `n_ablations`,
    `batch_size`, `n_sources` (default: one per 30 tokens) for the ablation methods; `phases`: the context methods'
    memory phases when a call knows better than their records, `ctxmix.methods.context.job.memory_phases`). device: the
    engine's device for a config ("cuda", "cpu";
    default: cuda when present). layers_per_device (config only): {device: layers or fraction} spreading the
    layers, e.g. {"cuda:0": 40, "cuda:1": 40} ("cpu" and "disk" as accelerate places them); the embeddings, the
    head and the engine's work stay on the first. device_memory: bytes per device instead of what is read (for a
    config on a device that is not here: an 80 GB card unless given). device_map: layers_per_device's old name,
    deprecated (a DeprecationWarning; it will mean a module -> device map as in `load_model`)."""
    from ctxmix.engine.models import Model
    from ctxmix.engine.placement import resolve_device

    if call not in CALLS:
        raise BadInput(f"call must be one of {', '.join(CALLS)}, got {call!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise BadInput(f"n_tokens must be a positive integer, got {n_tokens!r}")
    if device_map is not None:
        if layers_per_device is not None:
            raise BadInput("give layers_per_device only: device_map is its deprecated old name, not a second map")
        warnings.warn(
            "estimate_memory's device_map is deprecated: use layers_per_device (the same {device: layers}); "
            "device_map will mean a module -> device map as in load_model",
            DeprecationWarning,
            stacklevel=2,
        )
        layers_per_device = device_map
    methods = _as_tuple(methods)
    loaded = isinstance(model_or_config, Model)
    if loaded and layers_per_device:
        raise BadInput("layers_per_device is for a config: a loaded model is estimated as it is placed")
    W = acct.widths_of(model_or_config, None if loaded else dtype)
    if loaded:
        engine = str(model_or_config.device)
    elif device in (None, "auto"):
        engine = str(resolve_device("auto"))
    else:
        engine = str(torch.device(device))  # a device that is not here (a config estimated for a GPU box)
    if engine == "cuda":
        engine = "cuda:0"
    notes: list[str] = []
    stored = _layer_shares(model_or_config, layers_per_device, engine, W.L)  # where the layers' weights are kept
    if not loaded and engine not in stored:
        engine = next((d for d in stored if d not in ("cpu", "disk")), next(iter(stored)))
        if engine == "disk":
            raise BadInput("layers_per_device needs a device that runs layers ('cuda:N' or 'cpu'), not only 'disk'")
    shares = _running_shares(stored, engine)  # where they run
    budget = {d: _capacity(d, loaded, device_memory, notes) for d in {engine, *shares, *(set(stored) - {"disk"})}}
    card = None if torch.device(engine).type != "cuda" else budget[engine] // 4
    # the weights and what each device holding layers computes of the forward pass itself
    base: dict[str, dict[str, int]] = {d: {} for d in budget}
    if not loaded:
        layers_bytes = W.weights - W.ends
        base[engine]["weights (as stored)"] = W.ends
        for d, s in stored.items():
            if d == "disk":  # read from the offload folder one layer at a time, onto the device that runs it
                notes.append(f"{layers_bytes * s / 2**30:.1f} GiB of layer weights stay on disk")
                base[engine]["one offloaded layer's weights (while it runs)"] = int(layers_bytes / W.L)
                continue
            base[d]["weights (as stored)"] = base[d].get("weights (as stored)", 0) + int(layers_bytes * s)
    spread = len(stored) > 1 or next(iter(stored)) != engine
    if W.layer_copy or spread:
        copy = W.layer_copy or acct._copy_bytes(W.d, W.d_ff, W.H, W.Hkv, W.dh, W.gated, W.w)
        base[engine]["one layer's engine copy (V, O, FF)"] = copy
        # each call reads the layers at its own pace, so each call running at once (a server's sessions) holds its
        # own copy: counted per call here, and said so
        notes.append(
            f"each call running at once on this model holds its own copy of one layer ({copy / 2**30:.2f} GiB): "
            "sessions sharing a server add one each"
        )
    if call == "attribute_context":  # the methods' memory phases, from their records (or the call's)
        from ctxmix.methods.context.job import check_names, memory_phases

        kinds = tuple(phases or memory_phases(check_names(list(methods))))
    else:
        kinds = ()
    phases = _phases(
        W, n_tokens, call, methods, (n_response, n_ablations, batch_size, n_sources, kinds), engine, card, budget, notes
    )
    best: dict[str, dict[str, int]] = {}  # each device at its own peak phase
    live_peak = 0
    for ph in phases:
        total = {d: dict(p) for d, p in base.items()}
        for name, (where, size) in ph.items():
            if where == "spread":  # a part of every layer: each device holds its layers' share
                at = {d: size * s for d, s in shares.items()}
            else:
                at = {d: size for d in (list(shares) if where == "layers" else ["cpu" if where == "host" else engine])}
            for d, b in at.items():
                total.setdefault(d, {})[name] = total.get(d, {}).get(name, 0) + int(b)
        for d, p in total.items():
            if d not in best or sum(p.values()) > sum(best[d].values()):
                best[d] = p
            live_peak = max(live_peak, sum(v for k, v in p.items() if k != ALLOCATOR_KEPT))
    parts = {d: {k: v for k, v in p.items() if v > 0} for d, p in best.items()}
    parts = {d: p for d, p in parts.items() if p}
    for d in parts:
        if d not in budget:
            budget[d] = _capacity(d, loaded, None, notes)
    return MemoryEstimate(
        call, n_tokens, methods, engine, parts, budget, not loaded, notes, dict(ADVICE), live_peak_bytes=live_peak
    )


def _phases(W, n, call, methods, context, engine, card, budget, notes) -> list[dict]:
    """The phases of a call, each {part: ("engine" | "layers" | "spread" | "host", bytes)}: "layers" parts are on
    every device that runs layers (the forward pass's own transient), "spread" parts are split over them by their
    share of the layers (what every layer keeps), "engine" parts on the engine's device, "host"
    parts in the host's memory (the float64 maps returned)."""
    from ctxmix.engine.streaming import STREAM_SHARE

    sizing = min(budget[engine], _sizing_budget(engine))
    fwd_layer = {  # a layer's attention (the fast kernel's, a block of probability rows) with q, k, v, or its MLP
        "one layer's forward transient (attention block or MLP)": (
            "layers",
            acct.layer_activation_bytes(
                W, n, attention=acct.attention_block_bytes(W, n) + acct.eager_blocks_bytes(W, n)
            ),
        ),
    }
    if W.window and n >= W.window:
        fwd_layer["sliding-window mask (n x n, boolean)"] = ("layers", acct.window_mask_bytes(W, n))
    if call == "attribute_context":
        return _context_phases(W, n, context, sizing, card, engine)
    stored_states = acct.trace_states_bytes(W, n) - W.L * W.H * n * n * W.w
    streamed = acct.trace_states_bytes(W, n) > sizing // STREAM_SHARE
    if streamed:
        notes.append("the trace is streamed (each layer rebuilt when read): its states would not fit half the budget")
    hidden = {"hidden states": ("engine", acct.hidden_states_bytes(W, n) * (1 if W.e == W.w else 2))}
    forward = {
        **hidden,
        **fwd_layer,
        "logits": ("engine", acct.logits_bytes(W, n, upcast=False)),
    }
    if streamed:
        forward["attention inputs of every layer (streamed trace)"] = ("engine", W.L * n * W.d * W.e)
    else:
        # ctxmix's attention keeps them in the engine's dtype (float32 for a half-precision model)
        forward["attention probabilities of every layer (stored trace)"] = ("engine", W.L * W.H * n * n * W.w)
    held = {k: v for k, v in forward.items() if k not in fwd_layer}
    if not streamed:
        held["layer states (stored trace)"] = ("engine", stored_states)
    else:
        held["one layer's states (streamed trace)"] = ("engine", acct.layer_state_bytes(W, n))
    work: dict[str, tuple[str, int]] = {}
    results: dict[str, tuple[str, int]] = {}
    if call == "explain":
        from ctxmix.methods.registry import MIXING_METHODS

        mixing = [m for m in methods if m in MIXING_METHODS]
        if "alti_logit" in methods and "alti" not in mixing:
            mixing.append("alti")
        n_maps = len(mixing)
        norm_family = [m for m in mixing if m not in ("value_zeroing", "attention", "decompx", "attention_flow")]
        if norm_family:
            work["head vectors of one layer"] = ("engine", acct.head_vectors_bytes(W, n))
            work["chunk temporaries"] = ("engine", _chunk_temporaries(W, n, W.d, 6, engine, card) // 2)
        if "value_zeroing" in mixing:
            P = 2 if W.gated else 1
            work["head vectors of one layer"] = ("engine", acct.head_vectors_bytes(W, n))
            work["projected head values G (one layer)"] = ("engine", (P + 1) * n * W.H * W.d_ff * W.w)
            work["chunk temporaries"] = ("engine", _chunk_temporaries(W, n, W.d_ff, 6, engine, card))
        if any(m in methods for m in ("grad_input", "integrated_gradients", "gradient", "saliency")):
            work["backward activations"] = ("engine", 3 * acct.trace_states_bytes(W, n))
        if any(m in methods for m in ("logit", "alti_logit")):
            work["prediction readout (float64)"] = ("engine", 2 * W.L * n * W.d * 8)
    elif call == "scope_maps":
        P = 2 if W.gated else 1
        n_maps = 4
        work["head vectors of one layer"] = ("engine", acct.head_vectors_bytes(W, n))
        # G per FF projection, and one more while each is made (the product, then its (j, h)-ordered copy)
        work["projected head values G (one layer)"] = ("engine", (P + 1) * n * W.H * W.d_ff * W.w)
        ff_maps = P * W.H * W.dh * W.d_ff * W.w
        from ctxmix.engine.layer import HEAD_FF_CACHE_BYTES

        cached = ff_maps <= HEAD_FF_CACHE_BYTES
        work["head-to-FF maps" + (" (kept, every layer)" if cached else " (one layer)")] = (
            "engine",
            ff_maps * (W.L if cached else 1),
        )
        # sized for 6 copies (smaller chunks run faster on a CPU); the in-place FF path keeps about 4 alive (the
        # live-tensor count on a d 512 Llama: 3.2)
        work["chunk temporaries"] = ("engine", _chunk_temporaries(W, n, W.d_ff, 6, engine, card, alive=4))
    else:  # routes
        n_maps = 0
        from ctxmix.engine.budget import ROUTES_CHUNK_ELEMENTS as ROUTES_CHUNK

        step = max(1, (ROUTES_CHUNK if card is None else max(ROUTES_CHUNK, card // 64)) // max(1, n * W.H * W.d))
        work["head vectors of one layer"] = ("engine", acct.head_vectors_bytes(W, n))
        # a chunk of targets' pieces (c, n, H, d) and their difference from the whole: c is the frontier's part
        # in a chunk of `step`; the frontier is the few states above the threshold (ROUTES_TARGETS); at
        # Llama-3-8B's widths and 2k tokens a step is one target anyway (1 GiB a copy)
        work["chunk temporaries"] = ("engine", 2 * min(step, ROUTES_TARGETS) * n * W.H * W.d * W.w)
        work["routes' per-target importances (one layer)"] = ("engine", 2 * ROUTES_TARGETS * n * W.H * W.w)
    if n_maps:  # the maps come back as float64 numpy arrays: on the host
        on_device = ("engine", acct.maps_bytes(W, n, n_maps, 4 if W.w <= 4 else 8))
        returned = ("host", acct.maps_bytes(W, n, n_maps, 8))
        if streamed:  # filled on the host layer by layer
            work["maps (float64, returned)"] = returned
        else:
            work["maps (engine dtype, on the device)"] = on_device
            results["maps (engine dtype, on the device)"] = on_device
            results["maps (float64, returned)"] = returned
    if torch.device(engine).type == "cpu":  # glibc keeps the forward pass's freed transient (see ALLOCATOR_KEPT)
        held[ALLOCATOR_KEPT] = fwd_layer["one layer's forward transient (attention block or MLP)"]
    phases = [forward, {**held, **work}]
    if results:
        phases.append({**held, **results})
    return phases


def _sizing_budget(engine: str) -> int:
    """The engine's own sizing budget on this device (`memory_budget`), for the streaming choice."""
    from ctxmix.engine.budget import memory_budget

    dev = torch.device(engine)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return DEFAULT_CARD_BYTES
    return memory_budget(dev)


def _context_phases(W, n, context, sizing, card, engine):
    """`attribute_context`: the methods' memory phases (`CONTEXT_PHASES`, from their records): the rows trace (row
    chunks of the attention, the response rows kept), a full trace, the backward's kept activations, the ablation
    batch."""
    n_response, n_ablations, batch_size, n_sources, kinds = context
    bad = [k for k in kinds if k not in CONTEXT_PHASES]
    if bad:
        raise ValueError(f"unknown memory phase(s) {bad}; known: {CONTEXT_PHASES}")
    T = n_response or RESPONSE_TOKENS
    phases: list[dict] = []
    if "rows" in kinds:
        # the fast kernel's outputs (O(n) per head), the T rows' probabilities by blocks of rows, and a
        # soft-capped family's eager blocks
        block = acct.attention_block_bytes(W, n, rows=T) + acct.eager_blocks_bytes(W, n)
        held = {
            "hidden states": ("engine", acct.hidden_states_bytes(W, n)),
            "response rows' attention (every layer)": ("engine", W.L * W.H * T * n * W.w),
            "response logits": ("engine", acct.logits_bytes(W, T)),
        }
        forward = acct.layer_activation_bytes(W, n, attention=block)
        phases.append(
            {
                **held,
                "sliding-window mask (n x n, boolean)": ("layers", acct.window_mask_bytes(W, n)),
                "one layer's forward transient (a block of attention rows or MLP)": ("layers", forward),
            }
        )
        if torch.device(engine).type == "cpu":  # glibc keeps the forward pass's freed transient, as in `_phases`
            held = {**held, ALLOCATOR_KEPT: ("layers", forward)}
        phases.append(
            {
                **held,
                "one layer's input and values (engine dtype)": ("engine", 2 * n * W.d * W.w + n * W.H * W.dh * W.w),
                "response rows' states (every layer)": ("engine", W.L * T * (8 * W.d + 2 * W.d_ff) * W.w),
            }
        )
    if "full_trace" in kinds:  # every row's ALTI map, as explain's alti with the logit readout
        full = _phases(W, n, "explain", ("alti", "logit"), (None, 0, 0, None, ()), engine, card, {engine: sizing}, [])
        phases += full
    if "backward" in kinds:
        # the attention the gradient passes choose (`methods.context.grad.gradient_attention`): eager while its
        # kept probabilities fit half the budget, else the fused kernel's O(n)
        eager = 2 * acct.kept_attention_bytes(W, n) <= sizing // 2
        phases.append(
            {
                "activations kept for the backward (every layer)": ("spread", acct.backward_saved_bytes(W, n, eager)),
                "response logits": ("engine", acct.logits_bytes(W, T + 1)),
                "one layer's backward transient": ("layers", 2 * n * W.d_ff * W.e),
            }
        )
    if "ablations" in kinds or "ablations_whole" in kinds:
        from ctxmix.engine.budget import CPU_MAX_BATCH, CUDA_MAX_BATCH

        # ablated prompts: leave-one-out's are nearly whole; ContextCite's keep each of S sources with probability
        # 1/2, so the longest holds about 1/2 + 2 sd = 1/2 + 1/sqrt(S) of the prompt
        S = n_sources or max(1, n // TOKENS_PER_SOURCE)
        width = n if "ablations_whole" in kinds else min(n, T + int(n * (0.5 + S**-0.5)))
        per = acct.ablation_sequence_bytes(W, width, T)  # the head reads the T response rows only
        most = min(batch_size, n_ablations, CUDA_MAX_BATCH if card is not None else CPU_MAX_BATCH)
        room = sizing - acct.attention_block_bytes(W, width) * W.eager_blocks
        B = int(max(1, min(most, room // max(1, per))))  # the batch `ablation_batch_size` picks for them
        phases.append({"ablation batch": ("layers", acct.ablation_batch_bytes(W, width, T, B))})
    return phases or [{}]


def check_memory(model, n_tokens: int, **kwargs) -> MemoryEstimate:
    """`estimate_memory` for a loaded model, raising `OutOfMemoryBudget` (a BadInput) with its message (the
    estimate, its largest part and the option that shrinks it) when it does not fit what the devices can give:
    called before any forward pass."""
    est = estimate_memory(model, n_tokens, **kwargs)
    if not est.fits() and os.environ.get("CTXMIX_MEMORY_CHECK", "1") != "0":
        raise OutOfMemoryBudget(
            "this call would not fit in memory: " + est.message() + " (CTXMIX_MEMORY_CHECK=0 runs it anyway)", est
        )
    return est


class OutOfMemoryBudget(BadInput):
    """A call refused before it ran: its memory estimate (`.estimate`) exceeds what the devices can give."""

    def __init__(self, message: str, estimate: MemoryEstimate):
        super().__init__(message)
        self.estimate = estimate
