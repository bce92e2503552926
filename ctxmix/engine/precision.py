"""The engine's arithmetic precision: "float32" (exact, the default), "tf32" or "bf16".

Only the large products of the decompositions change (pieces x W_1, value zeroing's FF
evaluations x W_2; see `ctxmix.engine.layer.big_matmul`); norms, LayerNorm statistics, activation
shares, cosines and normalisations stay in float32 (float64 where they always were). On a CPU
"tf32" is float32 and "bf16" rounds the operands of those products to bfloat16 and accumulates
in float32. TF32 is a process-wide switch in torch, so on CUDA every engine call holds one lock
and sets the switch for its own duration: one user's tf32 never leaks into another's float32 run.
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from functools import lru_cache

import torch

from ctxmix.engine.layer import PRECISIONS
from ctxmix.errors import BadInput

_CUDA_LOCK = threading.RLock()


def check_precision(precision) -> str:
    """The precision name, or a BadInput naming the valid ones."""
    if precision not in PRECISIONS:
        raise BadInput(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def resolve_precision(model, precision: str | None) -> str:
    """A per-call precision, else the model's default (set by `load_model(..., precision=...)`)."""
    return check_precision(getattr(model, "precision", "float32") if precision is None else precision)


@contextmanager
def engine_precision(precision: str, device):
    """Run the enclosed engine work in `precision`. On CUDA: under a process-wide lock, with
    torch's TF32 matmul switch on only for "tf32" and restored afterwards. On CPU: nothing to set."""
    check_precision(precision)
    if torch.device(device).type != "cuda" and precision == "bf16":
        warn_if_bf16_is_slow()
    with tf32_switches(precision == "tf32", device):
        yield


# ---------------------------------------------------------------- TF32 under torch's two APIs
#
# torch >= 2.9 says whether float32 matmuls on CUDA may use TF32 in two ways: the legacy flags
# (`torch.backends.cuda.matmul.allow_tf32`, `torch.set_float32_matmul_precision`) and the fp32_precision
# settings, a tree whose "none" inherits from the parent: generic (`torch.backends.fp32_precision`,
# which transformers' `enable_tf32` sets) -> CUDA (`torch.backends.cudnn.fp32_precision`) -> matmul
# (and generic -> oneDNN -> matmul on CPU). The legacy setters also write the matmul leaves, so the
# CUDA matmul leaf always says what the kernels do; but once a new setting says something the legacy
# flags do not, torch refuses to read the legacy flags ("mix of the legacy and new APIs"). So the
# engine reads the leaf, sets through the API in use, and puts back on each leaf it wrote what was set
# on that leaf itself ("none" included, so a later change of a parent reaches it again). The settings
# are addressed as torch's (backend, op) pairs: `torch.backends.mkldnn.fp32_precision`'s setter writes
# the generic one (torch 2.13). cuDNN's switches are left alone: no model ctxmix traces runs a
# convolution or an RNN, and torch cannot put back cuDNN's default once a setting is written.

_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
_GENERIC, _CUDA, _CUDA_MATMUL = ("generic", "all"), ("cuda", "all"), ("cuda", "matmul")
_MKLDNN_MATMUL = ("mkldnn", "matmul")
_PARENT = {_CUDA_MATMUL: _CUDA, _CUDA: _GENERIC, _MKLDNN_MATMUL: ("mkldnn", "all"), ("mkldnn", "all"): _GENERIC}


def _get(node: tuple[str, str]) -> str:
    return torch._C._get_fp32_precision_getter(*node)


def _set(node: tuple[str, str], value: str) -> None:
    torch._C._set_fp32_precision_setter(*node, value)


def _own_setting(node: tuple[str, str]) -> str:
    """What is set on `node` itself ("none" where it inherits). torch's getter answers the inherited
    value, so the parent is set to another value for a moment to see whether `node` follows it (and
    put back to its own setting, found the same way); the generic setting has no parent."""
    parent = _PARENT.get(node)
    if parent is None:
        return _get(node)
    parent_own = _own_setting(parent)
    seen = _get(node)
    other = "ieee" if seen != "ieee" else "tf32"
    _set(parent, other)
    try:
        return "none" if _get(node) == other else seen
    finally:
        _set(parent, parent_own)


def _legacy_matmul_precision() -> str | None:
    """torch's legacy float32 matmul precision ("highest", "high", "medium") where the legacy API is
    the one in use; None where the new one is. The legacy flags are only read where no new-only
    setting (generic or CUDA-wide) is set; torch's refusal to read them means a per-backend
    fp32_precision contradicts them."""
    if _NEW_API and (_get(_GENERIC) != "none" or _get(_CUDA) != "none"):
        return None
    try:
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - read for torch's consistency check only
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def tf32_api() -> str:
    """The TF32 API in use: "new" (fp32_precision settings) or "legacy" (allow_tf32 flags)."""
    return "legacy" if _legacy_matmul_precision() is not None else "new"


