"""`Model.layers`: the list of a model's layers as the engine reads them, views of resident weights or one
copied layer at a time (per thread) for a model kept otherwise. Its own module because its memory rule (never
two layers' copies at once) is what the big-model paths rely on. (One layer's maths is `ctxmix.engine.layer`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ctxmix.engine.arch import LayerWeights, WeightReader, _get, layer_weights, read_layer
from ctxmix.engine.placement import weights_resident


class LayerList(Sequence):
    """`Model.layers`: layer l's `LayerWeights` on the engine's device, in the engine's dtype.

    A model whose weights all are plain tensors of the engine's dtype on its device (a float32 or float64 model
    on one device) is read once, as views: no copies, kept for the model's life, as before. Any other model
    (half precision, quantized, spread over devices, offloaded to CPU or disk) is read one layer at a time when
    a layer is asked for: its tensors loaded from the offload, dequantized, copied to the engine's device in the
    engine's dtype; only the layer read last is kept (one per thread: a model shared by the dashboard's sessions
    serves each thread its own), so a pass over the layers holds one layer's copies, never the model's (a bf16
    8B model in float32 copies would cost 25 GB more). `len` reads no weights.

    Why one copy per thread rather than one shared read-only copy: concurrent calls read different layers at
    different times (one session's layer 3 while another's is at layer 20), so a shared copy would either make
    them wait for each other or be rebuilt at every switch. N calls at once hold N layer copies (0.73 GiB each at
    Llama-3-8B's widths in float32); `estimate_memory` counts one per call and says so in its notes."""

    def __init__(self, model: Any):  # a `Model` (typed Any: `models` imports this module, not the reverse)
        import threading

        self.model = model
        self.modules = _get(model.hf.base_model, model.spec.layers)
        self.resident = weights_resident(model)
        self.reader = WeightReader() if self.resident else WeightReader(model.device, model.work_dtype)
        self._all: list[LayerWeights] | None = None
        self._local = threading.local()  # .last: the layer this thread read last
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.modules)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer {i} of {n}")
        i %= n
        if self.resident:
            with self._lock:
                if self._all is None:
                    self._all = layer_weights(self.model.hf.base_model, self.model.hf.config, self.model.spec)
            return self._all[i]
        lw = getattr(self._local, "last", None)
        if lw is None or lw.index != i:
            self.release()
            lw = read_layer(self.model.hf.base_model, self.model.hf.config, self.model.spec, i, self.reader)
            self._local.last = lw
        return lw

    def __iter__(self):
        # not Sequence's mixin: it keeps the item it yielded in a local until the next one is read, which would
        # hold two layers' copies at once
        for i in range(len(self)):
            yield self[i]

    def forget_kept_products(self) -> None:
        """Drop what the engine kept with each layer's weights (products of weights only, `LayerWeights.extra`):
        they are made again from the weights as they are now. Kept products notice in-place edits by the weights'
        version counters; edits through `.data` bypass those counters, hence this."""
        with self._lock:
            for lw in self._all or []:
                lw.extra.clear()
        last = getattr(self._local, "last", None)
        if last is not None:
            last.extra.clear()

    def release(self) -> None:
        """Free the layer this thread holds (a non-resident model's copies) before it reads another. Its
        tensors are dropped from the object itself, not only from this list: a loop's `enumerate` / `zip`
        keeps the tuple it last yielded (so the previous layer) alive while the next item is read, which would
        hold two layers' copies at once. A layer read from a non-resident model is therefore valid until the
        same thread reads another layer; using it after that fails loudly (its weights are None), never
        silently."""
        lw = getattr(self._local, "last", None)
        self._local.last = None
        if lw is not None:
            for k, v in list(vars(lw).items()):
                if isinstance(v, torch.Tensor):
                    setattr(lw, k, None)
            lw.extra.clear()
