"""Temporaries reused across the chunks of one call, and activations applied in place.

Why: on a CPU the allocator hands large freed blocks back to the system, so every chunk's fresh
(c, m, d') temporaries were page-faulted in again. Value zeroing on the BERT-base of `bench/perf.py`
(n = 128) took 1.37 million minor faults (5.4 GB of fresh pages) and 3 s of system time in an 8.2 s
call (bench/profile_passes.py, 2026-11-28). A `Workspace` belongs to one call (never to the model,
which every session shares), so two calls never write each other's buffers. On CUDA the caching
allocator already reuses blocks; the workspace changes nothing there but the bookkeeping.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _mkl_packing() -> bool:
    """Whether this torch has MKL's packed float32 GEMM (x86 CPU builds; not ARM)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def _onednn_packing() -> bool:
    """Whether this torch has oneDNN's linear on a weight reordered once (the kernels inductor's CPU backend
    calls; x86 CPU builds)."""
    try:
        ops = torch.ops.mkldnn
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def _cpuinfo(key: str) -> str | None:
    """The value of `key` on the first line of Linux's /proc/cpuinfo that starts with it (None where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD"; "" where unknown): /proc/cpuinfo, else the
    platform's processor string."""
    vendor = _cpuinfo("vendor_id")
    if vendor is not None:
        return vendor
    proc = platform.processor()
    return next((v for v in ("GenuineIntel", "AuthenticAMD") if v in proc), "")