def tf32_now() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 now: the fp32_precision leaf where torch has it
    (its getter never refuses), else the legacy flag."""
    if not _NEW_API:
        return torch.backends.cuda.matmul.allow_tf32
    return _get(_CUDA_MATMUL) == "tf32"


@contextmanager
def tf32_switches(tf32: bool, device):
    """Run the enclosed work with TF32 for float32 matmuls on CUDA on (`tf32`) or off, under the
    process-wide lock, set through the API in use (only where it differs) and restored afterwards (a
    streamed trace rebuilds its layers as its forward pass ran); nothing on CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    with _CUDA_LOCK:
        if tf32_now() == tf32:
            yield
            return
        legacy = _legacy_matmul_precision()
        # "medium" (TF32 on CUDA, bf16 on oneDNN) has no allow_tf32 value: torch refuses its legacy
        # reading once the CUDA flag alone is off, so it goes to "highest" and back whole, which
        # writes the oneDNN leaf too
        leaves = [_CUDA_MATMUL] + ([_MKLDNN_MATMUL] if legacy == "medium" else [])
        own = {leaf: _own_setting(leaf) for leaf in leaves} if _NEW_API else {}
        if legacy == "medium":
            torch.set_float32_matmul_precision("highest")
        elif legacy is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        else:
            _set(_CUDA_MATMUL, "tf32" if tf32 else "ieee")
        try:
            yield
        finally:
            if legacy == "medium":
                torch.set_float32_matmul_precision(legacy)
            elif legacy is not None:
                torch.backends.cuda.matmul.allow_tf32 = legacy == "high"
            # the legacy setters write the leaves too ("ieee" over an inherited "none"): each gets its
            # own setting back, which agrees with the legacy flags as it did before
            for leaf, setting in own.items():
                _set(leaf, setting)


# ---------------------------------------------------------------- is bf16 worth it on this CPU?

_WARNED = False


@lru_cache(maxsize=1)
def cpu_gemm_rates(m: int = 512, k: int = 384, n: int = 1536, seconds: float = 0.15) -> dict[str, float]:
    """GFLOP/s of one float32 and one bfloat16 CPU GEMM of the engine's shape (pieces x W_1 of a
    BERT-small layer), measured once per process (a second at most). bf16 is only faster on CPUs
    whose kernels have native bf16 dot products (Intel AMX; AVX-512 BF16 helps little in practice);
    elsewhere torch converts each operand and is slower than float32."""
    rates = {}
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    for name, (a, b) in {"float32": (a32, b32), "bf16": (a32.bfloat16(), b32.bfloat16())}.items():
        torch.matmul(a, b)  # warm-up: kernel selection, first-touch allocation
        reps, t0 = 0, time.perf_counter()
        while reps < 1 or time.perf_counter() - t0 < seconds:
            torch.matmul(a, b)
            reps += 1
        rates[name] = 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9
    return rates


def bf16_cpu_advice() -> str | None:
    """A sentence saying that bf16 is slower than float32 on this CPU (with both measured rates), or
    None where it is at least as fast."""
    r = cpu_gemm_rates()
    if r["bf16"] >= r["float32"]:
        return None
    return (
        f"precision='bf16' is slower than float32 on this CPU: a bf16 GEMM of the engine's shape runs at "
        f"{r['bf16']:.0f} GFLOP/s against {r['float32']:.0f} for float32 ({r['bf16'] / r['float32']:.2f}x), "
        "and bf16 also rounds the maps (about 2^-8 relative). It pays off on CUDA GPUs and on CPUs with AMX; "
        "here use precision='float32'."
    )


def warn_if_bf16_is_slow() -> None:
    """Once per process: a RuntimeWarning when bf16 is asked for on a CPU where it is slower."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    advice = bf16_cpu_advice()
    if advice:
        warnings.warn(advice, RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------- tolerances from the arithmetic

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
"""Round-to-nearest unit roundoff u = 2^-p of each format (p significant bits: bfloat16 8, float16 11,
float32 24, float64 53): one rounding changes a value by at most u relative."""

ROUNDINGS_PER_LAYER = 7
"""Roundings to the model's own dtype on one layer's path from its input to its output, in a half-
precision forward pass: attention probabilities, attention output (W_O), residual sum, LayerNorm, FF
output (W_2), residual sum, LayerNorm (the GEMMs accumulate in float32 on every CPU and GPU kernel
torch has, so each product is one rounding of its result, and its operands were rounded when stored)."""


def half_model_map_bound(dtype: torch.dtype, n_layers: int) -> float:
    """How far a half-precision model's maps may lie from the float32 model's, relative to the float32
    map's largest entry, to first order: every rounding on the forward path moves the activations by
    at most u relative, they add up over ROUNDINGS_PER_LAYER x n_layers, and a map entry (a norm or a
    product of attention and a norm) moves by at most the relative change of what it is built from.
    The weights' own rounding (u) is one more term. MiniLM in bfloat16: 43 u = 0.17; the largest seen
    on an AMD EPYC under ATen's default, AVX2 and native kernels: 0.035 (value zeroing)."""
    return UNIT_ROUNDOFF[dtype] * (ROUNDINGS_PER_LAYER * n_layers + 1)


def bf16_product_bound(products: int = 2) -> float:
    """The engine's precision="bf16" against float32, relative to the map's largest entry, to first
    order: each big product rounds its two operands and its result to bfloat16 (3 u, u = 2^-8) and
    accumulates in float32 (K 2^-24, negligible); a map goes through at most `products` of them in a
    row (pieces x W_1, then the activations x W_2), so 3 u x products = 0.023 for two."""
    return 3 * UNIT_ROUNDOFF[torch.bfloat16] * products


def float32_decomposition_bound(reduction: int, steps: int = 4) -> float:
    """A float32 decomposition against float64 on the same inputs and weights, relative to the map's
    largest entry: each dot product of length K is within K u (u = 2^-24) of exact (the classical
    bound gamma_K), and a map is at most `steps` such products deep within its layer (value, output,
    LayerNorm, FF); the rollout adds one product per layer, counted by the caller in `steps`."""
    return steps * reduction * UNIT_ROUNDOFF[torch.float32] / (1 - reduction * UNIT_ROUNDOFF[torch.float32])
