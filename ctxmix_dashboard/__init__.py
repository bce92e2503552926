"""The ctxmix dashboard (Streamlit). Its files are the repository's top level, as the project's card
promises: `app.py` (the Explain page and the entry) and `pages/` (one file per page), started by
`streamlit run app.py` in a checkout. This package holds what they share (`ui/`: widgets, views, the
login throttle) and `APP`, the entry that `ctxmix serve` starts. A wheel carries the same two top-level
files as `ctxmix_dashboard/toplevel/` (pyproject's package-dir mapping): one copy of every page.
Layout only: every number comes from the `ctxmix` package, which never imports Streamlit."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
# an installed wheel first (its own copy), else the checkout this package sits in (editable installs)
APP = next(
    (p for p in (_HERE / "toplevel" / "app.py", _HERE.parent / "app.py") if p.is_file()),
    _HERE.parent / "app.py",
)