MKL_PACKING = _mkl_packing()
ONEDNN_PACKING = _onednn_packing()


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where unknown)."""
    return set((_cpuinfo("flags") or "").split())


def _packer(vendor: str, flags: set[str] | None = None) -> str | None:
    """Which packed float32 product `Workspace.product` runs on a CPU of this vendor, where it was measured to pay:
    - "mkl" on Intel CPUs: MKL's packed product ran 5-6 % faster than mm on value zeroing's W_2 product (Xeon,
      AVX-512 and AMX);
    - "onednn" on AMD CPUs with AVX-512: there MKL's packed product ran no faster than mm, but oneDNN's linear on a
      reordered weight ran at 217-227 against mm's 154-200 GFLOP/s at 64 to 1,408 rows (EPYC, Zen 4, 2026-11-29,
      bench/gemm_backends.py); its reorder takes 1.4-1.9 ms for BERT-base's W_2;
    - None elsewhere (ARM; AMD CPUs without AVX-512 and others where neither was measured): plain mm."""
    if vendor == "GenuineIntel" and MKL_PACKING:
        return "mkl"
    if vendor == "AuthenticAMD" and ONEDNN_PACKING and "avx512f" in (_cpu_flags() if flags is None else flags):
        return "onednn"
    return None


PACKER = _packer(_cpu_vendor())
# oneDNN's reorder pays within one product of this many rows (at BERT-base's W_2: 7 % of a 1,024-row product is
# about the 1.4 ms reorder), so such a product packs on the weight's first use
ONEDNN_PACK_FIRST_ROWS = 1024
# MKL's packed copy of a (K, N) weight took 2.2 times the weight's bytes (BERT-base's W_2 at M = 1,664 rows): packed
# only up to this size, so a call holds at most ~70 MB more than the memory estimate counts, plus the last packed
# weight itself until the next layer's (for a model read one layer at a time). Llama-3-8B's W_2 (235 MB in float32)
# runs unpacked.
PACK_MAX_BYTES = 32 * 2**20


def _full_float32() -> bool:
    """Whether float32 products run in full float32 on a CPU (torch's default): a process-wide "medium" or "high"
    matmul precision, or oneDNN's fp32_precision set to "bf16" or "tf32", sends torch.mm through oneDNN in bf16,
    which the packed products would not follow, so one layer's chunks would mix two precisions. torch >= 2.9 reads
    oneDNN's matmul leaf of its fp32_precision tree (legacy settings and inheritance resolved; the legacy getter
    raises once the two APIs disagree, e.g. after `torch.backends.cuda.matmul.fp32_precision = "tf32"`)."""
    try:
        if hasattr(torch._C, "_get_fp32_precision_getter"):
            return torch._C._get_fp32_precision_getter("mkldnn", "matmul") in ("none", "ieee")
        return torch.get_float32_matmul_precision() == "highest"
    except (RuntimeError, AttributeError):  # a setting this torch cannot read: not known to be full float32
        return False


class Workspace:
    """Named flat buffers, grown to the largest request and viewed to the shape asked for. A buffer
    handed out stays valid until the same name is taken again: callers take a name once per chunk."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._packed: dict[str, tuple[torch.Tensor, int, int, int, torch.Tensor | None]] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape` (contiguous), from the buffer `name`."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self._buffers[name] = torch.empty(0, dtype=dtype, device=device)  # the old one freed first
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def like(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped and laid out as `t` (a permutation of a dense tensor, as the pieces'
        (j, i)-ordered products viewed in (i, j) order): elementwise passes then read and write in one order."""
        strides = t.stride()
        order = sorted(range(t.dim()), key=lambda k: -strides[k])  # dimensions from outermost in memory
        buf = self.take(name, tuple(t.shape[k] for k in order), t.dtype, t.device)
        return buf.permute(*[order.index(k) for k in range(t.dim())])

    def product(self, name: str, a: torch.Tensor, W: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """a (M, K) @ W (K, N), plus `into` (M, N) when given: torch.mm, or addmm_ into `into`'s memory. On a CPU
        with a packed product that pays there (`PACKER`), in float32, once the same W comes a second time (the
        chunks of one layer), W is packed once and kept under `name` until another W comes:
        - "mkl" (Intel): `_mkl_reorder_linear_weight`, for one M (another M packs again); MKL then skips re-packing
          W inside every product, measured 5-6 % faster on the (c n, d') x (d', d) products of value zeroing and
          the scope maps (bench/profile_passes.py). Its packed kernel gave the same bits as mm at those sizes
          (M >= 500) but rounds differently at small M;
        - "onednn" (AMD): `mkldnn._reorder_linear_weight`, for every M; the product adds `into` in its epilogue
          and returns a fresh tensor (`into` is then left as it was).
        Either rounds within float32 rounding of K terms (the bound tests/test_workspace.py checks). The packed
        copy is this call's: the model's weights are never touched. W is held, so its identity, storage and
        version counter tell a changed weight. Weights over PACK_MAX_BYTES, and a process whose float32 products
        are set to run in bf16 or tf32, run unpacked."""
        M = a.shape[0]
        packer = PACKER if a.device.type == W.device.type == "cpu" else None
        packable = packer is not None and a.dtype == W.dtype == torch.float32
        packable = packable and W.numel() * W.element_size() <= PACK_MAX_BYTES and _full_float32()
        packable = packable and not W.is_inference()  # an inference tensor has no version counter to key on
        if not packable:
            return torch.mm(a, W) if into is None else into.addmm_(a, W)
        slot = self._packed.get(name)
        key = (W._version, W.data_ptr(), M if packer == "mkl" else -1)
        same = slot is not None and slot[0] is W and slot[1:4] == key
        if not same and not (packer == "onednn" and M >= ONEDNN_PACK_FIRST_ROWS):
            # the first use of this W (and M): a plain product, remembered (one small chunk alone never pays)
            self._packed[name] = (W, *key, None)
            return torch.mm(a, W) if into is None else into.addmm_(a, W)
        packed = slot[4] if same else None
        if packed is None:  # the second use: pack once for the rest
            packed = _PACK[packer](W, M)
            self._packed[name] = (W, *key, packed)
        if packer == "mkl":
            out = torch.ops.mkl._mkl_linear(a.contiguous(), packed, W.t(), None, M)
            return out if into is None else into.add_(out)
        if into is None:
            return torch.ops.mkldnn._linear_pointwise(a.contiguous(), packed, None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(a.contiguous(), into, packed, None, "add")

    def nbytes(self) -> int:
        packed = sum(p[4].numel() * p[4].element_size() for p in self._packed.values() if p[4] is not None)
        return packed + sum(b.numel() * b.element_size() for b in self._buffers.values())


def linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W (K, N) [+ b (N,)], the engine's plain products (the rebuilt layer's projections). Where
    `PACKER` is "onednn" (AMD CPUs), in float32 with no gradient, through oneDNN's linear on the weight as the model
    holds it (nn.Linear's (N, K) storage: no copy, no reorder), bias in its epilogue: 192 against mm's 154-158
    GFLOP/s at 64 rows, 214-218 against 190-200 at 512-1,408 rows (BERT-base's widths, EPYC Zen 4, 2026-11-29,
    bench/gemm_backends.py); within float32 rounding of K terms of mm's result. Elsewhere torch's matmul."""
    if not _onednn_linear_takes(x, W, b):
        out = torch.matmul(x, W)
        if b is None:
            return out
        return out + b if torch.is_grad_enabled() else out.add_(b)  # in place only where autograd keeps no graph
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), W.t(), b, "none", [], "")
    return out.view(*x.shape[:-1], W.shape[-1])


