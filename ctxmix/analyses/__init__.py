"""Methods -> analyses of a corpus or an explanation: contextualization change, FF amplification
and outliers (`corpus`), sentence-pair mixing (`pairs`), device-side ranks (`ranks`).
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
