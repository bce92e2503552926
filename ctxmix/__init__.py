"""ctxmix: context mixing in Transformers, layer by layer and component by component.

    import ctxmix
    m = ctxmix.load_model("minilm")
    ex = ctxmix.explain(m, "The keys to the cabinet are on the table .", ["globenc", "alti"])

The package reads as the pipeline, one subpackage per stage:

    engine/     model -> trace -> exact decompositions (arch, layer, trace, models, seq2seq)
    methods/    decompositions -> methods (registry, mixing, saliency, alti_plus, explain)
    analyses/   methods -> corpus analyses (corpus, pairs, ranks)
    benchmark/  methods x datasets x metrics (config, datasets, compute, store, executors, tables)
    export/     figures, LaTeX, saved explanations
    service/    what the dashboard and a hosted copy need (cache, limits, serve), without Streamlit

Everything here is imported lazily (PEP 562): `import ctxmix` loads no model code, and neither
plotly nor streamlit, until a name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxmix.lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "BadInput": "errors",
    "CtxmixError": "errors",
    "ModelLoadError": "errors",
    "UnsupportedArchitecture": "errors",
    "EMBEDDED": "engine.embedded",
    "Model": "engine.models",
    "load_model": "engine.models",
    "model_from_hf": "engine.models",
    "Trace": "engine.trace",
    "generate": "engine.generate",
    "Generation": "engine.generate",
    "trace": "engine.trace",
    "MIXING_METHODS": "methods.registry",
    "SALIENCY_METHODS": "methods.registry",
    "PREDICTION_METHODS": "methods.registry",
    "METHODS": "methods.registry",
    "CONTEXT_METHODS": "methods.registry",
    "attribute_context": "methods.context.attribution",
    "ContextAttribution": "methods.context.attribution",
    "PromptForm": "methods.context.options",
    "Ablations": "methods.context.options",
    "AT2": "methods.context.options",
    "attribute_contexts": "benchmark.context.many",
    "load_context_attribution": "export.context.load",
    "rollout": "methods.mixing",
    "Explanation": "methods.explanation",
    "explain": "methods.explain",
    "explain_batch": "methods.explain",
    "scope_maps": "methods.explain",
    "source_contribution": "methods.alti_plus",
    "word_shares": "methods.speech",
    "routes": "methods.routes",
    "Routes": "methods.routes",
    "load_explanation": "export.saved",
    "cross_segment_mixing": "analyses.pairs",
    "contextualization_change": "analyses.corpus",
    "corpus_report": "analyses.corpus",
    "ff_amp": "analyses.corpus",
    "ff_outlier_correlations": "analyses.corpus",
    "ff_outliers": "analyses.corpus",
    "ff_report": "analyses.corpus",
    "ff_residual_norms": "analyses.corpus",
    "verify": "verify",
    "estimate_memory": "methods.memory",
    "MemoryEstimate": "methods.memory",
}
# documented submodules reachable as attributes (`ctxmix.data.corpus(...)`, `ctxmix.analysis.ff_amp`)
_SUBMODULES = {
    "engine": "engine",
    "methods": "methods",
    "analyses": "analyses",
    "benchmark": "benchmark",
    "export": "export",
    "service": "service",
    "data": "data",
    "analysis": "analyses.corpus",
    "errors": "errors",
    "hub": "hub",
    "cli": "cli",
    "progress": "progress",
}

__all__ = sorted(_API) + ["__version__"]


_lazy = lazy_getattr(__name__, _API, _SUBMODULES)


def __getattr__(name: str):
    if name not in _API and name not in _SUBMODULES:
        raise AttributeError(f"module 'ctxmix' has no attribute {name!r}")
    value = _lazy(name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API) | set(_SUBMODULES))


if TYPE_CHECKING:  # for type checkers and editors: the names __getattr__ provides
    from . import data  # noqa: F401
    from .analyses import corpus as analysis  # noqa: F401
    from .analyses.corpus import (
        contextualization_change,
        corpus_report,
        ff_amp,  # noqa: F401
        ff_outlier_correlations,
        ff_outliers,
        ff_report,
        ff_residual_norms,
    )
    from .analyses.pairs import cross_segment_mixing  # noqa: F401
    from .benchmark.context.many import attribute_contexts  # noqa: F401
    from .engine.embedded import EMBEDDED  # noqa: F401
    from .engine.models import Model, load_model, model_from_hf  # noqa: F401
    from .engine.trace import Trace, trace  # noqa: F401
    from .errors import BadInput, CtxmixError, ModelLoadError, UnsupportedArchitecture  # noqa: F401
    from .export.context.load import load_context_attribution  # noqa: F401
    from .export.saved import load_explanation  # noqa: F401
    from .methods.alti_plus import source_contribution  # noqa: F401
    from .methods.context.attribution import ContextAttribution, attribute_context  # noqa: F401
    from .methods.context.options import AT2, Ablations, PromptForm  # noqa: F401
    from .methods.explain import explain, explain_batch, scope_maps  # noqa: F401
    from .methods.explanation import Explanation  # noqa: F401
    from .methods.memory import MemoryEstimate, estimate_memory  # noqa: F401
    from .methods.mixing import rollout  # noqa: F401
    from .methods.registry import (  # noqa: F401
        CONTEXT_METHODS,
        METHODS,
        MIXING_METHODS,
        PREDICTION_METHODS,
        SALIENCY_METHODS,
    )
    from .methods.speech import word_shares  # noqa: F401
    from .verify import verify  # noqa: F401
