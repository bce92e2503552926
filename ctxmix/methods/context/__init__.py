"""Context attribution: which sources of a context a model's response rests on (ContextCite, AT2
and the one-pass methods), from the prompt the model sees to the scores and their check by ablation.
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
