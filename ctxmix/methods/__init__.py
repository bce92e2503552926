"""Decompositions -> methods: one registry (`registry`), the context-mixing maps (`mixing`), gradient
and perturbation saliency (`saliency`), ALTI+ for encoder-decoders (`alti_plus`) and the
`explain` API that runs them on one text or a batch.
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
