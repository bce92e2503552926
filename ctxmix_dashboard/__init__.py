"""The ctxmix dashboard (Streamlit): `ctxmix serve` runs `app.py`, the Explain page, with the
pages in `pages/`; `ui/` holds the layout shared by the pages. Layout only: every number comes
from the `ctxmix` package, which never imports Streamlit."""

from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"
