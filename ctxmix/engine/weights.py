"""Where a model's weights really are, and what matrix its kernels really multiply by.

A model may be spread over devices by accelerate's `device_map` (offloaded weights sit on `meta` until
their hook loads them), stored in half precision, or quantized (bitsandbytes' packed 4-bit and 8-bit
tensors with their scales, torchao's tensor subclasses). The engine never reads a raw `.weight`: it reads
a module's tensors through `materialized` (the offload hook loads them for as long as they are read) and a
linear layer's matrix through `linear_matrix` (dequantized by the scheme's own function). Every copy this
makes is one layer's, made when that layer is decomposed and dropped after it (`ctxmix.engine.layers.LayerList`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ctxmix.errors import UnsupportedArchitecture


def _offload_hook(module: nn.Module):
    """The accelerate hook that keeps this module's own parameters off the device between calls: its
    `AlignDevicesHook` with offload on, alone or inside a `SequentialHook` (another library's hook added after
    accelerate's), else None."""
    hook = getattr(module, "_hf_hook", None)
    chain = getattr(hook, "hooks", None)
    for h in [hook] if chain is None else list(chain):
        if h is not None and bool(getattr(h, "offload", False)) and hasattr(h, "pre_forward"):
            return h
    return None


def offloaded(module: nn.Module) -> bool:
    """Whether accelerate keeps this module's own parameters off the device (on `meta`) between calls."""
    return _offload_hook(module) is not None


@contextlib.contextmanager
def materialized(module: nn.Module) -> Iterator[nn.Module]:
    """The module with its own parameters loaded where its hook executes, for the duration of the block (what
    accelerate's `align_module_device` does, for an offload hook inside a `SequentialHook` too); unchanged when
    nothing of it is offloaded. Tensors read inside must be copied to outlive the block: the hook sends the
    weights back to `meta` on exit."""
    hook = _offload_hook(module)
    if hook is None:
        yield module
        return
    hook.pre_forward(module)
    try:
        yield module
    finally:
        hook.post_forward(module, None)


def _self_dequantizing(t: Any) -> bool:
    """A tensor subclass that dequantizes itself: torchao's AffineQuantizedTensor / Int8Tensor / Int4Tensor ..."""
    return (
        isinstance(t, torch.Tensor)
        and type(t) not in (torch.Tensor, nn.Parameter)
        and hasattr(t, "dequantize")
        and not _bnb_kind(t)
    )


def is_quantized_tensor(t: Any) -> bool:
    """A weight that is not the plain float matrix: packed integers (bitsandbytes), or a tensor subclass that
    dequantizes itself (torchao)."""
    if not isinstance(t, torch.Tensor):
        return True
    return _self_dequantizing(t) or not t.is_floating_point() or _bnb_kind(t) is not None


def _bnb_kind(t: Any) -> str | None:
    name = type(t).__name__
    if name == "Params4bit":
        return "bnb-4bit"
    if name == "Int8Params":
        return "bnb-8bit"
    return None


def quantization_scheme(module: nn.Module) -> str | None:
    """None for a plain float linear layer; else the scheme's name ("bnb-4bit", "bnb-8bit", "torchao:<class>",
    "<class>.dequantize"). Raises UnsupportedArchitecture, naming the class, for a quantized layer ctxmix
    cannot dequantize (never a silently wrong map)."""
    w = getattr(module, "weight", None)
    kind = _bnb_kind(w)
    if kind:
        return kind
    if _self_dequantizing(w):
        return f"torchao:{type(w).__name__}"
    if isinstance(w, torch.Tensor) and type(w) in (torch.Tensor, nn.Parameter) and w.is_floating_point():
        return None  # a plain float weight is what the layer multiplies by
    if callable(getattr(module, "dequantize_weight", None)) or callable(getattr(module, "dequantize", None)):
        return f"{type(module).__name__}.dequantize"  # GPTQ / AWQ layers that expose their dequantization
    raise UnsupportedArchitecture(
        f"ctxmix cannot read the weights of a {type(module).__name__} layer "
        f"(weight: {type(w).__name__}{'' if not isinstance(w, torch.Tensor) else ' ' + str(w.dtype)}): "
        "it knows plain float linears, bitsandbytes 4-bit and 8-bit, torchao tensor subclasses and layers "
        "with a dequantize method. Load the model unquantized, or in one of those schemes."
    )


# Schemes whose forward also rounds the activations (LLM.int8 quantizes the input's non-outlier columns to
# int8): the decomposition with the dequantized weights is then exact only up to that rounding, which the
# trace's reconstruction error measures and the explanation reports.
ACTIVATION_QUANTIZING = {"bnb-8bit": "bitsandbytes 8-bit (LLM.int8: the inputs are quantized to int8 too)"}


def linear_matrix(module: nn.Module) -> torch.Tensor:
    """The matrix the layer's kernel multiplies by, in its stored orientation ((out, in) for nn.Linear, (in,
    out) for Conv1D), dequantized where the layer is quantized: bitsandbytes nf4/fp4 with its quant state,
    bitsandbytes 8-bit with its row scales (CB * SCB / 127), torchao's `dequantize()`, a layer's own
    `dequantize_weight()`/`dequantize()`. A plain float weight comes back as it is (no copy). Call inside
    `materialized(module)` for an offloaded layer."""
    scheme = quantization_scheme(module)
    w: Any = module.weight
    if scheme is None:
        return w.detach()
    if scheme == "bnb-4bit":
        return _bnb_4bit_matrix(w)
    if scheme == "bnb-8bit":
        scb = getattr(w, "SCB", None)
        state = getattr(module, "state", None)
        if scb is None and state is not None:
            scb = getattr(state, "SCB", None)
        cb = w.data if getattr(state, "CB", None) is None else state.CB
        if scb is None:
            raise UnsupportedArchitecture(
                f"a bitsandbytes 8-bit layer ({type(module).__name__}) without its row scales (SCB): "
                "it was not quantized yet (move it to its device first)"
            )
        return (cb.to(torch.float32) * (scb.to(torch.float32)[:, None] / 127.0)).detach()
    if scheme.startswith("torchao:"):
        return w.dequantize().detach()
    deq: Any = getattr(module, "dequantize_weight", None) or getattr(module, "dequantize")  # noqa: B009
    out = deq()
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise UnsupportedArchitecture(f"{type(module).__name__}'s dequantize did not return a float matrix")
    return out.detach()


def tensor_for_hash(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor whose sums fingerprint `t`: torchao's subclasses dequantized (their raw parts are not
    reachable through the tensor API), everything else as it is."""
    if _self_dequantizing(t):
        return t.dequantize()
    return t


def module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer of `module` and its children, each leaf module loaded
    from the offload only while its own tensors are read (so no more than one leaf's weights at once)."""
    for prefix, mod in module.named_modules():
        own = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        if not own:
            continue
        with materialized(mod):
            for name, _ in own:
                t = getattr(mod, name)
                yield (f"{prefix}.{name}" if prefix else name), t.detach() if isinstance(t, torch.Tensor) else t


def _bnb_4bit_matrix(w) -> torch.Tensor:
    """The (out, in) matrix a bitsandbytes 4-bit weight's kernel multiplies by. On CPUs with AVX-512 BF16 the
    first forward repacks the weight in place for its CPU kernel (`packing_format_for_cpu`: nibbles regrouped in
    blocks of 32 rows, absmax transposed and rounded to bfloat16), after which `dequantize_4bit` on the packed data
    reads garbage: the nibbles are put back in order and the kernel's own bf16 absmax used, on a copy of the quant
    state (the model's is left as the kernel needs it)."""
    import copy

    import bitsandbytes.functional as bf

    qs = w.quant_state
    if not getattr(qs, "packing_format_for_cpu", False):
        return bf.dequantize_4bit(w.data, qs).detach()
    st = copy.copy(qs)  # the inverse reassigns the state's fields: on this copy only
    st.original_nested = False  # keep the kernel's absmax instead of quantizing it again
    data, st = bf._convert_weight_packed_for_cpu_inverse(w.data, st)
    st.absmax = qs.absmax.T.reshape(-1).float()  # (in / blocksize, out) -> the unpacked (out, in / blocksize) order
    st.dtype = torch.float32
    return bf.dequantize_4bit(data, st).detach()
