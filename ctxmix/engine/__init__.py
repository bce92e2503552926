"""Model -> trace -> exact decompositions: one declarative map of module names per family
(`arch`), the layers recomputed from the weights (`layer`), one traced forward pass (`trace`),
model loading (`models`, `sentiment`), encoder-decoders' decoders (`seq2seq`), precision and
memory budgets.
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