def _onednn_linear_takes(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether `linear` may call oneDNN's linear: a plain float32 CPU product that no autograd (backward, forward
    mode or torch.func) follows, with oneDNN enabled and in full float32, W in nn.Linear's storage and a plain (N,)
    bias. Anything else (a broadcast or strided bias, a bias with a gradient, a dual tensor) goes to torch."""
    if PACKER != "onednn" or x.device.type != "cpu" or not (x.dtype == W.dtype == torch.float32) or W.dim() != 2:
        return False
    if x.numel() == 0 or not W.t().is_contiguous() or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled:  # the user's `torch.backends.mkldnn.flags(enabled=False)`
        return False
    if b is not None and not (
        b.dtype == torch.float32 and b.dim() == 1 and b.shape[0] == W.shape[1] and b.is_contiguous()
    ):
        return False
    grads = (x.requires_grad or W.requires_grad or (b is not None and b.requires_grad)) and torch.is_grad_enabled()
    if grads or _forward_ad_active() or any(_functorch_wrapped(t) for t in (x, W, b) if t is not None):
        return False
    return _full_float32()


def _forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (`torch.autograd.forward_ad.dual_level`)."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether t is one of torch.func's wrapped tensors (jvp, vmap, grad)."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


_PACK: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "mkl": lambda W, M: torch.ops.mkl._mkl_reorder_linear_weight(W.t().contiguous(), M),
    "onednn": lambda W, M: torch.ops.mkldnn._reorder_linear_weight(W.t().contiguous(), M),
}


def in_place_act(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-place form of a model's activation module (x -> act(x), written into x), when its forward is
    one torch kernel that has one: GELU (exact or tanh), SiLU, ReLU; recognised by class and by the function
    it holds, so the in-place kernel is the one its forward calls (tests compare the bits on every family).
    None otherwise (the caller then calls `act`, which allocates)."""
    name, inner = type(act).__name__, getattr(act, "act", None)
    if name == "GELUActivation" and inner is F.gelu:
        return lambda x: torch.ops.aten.gelu_(x)
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(inner, "func", None) is F.gelu:
        approximate = getattr(inner, "keywords", {}).get("approximate", "none")
        return lambda x: torch.ops.aten.gelu_(x, approximate=approximate)
    if isinstance(act, torch.nn.GELU):
        return lambda x: torch.ops.aten.gelu_(x, approximate=act.approximate)
    if name == "SiLUActivation" or isinstance(act, torch.nn.SiLU):
        return lambda x: F.silu(x, inplace=True)
    if isinstance(act, torch.nn.ReLU):
        return lambda x: x.relu_()
    return None


def act_into(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """act(x), written into x where the activation has an in-place kernel (see `in_place_act`)."""
    fn = in_place_act(act)
    return act(x) if fn is None else fn(x)
