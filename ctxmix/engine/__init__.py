"""Model -> trace -> exact decompositions: one declarative map of module names per family
(`arch`), the layers recomputed from the weights (`layer`), one traced forward pass (`trace`),
model loading (`models`; where a model lives: `placement`; the embedded models' builds: `embedded`;
weight fingerprints: `fingerprint`; the layer list: `layers`; `sentiment`), inputs as token ids (`encoding`,
`tokens`), encoder-decoders' decoders (`seq2seq`), precision and memory budgets.
"""

import logging

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use

# transformers' modeling code imports every quantization backend it finds installed (torchao among them), and
# torchao's import logs its optional kernels that do not load on this machine, and torch's pytree its deprecations:
# not ctxmix's words, on every command and page. They are imported here, once, with those two loggers at ERROR for
# the length of the import (their levels put back after it); a quantized load still imports its backend as before.
_QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")


def _import_transformers_quietly() -> None:
    loggers = [logging.getLogger(name) for name in _QUIET_AT_IMPORT]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:  # pragma: no cover - transformers is a requirement; its absence says so where it is used
        pass
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_import_transformers_quietly()
