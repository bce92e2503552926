"""The engine's arithmetic precision: "float32" (exact, the default), "tf32" or "bf16", chosen per call.

Only the large products of the decompositions change (pieces x W_1, value zeroing's FF evaluations x W_2; see
`ctxmix.engine.layer.big_matmul`); norms, LayerNorm statistics, activation shares, cosines and normalisations stay
in float32 (float64 where they always were). On a CPU "tf32" is float32 and "bf16" rounds the operands of those
products to bfloat16 and accumulates in float32. On CUDA "tf32" runs each product as three bfloat16 products of
the operands' split parts on the tensor cores (finer than TF32), so nothing process-wide is switched: torch's TF32
setting is the user's, one session's precision never reaches another's call, and no lock serialises them. Where
the user has TF32 on process-wide, a float32 call's own products follow it; the engine says so once
(`warn_if_tf32_is_on`) and the reconstruction error shows it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

from ctxmix.engine.layer import PRECISIONS
from ctxmix.errors import BadInput


def check_precision(precision) -> str:
    """The precision name, or a BadInput naming the valid ones."""
    if precision not in PRECISIONS:
        raise BadInput(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def resolve_precision(model, precision: str | None) -> str:
    """A per-call precision, else the model's default (set by `load_model(..., precision=...)`)."""
    return check_precision(getattr(model, "precision", "float32") if precision is None else precision)


@contextmanager
def engine_precision(precision: str, device) -> Iterator[None]:
    """The enclosed engine work runs in `precision` (carried by the calls themselves to `big_matmul`): nothing is
    switched. Warns once where bf16 is slower than float32 on this CPU, and once where a float32 call on CUDA runs
    under the user's process-wide TF32."""
    check_precision(precision)
    dev = torch.device(device)
    if dev.type != "cuda" and precision == "bf16":
        warn_if_bf16_is_slow()
    if dev.type == "cuda" and precision == "float32":
        warn_if_tf32_is_on()
    yield


# ---------------------------------------------------------------- reading torch's TF32 setting (never writing it)
#
# torch >= 2.9 says whether float32 matmuls on CUDA may use TF32 in two ways: the legacy flags
# (`torch.backends.cuda.matmul.allow_tf32`, `torch.set_float32_matmul_precision`) and the fp32_precision
# settings, a tree whose "none" inherits from the parent (generic -> CUDA -> matmul). The CUDA matmul leaf always
# says what the kernels do, and torch's getter for it never refuses (the legacy reading does once the two APIs
# disagree), so that leaf is what ctxmix reads.

_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")


def tf32_now() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 now (the user's process-wide setting)."""
    if not _NEW_API:
        return torch.backends.cuda.matmul.allow_tf32
    return torch._C._get_fp32_precision_getter("cuda", "matmul") == "tf32"


_TF32_WARNED = False


def warn_if_tf32_is_on() -> None:
    """Once per process: a RuntimeWarning that the user's TF32 setting makes a float32 call's products TF32."""
    global _TF32_WARNED
    if _TF32_WARNED or not tf32_now():
        return
    _TF32_WARNED = True
    warnings.warn(
        "TF32 is on for float32 matmuls in this process (a torch setting, e.g. transformers' enable_tf32): "
        "ctxmix never switches it, so a precision='float32' call's products run in TF32 (about 2^-11 relative; the "
        "reconstruction error shows it). Set torch.backends.cuda.matmul.fp32_precision = 'ieee' for exact maps, "
        "or use precision='tf32', whose products are finer than TF32's.",
        RuntimeWarning,
        stacklevel=4,
    )


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


def split_product_bound(reduction: int) -> float:
    """precision="tf32" on CUDA (`ctxmix.engine.layer.split_bf16_matmul`) against float32, relative to the sum of
    |a_i W_ij| of a product of length K = `reduction`: each operand's split leaves 2^-16 of it, the dropped
    a_l W_l term is 2^-16 more, and the float32 accumulation of three products K 2^-24."""
    return 3 * 2.0**-16 + 3 * reduction * UNIT_ROUNDOFF[torch.float32]


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
