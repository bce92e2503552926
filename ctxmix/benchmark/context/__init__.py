"""The context-attribution benchmark: its examples, its metrics (LDS, top-k drop, recall), the runner
of `kind: context` configs and at2_exact's training set.
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
