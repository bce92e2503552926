"""Where a model lives and in what: the device the engine computes on, the dtype, accelerate's device map
(module -> device), `max_memory`, the offload folder and the quantization scheme, checked before anything
is loaded (`load_placement`), and afterwards what the loaded model says of itself (`engine_device`,
`model_dtype`, `weights_resident`). Its own module so that the loader, the command line and the engine
share one definition of each placement word.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ctxmix.errors import BadInput

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype a model is held in, from its name ("float32", "float64", "float16", "bfloat16") or as given."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise BadInput(f"dtype must be one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise BadInput(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise BadInput(f"device must be 'auto', 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInput("device 'cuda' was asked for but no CUDA device is available")
    return dev


def same_device(a, b) -> bool:
    """Whether two devices are the same place: "cuda" and "cuda:0" are when 0 is the current device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True  # one CPU (and one meta)
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def engine_device(hf: Any) -> torch.device:
    """Where ctxmix computes for this model: where its inputs go. A model dispatched by accelerate
    (`device_map`) has a main device on its top hook (its first layers' device, or the GPU that runs the
    offloaded ones); otherwise the device of its first parameter that is not on `meta`."""
    hook = getattr(hf, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in hf.parameters():
        if p.device.type != "meta":
            return p.device
    raise BadInput("every weight of this model is on the 'meta' device: load it (or dispatch it) first")


def model_dtype(hf: Any) -> torch.dtype:
    """The dtype the model computes in: its config's (a quantized model's compute dtype), else its first
    floating-point parameter's."""
    for p in hf.parameters():
        if p.is_floating_point() and type(p) in (torch.Tensor, torch.nn.Parameter):
            return p.dtype
    dt = getattr(hf.config, "dtype", None) or getattr(hf.config, "torch_dtype", None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def weights_resident(model: Any) -> bool:  # a `Model` (`models` imports this module, not the reverse)
    """Whether every parameter of the model's layers is a plain tensor of the engine's dtype on the engine's
    device, not offloaded: then the engine reads them as views and keeps nothing of its own."""
    from ctxmix.engine.weights import is_quantized_tensor, offloaded

    for mod in model.hf.modules():
        if offloaded(mod):
            return False
        for p in mod.parameters(recurse=False):
            if not same_device(p.device, model.device) or is_quantized_tensor(p):
                return False
            if p.is_floating_point() and p.dtype != model.work_dtype:
                return False
    return True


DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def load_placement(device_map, max_memory, offload_folder, quantization, dtype, device: str = "auto") -> dict:
    """The `from_pretrained` keywords for where a model lives, checked before anything is loaded."""
    out: dict[str, Any] = {}
    if device_map is not None:
        if isinstance(device_map, str) and device_map not in DEVICE_MAP_NAMES:
            try:
                torch.device(device_map)
            except (RuntimeError, ValueError):
                device_map = None
        if not isinstance(device_map, (str, dict)):
            raise BadInput(
                f"device_map must be one of {', '.join(DEVICE_MAP_NAMES)}, a device or a dict of module name -> "
                f"device, got {device_map!r}"
            )
        out["device_map"] = device_map
    if max_memory is not None:
        if not isinstance(max_memory, dict):
            raise BadInput("max_memory must be a dict of device -> size, e.g. {0: '20GiB', 'cpu': '60GiB'}")
        out["max_memory"] = max_memory
        out.setdefault("device_map", "auto")
    if offload_folder is not None:
        out["offload_folder"] = str(offload_folder)
    if quantization is not None:
        dt = _DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else dtype
        out["quantization_config"] = quantization_config(quantization, dt)
        # quantized layers are placed when loaded: on the device asked for, else accelerate's choice
        if device == "auto":
            out.setdefault("device_map", "auto" if torch.cuda.is_available() else "cpu")
        else:
            out.setdefault("device_map", str(resolve_device(device)))
    if "offload_folder" in out and "device_map" not in out:
        raise BadInput("offload_folder needs a device_map that puts some layers on 'disk' (or device_map='auto')")
    return out


def loading_options(args) -> dict:
    """`load_model`'s placement keywords from the command line's flags (`--device-map`, `--offload-folder`,
    `--load-in-4bit` / `--load-in-8bit` / `--load-in-int8`); absent flags give nothing."""
    out: dict[str, Any] = {}
    dm = getattr(args, "device_map", None)
    if dm:
        if dm.strip().startswith("{"):
            try:
                dm = json.loads(dm)
            except json.JSONDecodeError as e:
                raise BadInput(f"--device-map is not valid JSON: {e}") from None
        out["device_map"] = dm
    if getattr(args, "offload_folder", None):
        out["offload_folder"] = args.offload_folder
    for flag, scheme in (("load_in_4bit", "4bit"), ("load_in_8bit", "8bit"), ("load_in_int8", "int8")):
        if getattr(args, flag, False):
            out["quantization"] = scheme
    return out


QUANTIZATION_NAMES = {
    "4bit": "bitsandbytes nf4 weights (4-bit NormalFloat, double quantization off), computed in the model's dtype",
    "8bit": "bitsandbytes LLM.int8 (8-bit weights; inputs quantized too, outliers kept in 16 bits)",
    "int8": "torchao int8 weight-only (per-row scales; activations untouched)",
}


def quantization_config(quantization: Any, dtype: torch.dtype):
    """A transformers quantization config from a short name (QUANTIZATION_NAMES) or passed through as given
    (`BitsAndBytesConfig`, `TorchAoConfig`, ...). None stays None."""
    if quantization is None or not isinstance(quantization, str):
        return quantization
    import transformers as T

    if quantization == "4bit":
        return T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if quantization == "8bit":
        return T.BitsAndBytesConfig(load_in_8bit=True)
    if quantization == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return T.TorchAoConfig(Int8WeightOnlyConfig())
    raise BadInput(
        f"quantization must be one of {', '.join(QUANTIZATION_NAMES)} or a transformers config, got {quantization!r}"
    )


def quantization_identity(quantization: Any):
    """What a model's quantization is, whole: a short name as given, or a transformers config's class and every
    field (`to_dict`): two configs of one class (int8 per channel, int8 per group of 8) are two models, and the
    results cache keys them apart (`ctxmix.service.cache.model_fingerprint` reads `Model.info`)."""
    if isinstance(quantization, str):
        return quantization
    fields = quantization.to_dict() if hasattr(quantization, "to_dict") else repr(quantization)
    return {"class": type(quantization).__name__, "config": json.loads(json.dumps(fields, default=str))}
