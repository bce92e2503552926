"""What the dashboard and a hosted copy need, without Streamlit: the results cache (`cache`),
hosted limits and login (`limits`) and the `serve` launcher.
"""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
