"""The engine's shape for large devices: what is computed once per layer or per call instead of per
chunk, what stays on the device, and how large the chunks are. Each result equals the old path's."""

from types import SimpleNamespace

import numpy as np
import torch

from ctxmix.methods.explain import prediction_of


class _CountingFloat64(torch.Tensor):
    """A tensor that records the shape of every float64 tensor made from it."""

    made: list[tuple[int, ...]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            cls.made.append(tuple(out.shape))
        return out


def test_prediction_reads_the_row_before_float64():
    """A language model's prediction converts one (V,) row to float64, never the (n, V) logits
    (4 GB at 4,096 tokens with a 128k vocabulary)."""
    n, V = 16, 128_256
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0)).as_subclass(_CountingFloat64)
    tokens = lambda ids: [str(i) for i in ids]  # noqa: E731
    model = SimpleNamespace(kind="causal_lm", spec=SimpleNamespace(causal=True), tokens=tokens)
    _CountingFloat64.made = []
    pred = prediction_of(model, SimpleNamespace(logits=logits), position=5)
    assert _CountingFloat64.made and all(np.prod(s) <= V for s in _CountingFloat64.made)
    p = torch.softmax(logits.as_subclass(torch.Tensor)[5].double(), -1)
    assert pred["index"] == int(p.argmax())
    assert abs(sum(pred["probabilities"].values()) - float(p.topk(5).values.sum())) < 1e-12
