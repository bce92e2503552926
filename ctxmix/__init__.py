"""ctxmix: context mixing in Transformers, layer by layer and component by component.

    import ctxmix
    m = ctxmix.load_model("minilm")
    ex = ctxmix.explain(m, "The keys to the cabinet are on the table .", ["globenc", "alti"])
"""

from .errors import BadInput, CtxmixError, ModelLoadError, UnsupportedArchitecture
from .models import EMBEDDED, Model, load_model, model_from_hf
from .trace import Trace, trace
from .methods import MIXING_METHODS, rollout
from .saliency import SALIENCY_METHODS
from .explain import Explanation, explain, explain_batch, scope_maps
from .saved import load_explanation
from .pairs import cross_segment_mixing
from .seq2seq import source_contribution
from .analysis import (contextualization_change, corpus_report, ff_amp, ff_outlier_correlations, ff_outliers,
                       ff_report, ff_residual_norms)
from . import analysis  # noqa: F401 - ctxmix.analysis.* reachable after `import ctxmix`

__version__ = "0.1.0"

METHODS = {**MIXING_METHODS, **SALIENCY_METHODS}

__all__ = [
    "BadInput", "CtxmixError", "ModelLoadError", "UnsupportedArchitecture", "EMBEDDED", "Model",
    "load_model", "model_from_hf", "Trace", "trace", "MIXING_METHODS", "SALIENCY_METHODS", "METHODS",
    "rollout", "Explanation", "explain", "explain_batch", "scope_maps", "load_explanation", "cross_segment_mixing", "source_contribution", "contextualization_change", "ff_amp",
    "ff_outliers", "ff_outlier_correlations", "ff_residual_norms", "corpus_report", "ff_report", "__version__",
]
